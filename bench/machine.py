"""What a benchmark ran on, for its JSON result: results from different CPUs are not comparable (e.g. AMX bf16
on Intel Sapphire Rapids vs AVX512-BF16 only on AMD Zen 4 changes bf16 matmul speed several-fold)."""

from __future__ import annotations

import json
import platform
import time
from pathlib import Path

import torch

FLAGS_OF_INTEREST = ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile")


def describe() -> dict:
    cpu, flags = platform.processor() or platform.machine(), set()
    info = Path("/proc/cpuinfo")
    if info.exists():
        for line in info.read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name":
                cpu = value.strip()
            elif key.strip() == "flags":
                flags = set(value.split())
            if flags and cpu:
                break
    return {
        "platform": platform.platform(),
        "cpu": cpu,
        "cpu_flags": [f for f in FLAGS_OF_INTEREST if f in flags],
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
    }


def save_result(name: str, result: dict) -> Path:
    """Write ``result`` to bench/results/<name>-<time>.json and print the path."""
    out = Path(__file__).parent / "results" / time.strftime(f"{name}-%Y%m%d-%H%M%S.json")
    out.write_text(json.dumps(result, indent=1))
    print(out)
    return out
