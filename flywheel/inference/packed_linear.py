"""Linear layers that sample with oneDNN pre-packed weights on CPU.

torch's CPU ``linear`` hands the weight to its GEMM in the plain row-major layout, and the kernel re-lays it out
into its blocked format on every call. At the few rows of a decode step that reorder costs about as much as the
product (the figures: docs/benchmarks.md, "Design figures behind code choices"). The engine therefore packs each
weight the first time it samples with it and reuses the packed copy until the weight changes (a training step, a
checkpoint load).

Linears that read the same input (q/k/v, gate/up) can run as one GEMM on their stacked weights (``concat``), and
so can peft's LoRA layers: their base weights and A matrices stacked, then the B matrices, set out
block-diagonally, in one ``addmm`` onto the base outputs (``inference/lora.py``, whose layer forward computes the
same), instead of three small GEMMs per layer and peft's per-call Python: a shorter LoRA decode step, shorter
still with the B matrices in an ``addmm`` than as a second packed GEMM.

Only inference uses the packed copies: the packed op has no backward, so training runs the layers unchanged.
The packed copies cost one more copy of the linear weights in memory.
"""

from __future__ import annotations

import logging
from typing import NamedTuple

import torch
import torch.nn.functional as F
from peft.tuners.lora import Linear as LoraLinear
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


class Gemm(NamedTuple):
    """What runs a group of linears as one GEMM (``run``): tensors and numbers only, so that a compiled decode step
    can take it as an input (``llama_forward.CompiledDecode``) and a repacked weight is a new input, not a new graph."""

    packed: torch.Tensor  # the stacked base weights (and A matrices), packed
    bias: torch.Tensor | None
    out: int  # width of the base outputs (the A outputs follow them)
    b_t: torch.Tensor | None  # LoRA: the B matrices block-diagonal, transposed ([sum of ranks, out])
    scaling: float


class Plan(NamedTuple):
    """How a group of linears runs, valid while its modules keep ``state`` and its ``weights`` their ``key``."""

    state: tuple
    weights: tuple[torch.Tensor, ...]  # what the packed copies are made of: base weights, A and B matrices
    key: tuple  # their storage and version when planned: a weight replaced or updated in place shows here
    gemm: Gemm | None  # None: the modules run


class PackedLinears:
    """Routes every ``nn.Linear`` of ``model`` through a packed copy of its weight under ``torch.inference_mode``,
    and runs groups of linears that read the same input (``concat``) as one GEMM on their stacked weights.

    What a group needs (whether it stacks, the packed weights, B block-diagonal) is planned once and kept while the
    modules' adapter state and the weights' storage and version stay the same: a weight replaced (``p.data =
    ...``) or updated in place (``p.copy_(...)``) is packed again on next use. Checking that is much cheaper than
    planning each call (peft's attribute lookups), which took a noticeable share of a decode step. Packing runs
    on the calling thread, which for the engine is its worker thread (see ``InferenceEngine.call`` on why torch
    work stays on one thread). A LoRA model samples through peft's layers,
    whose base layers are these."""

    def __init__(self, model: nn.Module):
        self._plans: dict[tuple[nn.Module, ...], Plan] = {}
        self.failed = False  # oneDNN refused to pack on this machine: plain linears from then on
        for module in model.modules():
            if type(module) is nn.Linear:  # not subclasses (quantised layers and the like); peft's wrap these
                module.forward = self._forward_of(module)

    def drop_trainable(self) -> None:
        """Before a weight update (the engine's exclusive hold): drop the plans that hold trainable weights, which
        are about to change (they are packed again on next use). Plans of frozen weights alone stay."""
        for group in [g for g, plan in self._plans.items() if any(w.requires_grad for w in plan.weights)]:
            del self._plans[group]

    def concat(self, x: torch.Tensor, group: tuple[nn.Module, ...]) -> torch.Tensor | None:
        """The outputs of the linears ``group`` on ``x``, concatenated on the last dimension, from one GEMM on
        their stacked weights (q/k/v or gate/up: fewer, larger calls, bit-identical to separate ones). The group
        may be plain linears or peft LoRA layers with one plain adapter each (``plain_adapter``), whose B matrices
        then add onto the base outputs in one ``addmm``. None where neither applies (a mix, DoRA, merged or several
        adapters, a mix of biases, training, no packing here): the caller then calls the modules themselves."""
        gemm = self.ready(group, x.dtype) if x.device.type == "cpu" else None
        if gemm is None:
            return None
        out = run(gemm, x.reshape(-1, x.shape[-1]))
        return out.view(*x.shape[:-1], out.shape[-1])

    def ready(self, group: tuple[nn.Module, ...], dtype: torch.dtype) -> Gemm | None:
        """The GEMM that runs ``group`` (``run``) on CPU inputs of ``dtype``, planned again where the modules'
        state or weights changed since; None where the group cannot run so. A new plan runs once on one
        row here, so that a kernel this CPU lacks shows now, as a fallback, never as a failed forward later."""
        if self.failed or not torch.is_inference_mode_enabled():
            return None
        state, plan = _state(group), self._plans.get(group)
        if plan is None or plan.state != state or plan.key != _key(plan.weights):
            try:
                plan = _plan(group, state)
                if plan.gemm is not None:
                    run(plan.gemm, torch.zeros(1, group[0].in_features, dtype=plan.gemm.packed.dtype))
            except RuntimeError as exc:  # a oneDNN build or CPU without this kernel: slower, never broken
                log.warning("pre-packed linear weights unavailable (%s); sampling with plain linears", exc)
                self.failed = True
                self._plans.clear()
                return None
            self._plans[group] = plan
        return plan.gemm if plan.gemm is not None and plan.gemm.packed.dtype == dtype else None

    def _forward_of(self, module: nn.Linear):
        group = (module,)

        def forward(x: torch.Tensor) -> torch.Tensor:
            out = self.concat(x, group)
            return F.linear(x, module.weight, module.bias) if out is None else out

        return forward


