"""TRL's side of the RL step comparisons (bench/step_time.py, bench/gpu_scale.py): the GRPOTrainer settings that do
the same work as Flywheel's step: DAPO loss with clip 0.2/0.28, no KL, one optimizer step per batch of
``prompts x group`` completions of exactly ``new_tokens`` tokens, gradient checkpointing off (TRL's default is on,
which is slower), nothing saved or reported."""

from __future__ import annotations

from typing import Any


def grpo_config(
    *, output_dir: str, use_cpu: bool, bf16: bool, steps: int, learning_rate: float, prompts: int, group: int,
    new_tokens: int,
) -> Any:  # fmt: skip
    from trl import GRPOConfig

    return GRPOConfig(
        output_dir=output_dir, use_cpu=use_cpu, bf16=bf16, max_steps=steps, learning_rate=learning_rate,
        per_device_train_batch_size=prompts * group, num_generations=group, gradient_accumulation_steps=1,
        max_completion_length=new_tokens, generation_kwargs={"min_new_tokens": new_tokens}, temperature=1.0,
        loss_type="dapo", epsilon=0.2, epsilon_high=0.28, beta=0.0, scale_rewards="group", num_iterations=1,
        gradient_checkpointing=False, shuffle_dataset=False, logging_steps=1, report_to=[], save_strategy="no",
        dataloader_num_workers=0, seed=0,
    )  # fmt: skip


def train_lora(
    model: Any, tokenizer: Any, reward: Any, config: Any, rows: list[dict], lora: Any, callback: Any
) -> None:
    """GRPOTrainer over ``rows`` with a LoRA adapter of Flywheel's shape (``lora``: a TrainedWeights) on ``model``."""
    from datasets import Dataset
    from peft import LoraConfig
    from trl import GRPOTrainer

    peft_config = LoraConfig(
        r=lora.rank, lora_alpha=lora.alpha, lora_dropout=0.0, target_modules=lora.targets, task_type="CAUSAL_LM"
    )
    trainer = GRPOTrainer(
        model=model, reward_funcs=[reward], args=config, train_dataset=Dataset.from_list(rows),
        processing_class=tokenizer, peft_config=peft_config, callbacks=[callback],
    )  # fmt: skip
    trainer.train()
