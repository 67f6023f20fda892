"""Data-parallel training on replicas (issue #40, the trainer on several devices or processes): ``Replicas``, the ranks
of a ``torch.distributed`` process group that each hold the whole model and train one step's batch together.

Every rank is given the same groups and packs them the same way; each computes the gradients of its share of the
micro-batches (``share``: balanced by row length, so shares may differ in count), the ranks sum the fp32 master
gradients (``sum_gradients``: one all-reduce per optimizer step, one flat buffer), and every replica then takes the
optimizer step one process would take on the whole batch, so the replicas stay equal without a broadcast. A sum, not
the average DDP and FSDP take: Flywheel's losses are normalised over the whole batch already (``loss.py``), and
averaging would shrink every step by the world size. No collective runs inside a forward or backward pass, so ranks
need not run equal numbers of micro-batches. The step's metrics are reduced the same way (``sum``, ``reduce_stats``),
so every rank reports the whole batch's. For LoRA, and full fine-tuning of a model that fits one device; sharding the
model (FSDP2) is not built yet.

Launch: one process per device (``torchrun``), each ``init_process_group`` (NCCL on GPUs, gloo on CPUs). Rank 0 runs
the training script on ``LocalBackend(replicas=Replicas())``: its trainer ``lead``s every call that trains or loads
weights (the groups, the config, the checkpoint: pickled to the others), and the trainer is made equal on every rank
when the model registers (``Trainer.replicate``: a LoRA adapter's initialisation is random per process). The other
ranks build a trainer on the same base model and ``Replicas().follow(trainer)`` until rank 0's backend closes."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, TypeVar

import torch
import torch.distributed as dist

if TYPE_CHECKING:
    from flywheel.train.trainer import Trainer

T = TypeVar("T")
STOP = "stop"  # what rank 0 leads when its backend closes: the followers return


def share(items: Sequence[T], sizes: Sequence[int], rank: int, world: int) -> list[T]:
    """Rank ``rank``'s items of ``world``: each, the largest first, goes to the rank with the least size so far (ties:
    the lowest rank). Every rank computes the same assignment, so the shares partition ``items``; kept in order."""
    loads = [0] * world
    mine = []
    for i in sorted(range(len(items)), key=lambda i: -sizes[i]):
        least = min(range(world), key=lambda r: loads[r])
        loads[least] += sizes[i]
        if least == rank:
            mine.append(i)
    return [items[i] for i in sorted(mine)]


class Replicas:
    """This process's rank among the replicas of ``group`` (default: the whole world)."""

    def __init__(self, group: dist.ProcessGroup | None = None):
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError(
                "Replicas need torch.distributed set up first: torch.distributed.init_process_group(...) in each "
                "process (torchrun sets the variables it reads; gloo on CPUs, nccl on GPUs)."
            )
        self.group = group
        self.rank, self.world = dist.get_rank(group), dist.get_world_size(group)

    def share(self, items: Sequence[T], sizes: Sequence[int]) -> list[T]:
        """This rank's items (``share``)."""
        return share(items, sizes, self.rank, self.world)

    def broadcast(self, tensors: Sequence[torch.Tensor]) -> None:
        """Every rank's ``tensors`` become rank 0's (in place, one flat buffer)."""
        if not tensors:
            return
        flat = torch.cat([t.detach().reshape(-1) for t in tensors])
        dist.broadcast(flat, src=self._first, group=self.group)
        offset = 0
        with torch.no_grad():
            for t in tensors:
                t.copy_(flat[offset : offset + t.numel()].view_as(t))
                offset += t.numel()

    def lead(self, method: str, *args: Any) -> None:
        """On rank 0: every other rank (``follow``) is to call ``trainer.<method>(*args)`` as this one is about to, so
        the collectives of the call meet. Elsewhere: nothing."""
        if self.rank == 0 and self.world > 1:
            dist.broadcast_object_list([(method, args)], src=self._first, group=self.group)

    def follow(self, trainer: Trainer) -> None:
        """On the other ranks: ``trainer`` (on the same base model) made equal to rank 0's (``replicate``), then
        called with what rank 0 leads (its steps, loads, references) until rank 0 stops (its backend's close)."""
        trainer.replicate(self)
        while True:
            box: list[Any] = [None]
            dist.broadcast_object_list(box, src=self._first, group=self.group)
            method, args = box[0]
            if method == STOP:
                return
            getattr(trainer, method)(*args)

    def stop(self) -> None:
        """On rank 0: the other ranks' ``follow`` returns."""
        self.lead(STOP)

    @property
    def _first(self) -> int:
        """Rank 0 of the group, as the global rank collectives name their source by."""
        return dist.get_global_rank(self.group, 0) if self.group is not None else 0

    def sum_gradients(self, params: Sequence[torch.Tensor]) -> None:
        """Each parameter's gradient becomes the sum of every rank's (a rank without one counts zeros)."""
        if not params:
            return
        flat = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) for p in params])
        dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=self.group)
        offset = 0
        for p in params:
            p.grad = flat[offset : offset + p.numel()].view_as(p)
            offset += p.numel()

    def sum(self, values: Sequence[float]) -> list[float]:
        """Each value summed over the ranks (fp64)."""
        tensor = torch.tensor(list(values), dtype=torch.float64)
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=self.group)
        return tensor.tolist()

    def broadcast_object(self, value: T) -> T:
        """Rank 0's ``value``, on every rank (pickled)."""
        box = [value]
        dist.broadcast_object_list(box, src=self._first, group=self.group)
        return box[0]

    def reduce_stats(self, stats: dict[str, float]) -> dict[str, float]:
        """``loss.ratio_stats`` of every rank's share combined: counts and sums summed, ``ratio_max`` the max."""
        keys = sorted(k for k in stats if k != "ratio_max")
        reduced = {k: type(stats[k])(v) for k, v in zip(keys, self.sum([stats[k] for k in keys]))}  # ints stay
        top = torch.tensor([stats["ratio_max"]], dtype=torch.float64)
        dist.all_reduce(top, op=dist.ReduceOp.MAX, group=self.group)
        return reduced | {"ratio_max": float(top)}
