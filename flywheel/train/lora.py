"""LoRA layers' forward while training: the adapter's product added inside its last GEMM.

peft computes ``base(x) + lora_B(lora_A(dropout(x))) * scaling``: after the three GEMMs, a multiply and an add
over the whole [tokens, out_features] output, and their backward passes, for each of the 210 adapted layers of
a 135M model. Here the B GEMM is an ``addmm`` onto the base output with ``alpha = scaling``: the same sum in one
kernel (rounded once, not three times). Layers where that is not the same function (dropout, DoRA, several or
merged adapters, a bias on B) keep peft's forward, as does sampling (eval mode), whose stacked GEMMs are
``PackedLinears.concat``.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from peft.tuners.lora import Linear as LoraLinear
from torch import nn

from flywheel.inference.packed_linear import plain_adapter


def fuse_training_forward(model: nn.Module) -> int:
    """Give every peft LoRA layer of ``model`` the fused forward for training (falling back to peft's own where
    it does not apply, checked at each call); returns how many layers got it."""
    layers = [m for m in model.modules() if type(m) is LoraLinear]
    for module in layers:
        module.forward = _forward_of(module, module.forward)
    return len(layers)


def _forward_of(module: LoraLinear, peft_forward: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    def forward(x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        adapter = plain_adapter(module) if module.training and not args and not kwargs else None
        if adapter is None or not isinstance(module.lora_dropout[adapter], nn.Identity):
            return peft_forward(x, *args, **kwargs)
        a, b = module.lora_A[adapter].weight, module.lora_B[adapter].weight
        if x.dtype != a.dtype and not torch.is_autocast_enabled(x.device.type):
            return peft_forward(x, *args, **kwargs)  # peft casts the input to the adapter's dtype
        base = module.base_layer(x)
        lora_a = F.linear(x, a).reshape(-1, a.shape[0])
        out = torch.addmm(base.reshape(-1, base.shape[-1]), lora_a, b.T, alpha=module.scaling[adapter])
        return out.view(base.shape)

    return forward
