"""Linear layers that sample with oneDNN pre-packed weights on CPU.

torch's CPU ``linear`` hands the weight to its GEMM in the plain row-major layout, and the kernel re-lays it out
into its blocked format on every call. At the few rows of a decode step that reorder costs about as much as the
product: the 211 linears of a SmolLM2-135M decode step at 32 rows take 37 ms in bf16 and 72 ms in fp32, and 25 ms
and 44 ms with weights packed once (docs/benchmarks.md). The engine therefore packs each weight the first time it
samples with it and reuses the packed copy until the weight changes (a training step, a checkpoint load).

Only inference uses the packed copies: the packed op has no backward, so training runs the layers unchanged.
The packed copies cost one more copy of the linear weights in memory.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch import nn

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
        self._packed: dict[tuple[nn.Linear, ...], tuple[tuple, torch.Tensor, torch.Tensor | None]] = {}
        self.failed = False  # oneDNN refused to pack on this machine: plain linears from then on
        for module in model.modules():
            if type(module) is nn.Linear:  # not subclasses (quantised layers and the like); peft's wrap these
                module.forward = self._forward_of(module)

    def drop_trainable(self) -> None:
        """Before a weight update (the engine's exclusive hold): drop the packed copies of trainable weights, which
        are about to change (they are packed again on next use). Frozen ones, e.g. a LoRA model's base, stay."""
        for group in [g for g in self._packed if any(m.weight.requires_grad for m in g)]:
            del self._packed[group]

    def concat(self, x: torch.Tensor, group: tuple[nn.Module, ...]) -> torch.Tensor | None:
        """The outputs of the linears ``group`` on ``x``, concatenated on the last dimension, from one GEMM on
        their stacked weights (for q/k/v or gate/up: fewer, larger calls, bit-identical to separate ones). None
        where that does not apply (a LoRA layer, a mix of biases, training, no packing here): the caller then
        calls the modules themselves."""
        if not all(type(m) is nn.Linear for m in group) or len({m.bias is None for m in group}) > 1:
            return None
        return self._apply(x, group)

    def _apply(self, x: torch.Tensor, group: tuple[nn.Linear, ...]) -> torch.Tensor | None:
        first = group[0].weight
        if self.failed or not torch.is_inference_mode_enabled() or x.dtype != first.dtype or x.device.type != "cpu":
            return None
        key = tuple((m.weight.data_ptr(), m.weight._version) for m in group)
        entry = self._packed.get(group)
        try:
            if entry is None or entry[0] != key:
                weight = torch.cat([m.weight for m in group]) if len(group) > 1 else first
                bias = None if group[0].bias is None else torch.cat([m.bias for m in group])
                entry = self._packed[group] = (key, torch.ops.mkldnn._reorder_linear_weight(weight, ROWS_HINT), bias)
            out = torch.ops.mkldnn._linear_pointwise(x.reshape(-1, x.shape[-1]), entry[1], entry[2], "none", [], "")
        except RuntimeError as exc:  # a oneDNN build or CPU without this kernel: slower, never broken
            log.warning("pre-packed linear weights unavailable (%s); sampling with plain linears", exc)
            self.failed = True
            self._packed.clear()
            return None
        return out.view(*x.shape[:-1], out.shape[-1])

    def _forward_of(self, module: nn.Linear):
        def forward(x: torch.Tensor) -> torch.Tensor:
            out = self._apply(x, (module,))
            return F.linear(x, module.weight, module.bias) if out is None else out

        return forward
