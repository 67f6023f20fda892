"""Linear layers that sample with oneDNN pre-packed weights on CPU.

torch's CPU ``linear`` hands the weight to its GEMM in the plain row-major layout, and the kernel re-lays it out
into its blocked format on every call. At the few rows of a decode step that reorder costs about as much as the
product: the 211 linears of a SmolLM2-135M decode step at 32 rows take 37 ms in bf16 and 72 ms in fp32, and 25 ms
and 44 ms with weights packed once (docs/benchmarks.md). The engine therefore packs each weight the first time it
samples with it and reuses the packed copy until the weight changes (a training step, a checkpoint load).

Linears that read the same input (q/k/v, gate/up) can run as one GEMM on their stacked weights (``concat``), and
so can peft's LoRA layers: their base weights and A matrices stacked, then the B matrices, set out
block-diagonally, in one ``addmm`` onto the base outputs (``inference/lora.py``, whose layer forward computes the
same), instead of three small GEMMs per layer and peft's per-call Python (a LoRA decode step of SmolLM2-135M at
32 rows: 92 -> 68 ms in bf16 with B as a second packed GEMM; the addmm then saved ~2 ms more per step).

Only inference uses the packed copies: the packed op has no backward, so training runs the layers unchanged.
The packed copies cost one more copy of the linear weights in memory.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from flywheel.inference.lora import add_lora, plain_adapter

log = logging.getLogger(__name__)
ROWS_HINT = 32  # the kernel is chosen for this many rows; it runs any number (prefill, decode)


def packing_available(model: nn.Module) -> bool:
    """oneDNN packs fp32 weights anywhere, bf16 weights only where the CPU has native bf16."""
    p = next(model.parameters())
    if p.device.type != "cpu" or not torch.backends.mkldnn.is_available():
        return False
    if p.dtype == torch.bfloat16:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    return p.dtype == torch.float32


class PackedLinears:
    """Routes every ``nn.Linear`` of ``model`` through a packed copy of its weight under ``torch.inference_mode``,
    and runs groups of linears that read the same input (``concat``) as one GEMM on their stacked weights.

    A packed copy is keyed on its weights' storage and version, so a weight replaced (``p.data = ...``) or updated
    in place (``p.copy_(...)``) is packed again on next use. Packing runs on the calling thread, which for the
    engine is its worker thread (see ``InferenceEngine.call`` on why torch work stays on one thread). A LoRA
    model samples through peft's layers, whose base layers are these."""

    def __init__(self, model: nn.Module):
        # (modules, B matrices?) -> (their weights' storage and version, packed weight, bias)
        self._packed: dict[tuple[tuple[nn.Module, ...], bool], tuple[tuple, torch.Tensor, torch.Tensor | None]] = {}
        self.failed = False  # oneDNN refused to pack on this machine: plain linears from then on
        for module in model.modules():
            if type(module) is nn.Linear:  # not subclasses (quantised layers and the like); peft's wrap these
                module.forward = self._forward_of(module)

    def drop_trainable(self) -> None:
        """Before a weight update (the engine's exclusive hold): drop the packed copies that hold trainable weights,
        which are about to change (they are packed again on next use). Copies of frozen weights alone stay."""
        for slot in [s for s in self._packed if any(p.requires_grad for m in s[0] for p in m.parameters())]:
            del self._packed[slot]

    def concat(self, x: torch.Tensor, group: tuple[nn.Module, ...]) -> torch.Tensor | None:
        """The outputs of the linears ``group`` on ``x``, concatenated on the last dimension, from one GEMM on
        their stacked weights (q/k/v or gate/up: fewer, larger calls, bit-identical to separate ones). The group
        may be plain linears or peft LoRA layers with one plain adapter each (``_adapter``). None where neither
        applies (a mix, DoRA, merged or several adapters, a mix of biases, training, no packing here): the caller
        then calls the modules themselves."""
        if all(type(m) is nn.Linear for m in group):
            if len({m.bias is None for m in group}) > 1:
                return None
            return self._apply(x, group)
        adapters = [_adapter(m) for m in group]
        if None in adapters or len({m.scaling[a] for m, a in zip(group, adapters)}) > 1:
            return None
        joint = self._apply(x, group, adapters)  # [..., base outputs then the A outputs]
        if joint is None:
            return None
        out = sum(m.out_features for m in group)
        return add_lora(joint[..., :out], joint[..., out:], self._block_b(group, adapters), group[0].scaling[adapters[0]])

    def _block_b(self, group: tuple[nn.Module, ...], adapters: list[str]) -> torch.Tensor:
        """The group's B matrices block-diagonal, transposed ([sum of ranks, sum of outputs]), cached like the
        packed weights: the A outputs of each layer meet only its own B."""
        weights = [m.lora_B[a].weight for m, a in zip(group, adapters)]
        return self._cached((group, True), weights, lambda: (torch.block_diag(*weights).T.contiguous(), None))[0]

    def _cached(
        self, slot: tuple, weights: list[torch.Tensor], build: Callable[[], tuple[torch.Tensor, torch.Tensor | None]]
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """What ``build()`` made from ``weights`` for ``slot``, made again only once a weight was replaced or
        updated in place (its storage or version changed)."""
        key = tuple((w.data_ptr(), w._version) for w in weights)
        entry = self._packed.get(slot)
        if entry is None or entry[0] != key:
            entry = self._packed[slot] = (key, *build())
        return entry[1:]

    def _apply(self, x: torch.Tensor, group: tuple[nn.Module, ...], adapters: list[str] | None = None) -> torch.Tensor | None:
        """``x`` through one packed GEMM: for plain linears their stacked weights; for LoRA layers the base weights
        stacked over the A matrices."""
        if adapters is None:
            weights, biases = [m.weight for m in group], [m.bias for m in group]
        else:
            weights = [m.base_layer.weight for m in group] + [m.lora_A[a].weight for m, a in zip(group, adapters)]
            biases = [m.base_layer.bias for m in group]
        first = weights[0]
        if self.failed or not torch.is_inference_mode_enabled() or x.dtype != first.dtype or x.device.type != "cpu":
            return None
        if any(w.dtype != first.dtype for w in weights):
            return None

        def pack() -> tuple[torch.Tensor, torch.Tensor | None]:
            weight = torch.cat(weights) if len(weights) > 1 else first
            bias = None if biases[0] is None else torch.cat(biases)
            if bias is not None and adapters is not None:  # the A rows add nothing
                bias = torch.cat([bias, bias.new_zeros(weight.shape[0] - bias.shape[0])])
            return torch.ops.mkldnn._reorder_linear_weight(weight, ROWS_HINT), bias

        try:
            packed, bias = self._cached((group, False), weights, pack)
            out = torch.ops.mkldnn._linear_pointwise(x.reshape(-1, x.shape[-1]), packed, bias, "none", [], "")
        except RuntimeError as exc:  # a oneDNN build or CPU without this kernel: slower, never broken
            log.warning("pre-packed linear weights unavailable (%s); sampling with plain linears", exc)
            self.failed = True
            self._packed.clear()
            return None
        return out.view(*x.shape[:-1], out.shape[-1])

    def _forward_of(self, module: nn.Linear):
        def forward(x: torch.Tensor) -> torch.Tensor:
            out = self._apply(x, (module,))  # one plain linear: none of concat's group checks apply
            return F.linear(x, module.weight, module.bias) if out is None else out

        return forward


def _adapter(module: nn.Module) -> str | None:
    """``plain_adapter``, in eval mode: what ``concat`` can stack."""
    return None if module.training else plain_adapter(module)
