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
    """Routes every ``nn.Linear`` of ``model`` through a packed copy of its weight under ``torch.inference_mode``.

    A packed copy is keyed on its weight's storage and version, so a weight replaced (``p.data = ...``) or updated
    in place (``p.copy_(...)``) is packed again on next use. Packing runs on the calling thread, which for the
    engine is its worker thread (see ``InferenceEngine.call`` on why torch work stays on one thread). A LoRA
    model samples through peft's layers, whose base layers are these."""

    def __init__(self, model: nn.Module):
        self._packed: dict[nn.Linear, tuple[tuple[int, int], torch.Tensor]] = {}
        self.failed = False  # oneDNN refused to pack on this machine: plain linears from then on
        for module in model.modules():
            if type(module) is nn.Linear:  # not subclasses (quantised layers and the like); peft's wrap these
                module.forward = self._forward_of(module)

    def drop_trainable(self) -> None:
        """Before a weight update (the engine's exclusive hold): drop the packed copies of trainable weights, which
        are about to change (they are packed again on next use). Frozen ones, e.g. a LoRA model's base, stay."""
        for module in [m for m in self._packed if m.weight.requires_grad]:
            del self._packed[module]

    def _forward_of(self, module: nn.Linear):
        def forward(x: torch.Tensor) -> torch.Tensor:
            w = module.weight
            if self.failed or not torch.is_inference_mode_enabled() or x.dtype != w.dtype or x.device.type != "cpu":
                return F.linear(x, w, module.bias)
            key = (w.data_ptr(), w._version)
            entry = self._packed.get(module)
            try:
                if entry is None or entry[0] != key:
                    entry = self._packed[module] = (key, torch.ops.mkldnn._reorder_linear_weight(w, ROWS_HINT))
                out = torch.ops.mkldnn._linear_pointwise(x.reshape(-1, x.shape[-1]), entry[1], module.bias, "none", [], "")
            except RuntimeError as exc:  # a oneDNN build or CPU without this kernel: slower, never broken
                log.warning("pre-packed linear weights unavailable (%s); sampling with plain linears", exc)
                self.failed = True
                self._packed.clear()
                return F.linear(x, w, module.bias)
            return out.view(*x.shape[:-1], out.shape[-1])

        return forward
