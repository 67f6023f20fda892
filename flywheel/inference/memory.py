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
