"""Handing freed memory back to the operating system.

glibc serves freed blocks below its mmap threshold from per-thread heaps and keeps them there; the threshold rises
to the size of the largest block freed so far (up to 32 MB), so once a KV buffer of ~25 MB has been freed, later
buffers of that size live in the heap too, and memory freed by growing or releasing the KV cache stays in the
process. ``malloc_trim`` returns the free pages anywhere in those heaps.
"""

from __future__ import annotations

import ctypes
import gc

try:
    _malloc_trim = ctypes.CDLL("libc.so.6").malloc_trim
except (OSError, AttributeError):  # not glibc: nothing to do
    _malloc_trim = None


def trim_heap() -> None:
    """Give free heap pages back to the OS (a few milliseconds)."""
    if _malloc_trim is not None:
        _malloc_trim(0)


def release_free_memory() -> None:
    """Collect young garbage, then trim the heap: between phases (sampling, a weight update). Only generations 0
    and 1: what a phase leaves in reference cycles is young, and a full collection walks every object of the
    process (~540k with transformers and peft loaded: ~0.3 s, twice per training step, freeing nothing)."""
    gc.collect(1)
    trim_heap()


def freeze_objects() -> None:
    """Collect, then move every object alive now out of the collector's sight (``gc.freeze``): a loaded model with
    transformers and peft is ~480k tracked objects that live as long as the engine, and an automatic full
    collection walks them all (~0.25 s, holding the GIL, so the engine stalls mid-step), freeing none of them. Called
    when an engine starts; ``thaw_objects`` when one closes, so that what it leaves in reference cycles can go."""
    gc.collect()
    gc.freeze()


def thaw_objects() -> None:
    """Undo ``freeze_objects``: every frozen object is collectable again (engines still open lose the benefit until
    the next one starts)."""
    gc.unfreeze()