def run(gemm: Gemm, x: torch.Tensor) -> torch.Tensor:
    """A group's outputs on ``x`` [tokens, in_features]: [tokens, out_features of the group]."""
    # torch.compile cannot take a packed weight as a graph input to oneDNN's op (its lowering wants a constant),
    # so a compiled step calls it through an opaque custom op; eager code skips that op's dispatch cost
    linear = packed_linear if torch.compiler.is_compiling() else torch.ops.mkldnn._linear_pointwise.default
    out = linear(x, gemm.packed, gemm.bias, "none", [], "")
    return out if gemm.b_t is None else add_lora(out[:, : gemm.out], out[:, gemm.out :], gemm.b_t, gemm.scaling)


@torch.library.custom_op("flywheel::packed_linear", mutates_args=())
def packed_linear(
    x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None, attr: str, scalars: list[float], algorithm: str
) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, attr, scalars, algorithm)


@packed_linear.register_fake
def _(
    x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None, attr: str, scalars: list[float], algorithm: str
) -> torch.Tensor:
    return x.new_empty(x.shape[0], packed.shape[0])  # a packed weight keeps its logical [out, in] shape


def _key(weights: tuple[torch.Tensor, ...]) -> tuple:
    return tuple((w.data_ptr(), w._version) for w in weights)


def _state(group: tuple[nn.Module, ...]) -> tuple:
    """What decides whether and how a group stacks, besides its weights: the modules' types and peft layers'
    adapter state (``plain_adapter``'s other checks are fixed for an adapter and its weights)."""
    return tuple(
        (LoraLinear, tuple(m.active_adapters), m.merged, m.disable_adapters, m.training, tuple(m.scaling.values()))
        if type(m) is LoraLinear
        else type(m) for m in group
    )  # fmt: skip


def _plan(group: tuple[nn.Module, ...], state: tuple) -> Plan:
    """Whether ``group`` runs as one GEMM, and on what: plain linears' weights stacked, or LoRA layers' base weights
    stacked over their A matrices (the A outputs of each layer then meet only its own block of B)."""
    cannot = Plan(state, (), (), None)
    out = sum(m.out_features for m in group)
    if all(type(m) is nn.Linear for m in group):
        weights, biases, b, scaling = [m.weight for m in group], [m.bias for m in group], [], 1.0
    else:
        adapters = [plain_adapter(m) for m in group]
        if None in adapters or len({m.scaling[a] for m, a in zip(group, adapters)}) > 1:
            return cannot
        bases = [m.base_layer for m in group]
        weights = [m.weight for m in bases] + [m.lora_A[a].weight for m, a in zip(group, adapters)]
        biases = [m.bias for m in bases]
        b, scaling = [m.lora_B[a].weight for m, a in zip(group, adapters)], group[0].scaling[adapters[0]]
    if len({bias is None for bias in biases}) > 1:
        return cannot
    if len({w.dtype for w in weights + b}) > 1:  # planned again once they agree
        return cannot._replace(weights=(*weights, *b), key=_key((*weights, *b)))
    bias = None if biases[0] is None else torch.cat(biases)
    if bias is not None and b:  # the A rows add nothing
        bias = torch.cat([bias, bias.new_zeros(sum(w.shape[0] for w in weights) - out)])
    packed = torch.ops.mkldnn._reorder_linear_weight(torch.cat(weights) if len(weights) > 1 else weights[0], ROWS_HINT)
    b_t = torch.block_diag(*b).T.contiguous() if b else None
    return Plan(state, (*weights, *b), _key((*weights, *b)), Gemm(packed, bias, out, b_t, scaling))
