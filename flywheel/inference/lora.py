"""peft LoRA layers' forward, for sampling and training alike: the adapter's product added inside its last GEMM.

peft computes ``base(x) + lora_B(lora_A(dropout(x))) * scaling``: after the three GEMMs, a multiply and an add
over the whole [tokens, out_features] output (and in training their backward passes), for each of the 210 adapted
layers of a 135M model. Here the B GEMM is an ``addmm`` onto the base output with ``alpha = scaling``: the same sum
in one kernel, rounded once instead of three times. ``PackedLinears.concat`` computes the same ``addmm`` for
stacked groups, so the sampler's layer loop, the HF forward and the trainer agree to the last bit where their
GEMMs do. Layers where this is not the same function (dropout while training, DoRA and other variants, several
or merged adapters, a bias on B) keep peft's forward.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from peft.tuners.lora import Linear as LoraLinear
from torch import nn


def plain_adapter(module: nn.Module) -> str | None:
    """The one adapter through which a peft LoRA layer would run now, if it is plain LoRA: active, unmerged, no
    DoRA or other variant, no bias of its own, over a plain linear, no dropout in effect. None for anything else."""
    if type(module) is not LoraLinear or module.disable_adapters or module.merged:
        return None
    active = [a for a in module.active_adapters if a in module.lora_A]
    if len(active) != 1 or active[0] in module.lora_variant or type(module.base_layer) is not nn.Linear:
        return None
    adapter = active[0]
    if module.lora_B[adapter].bias is not None or (
        module.training and not isinstance(module.lora_dropout[adapter], nn.Identity)
    ):
        return None
    return adapter


def add_lora(
    base: torch.Tensor, lora_a: torch.Tensor, b_t: torch.Tensor, scaling: float, *, into_base: bool = False
) -> torch.Tensor:
    """``base + scaling * lora_a @ b_t`` in one GEMM: base [..., out], lora_a [..., r], b_t [r, out]. With
    ``into_base`` the sum is written into ``base`` itself (a fresh contiguous tensor of the caller's) instead of
    into a copy of it."""
    lora_a = lora_a.reshape(-1, lora_a.shape[-1])
    if into_base:
        base.view(-1, base.shape[-1]).addmm_(lora_a, b_t.to(base.dtype), alpha=scaling)
        return base
    out = torch.addmm(base.reshape(-1, base.shape[-1]), lora_a, b_t, alpha=scaling)
    return out.view(*base.shape[:-1], out.shape[-1])


def fuse_lora_forward(model: nn.Module) -> int:
    """Give every peft LoRA layer of ``model`` the fused forward (falling back to peft's own where it does not
    apply, checked at each call); returns how many layers got it (those that had it already are left as they are)."""
    layers = [m for m in model.modules() if type(m) is LoraLinear and "forward" not in vars(m)]
    for module in layers:
        module.forward = _forward_of(module, module.forward)
    return len(layers)


def _forward_of(module: LoraLinear, peft_forward: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    def forward(x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        adapter = plain_adapter(module) if not args and not kwargs else None
        if adapter is None:
            return peft_forward(x, *args, **kwargs)
        a, b = module.lora_A[adapter].weight, module.lora_B[adapter].weight
        if x.dtype != a.dtype and not torch.is_autocast_enabled(x.device.type):
            return peft_forward(x, *args, **kwargs)  # peft casts the input to the adapter's dtype
        return add_lora(module.base_layer(x), F.linear(x, a), b.T, module.scaling[adapter], into_base=True)

    return forward
