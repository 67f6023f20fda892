"""Handing freed memory back to the operating system.

glibc serves freed blocks below its mmap threshold from per-thread heaps and keeps them there; the threshold rises
to the size of the largest block freed so far (up to 32 MB), so once a KV buffer of ~25 MB has been freed, later
buffers of that size live in the heap too, and memory freed by growing or releasing the KV cache stays in the
process. ``malloc_trim`` returns the free pages anywhere in those heaps.

The other way round, within a phase: glibc also gives the top of a heap back by itself once more than its trim
threshold (twice the mmap threshold) is free there, and a decode step frees all it allocated, so every step
faulted fresh pages in again (the figures: docs/benchmarks.md, "Design figures behind code choices").
``keep_freed_memory`` fixes both thresholds, so that a step reuses the last step's pages; the engine's own trims
hand them back between phases.
"""

from __future__ import annotations

import ctypes
import gc

try:
    _libc = ctypes.CDLL("libc.so.6")
    _malloc_trim, _mallopt = _libc.malloc_trim, _libc.mallopt
except (OSError, AttributeError):  # not glibc: nothing to do
    _malloc_trim = _mallopt = None
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # glibc's malloc.h
MMAP_THRESHOLD = 32 << 20  # where glibc's own threshold ends up (its maximum) once a KV buffer was freed
TRIM_THRESHOLD = 128 << 20  # free memory a heap may keep at its top between explicit trims


def trim_heap() -> None:
    """Give free heap pages back to the OS (a cost of its own: docs/benchmarks.md)."""
    if _malloc_trim is not None:
        _malloc_trim(0)


def keep_freed_memory() -> None:
    """Fix glibc's mmap and trim thresholds for this process (see above): blocks up to 32 MB come from the heaps, and
    up to 128 MB freed at a heap's top stay there for the next step instead of being faulted in again."""
    if _mallopt is not None:
        _mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD)
        _mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD)


def release_free_memory() -> None:
    """Collect young garbage, then trim the heap: between phases (sampling, a weight update). Only generations 0
    and 1: what a phase leaves in reference cycles is young, and a full collection walks every object of the
    process (~540k with transformers and peft loaded, a noticeable pause twice per training step, freeing
    nothing)."""
    gc.collect(1)
    trim_heap()


def freeze_objects() -> None:
    """Collect, then move every object alive now out of the collector's sight (``gc.freeze``): a loaded model with
    transformers and peft is ~480k tracked objects that live as long as the engine, and an automatic full
    collection walks them all (holding the GIL, so the engine stalls mid-step), freeing none of them. Called
    when an engine starts; ``thaw_objects`` when one closes, so that what it leaves in reference cycles can go."""
    gc.collect()
    gc.freeze()


def thaw_objects() -> None:
    """Undo ``freeze_objects``: every frozen object is collectable again (engines still open lose the benefit until
    the next one starts)."""
    gc.unfreeze()
