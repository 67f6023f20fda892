"""A stand-in for a vLLM server, for tests: a FastAPI app speaking the subset of vLLM 0.32's HTTP API that Flywheel's
``VLLMPool`` and ``VLLMEngine`` use (``/v1/models``, ``/tokenize``, ``/inference/v1/generate``, ``/v1/completions``
with token ids, ``/health``), backed by an embedded ``InferenceEngine``, so the ids and log-probs it returns are a real
model's (at the sampling temperature, as vLLM's ``--logprobs-mode processed_logprobs`` gives them).

It is also the fault injector (``ShimFaults``, changed by a test while the app serves): a status for every sampling
request (a 5xx), a delay before answering (a timeout), a stream dropped after some chunks, T=1 log-probs (vLLM's
default ``raw_logprobs``), a tokenizer that disagrees, no token-in route (vLLM without ``--enable-scale-out``).
Like vLLM, it refuses a request for a model it does not serve (a 404 naming it), so a wrong name sent by the engine
fails the tests. Its log-probs at a top-p below 1 are the embedded engine's (before the cut) where vLLM's are the
renormalised nucleus's: ``VLLMEngine`` never sends one.

LoRA adapters, as vLLM serves them with ``--enable-lora`` and ``VLLM_ALLOW_RUNTIME_LORA_UPDATING=1``:
``/v1/load_lora_adapter`` loads a peft adapter directory over a fresh copy of the base model (an embedded engine of
its own), after which a request naming the adapter samples it and ``/v1/models`` lists it;
``/v1/unload_lora_adapter`` drops it. Refusals have vLLM's statuses and messages: a name loaded already (400), a
directory without an adapter (404), an adapter that does not fit the model (500), an unknown name to unload (404).

A weight reload, as vLLM serves it with ``VLLM_SERVER_DEV_MODE=1`` (full fine-tuning): ``/pause`` holds new sampling
requests until ``/resume``, ``/collective_rpc`` runs ``reload_weights(weights_path=DIR)`` (the safetensors in DIR
copied into the base model in place; adapters keep the base they were loaded over), ``/reset_prefix_cache``
answers; without the dev routes (``ShimFaults.dev_routes=False``) they are 404s.
The contract test (tests/test_vllm_contract.py) checks the same behaviour against the real vLLM."""

from __future__ import annotations

import asyncio
import threading
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field

from flywheel.inference.engine import ContextOverflowError, InferenceEngine, TokenEvent
from flywheel.inference.guided import GrammarError, compile_lark_guide
from flywheel.inference.loading import EMBEDDED_MODEL, load_model
from flywheel.inference.lora import fuse_lora_forward
from flywheel.inference.sampling import SamplingParams


@dataclass
class ShimFaults:
    status: int | None = None  # every sampling request answered with this status
    delay_s: float = 0.0  # before a sampling request is answered
    drop_after_chunks: int | None = None  # the connection is cut after this many chunks of a stream
    raw_logprobs: bool = False  # samples (and reports log-probs) at T=1, whatever the request asks
    tokenize_shift: int = 0  # added to every id /tokenize returns
    generate_route: bool = True  # False: /inference/v1/generate answers 403, as vLLM without --enable-scale-out
    dev_routes: bool = True  # False: /pause, /resume, /collective_rpc... 404, as vLLM without VLLM_SERVER_DEV_MODE=1
    # set: each adapter load waits until the event is set (a slow load; a publish caught in flight by a kill)
    hold_loads: threading.Event | None = None
    load_requests: list[str] = field(default_factory=list)  # the adapter names loads were asked for, in order


class _Structured(BaseModel):
    model_config = ConfigDict(extra="ignore")
    grammar: str | None = None


class _Sampling(BaseModel):
    """vLLM's sampling parameters that the shim honours; stop_token_ids are the engine's own end-of-sequence ids."""

    model_config = ConfigDict(extra="ignore")
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    max_tokens: int = 16
    seed: int | None = None
    stop: list[str] = Field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None
    structured_outputs: _Structured | None = None


class _Generate(BaseModel):
    model_config = ConfigDict(extra="ignore")
    model: str | None = None
    token_ids: list[int] = Field(min_length=1)
    sampling_params: _Sampling
    stream: bool = False


class _Completions(_Sampling):
    model: str | None = None
    prompt: list[int] = Field(min_length=1)
    stream: bool = False
    return_token_ids: bool = False


class _Tokenize(BaseModel):
    model_config = ConfigDict(extra="ignore")
    model: str | None = None
    prompt: str
    add_special_tokens: bool = True


class _LoadAdapter(BaseModel):
    model_config = ConfigDict(extra="ignore")
    lora_name: str = ""
    lora_path: str = ""


class _UnloadAdapter(BaseModel):
    model_config = ConfigDict(extra="ignore")
    lora_name: str = ""


class _CollectiveRpc(BaseModel):
    model_config = ConfigDict(extra="ignore")
    method: str
    kwargs: dict[str, str] = Field(default_factory=dict)


def _reload_weights(engine: InferenceEngine, directory: str) -> int:
    """vLLM's worker method ``reload_weights(weights_path=...)``: every ``*.safetensors`` in ``directory`` loaded
    into the model in place, by Hugging Face names (a tied head's copy skipped); returns how many were loaded."""
    from safetensors.torch import load_file

    files = sorted(Path(directory).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors in {directory}")
    params = dict(engine.model.named_parameters())
    weights = {k: v for f in files for k, v in load_file(f).items()}
    unknown = [k for k in weights if k not in params and not k.endswith("lm_head.weight")]
    if unknown:
        raise KeyError(f"weights the model does not have: {unknown[:3]}")
    with engine.exclusive(), torch.no_grad():
        for name, value in weights.items():
            if name in params:
                params[name].copy_(value)
    return len(weights)


def _adapter_engine(engine: InferenceEngine, path: str) -> InferenceEngine:
    """An embedded engine of the base model with the peft adapter in ``path`` (LoRA unmerged, as the trainer's)."""
    from peft import PeftModel

    base, tokenizer, _ = load_model(engine.model.name_or_path, dtype=engine.model.dtype)
    PeftModel.from_pretrained(base, path)  # injects the adapter into ``base`` in place
    fuse_lora_forward(base)
    base.requires_grad_(False)
    return InferenceEngine(base, tokenizer)


def _error(status: int, message: str, type_: str = "BadRequestError", param: str | None = None) -> JSONResponse:
    """vLLM's error shape."""
    body = {"error": {"message": message, "type": type_, "param": param, "code": status}}
    return JSONResponse(body, status_code=status)


def create_shim(engine: InferenceEngine, model: str, faults: ShimFaults | None = None) -> FastAPI:
    """The shim app over ``engine``, serving it as ``model``; ``app.state.faults`` is the ``ShimFaults`` it obeys."""
    app = FastAPI(title="Flywheel's vLLM stand-in")
    app.state.faults = faults = faults or ShimFaults()
    adapters: dict[str, InferenceEngine] = {}  # loaded LoRA adapters by name, each on an engine of its own
    adapter_paths: dict[str, str] = {}  # the directory each was loaded from (vLLM lists it as the adapter's root)
    resumed = asyncio.Event()  # cleared by /pause, set by /resume
    resumed.set()

    def unserved(name: str | None) -> JSONResponse | None:
        """vLLM's answer to a request for a model it does not serve (none named: its own)."""
        if not name or name == model or name in adapters:
            return None
        valid = ", ".join([model, *adapters])
        return _error(404, f"The model `{name}` does not exist. Valid aliases: {valid}.", "NotFoundError", "model")

    def engine_of(name: str | None) -> InferenceEngine:
        return adapters[name] if name in adapters else engine

    def params(sp: _Sampling) -> SamplingParams:
        guide = None
        if sp.structured_outputs is not None and sp.structured_outputs.grammar is not None:
            guide = compile_lark_guide(engine.tokenizer, sorted(engine.eos_ids), sp.structured_outputs.grammar)
        return SamplingParams(
            temperature=1.0 if faults.raw_logprobs else sp.temperature,
            top_p=sp.top_p,
            max_tokens=sp.max_tokens,
            stop=sp.stop,
            seed=sp.seed,
            logprobs=sp.logprobs is not None,
            top_logprobs=sp.logprobs or 0,
            n=sp.n,
            ignore_eos=sp.ignore_eos,
            guide=guide,
        )

    def ranked(event: TokenEvent, k: int | None) -> list[list[tuple[int, float, int | None]]]:
        """Per token, vLLM's list: the sampled token first (with its rank, where it is among the top), then the
        top ones by rank, cut to ``max(k, 1)`` entries."""
        out = []
        for i, token in enumerate(event.token_ids):
            top = event.top_logprobs[i] if event.top_logprobs else []
            rank = next((r + 1 for r, (t, _) in enumerate(top) if t == token), None)
            entries = [(token, event.logprobs[i], rank)]
            entries += [(t, v, r + 1) for r, (t, v) in enumerate(top) if t != token]
            out.append(entries[: max(k or 0, 1)])
        return out

    def generate_choice(event: TokenEvent, k: int | None) -> dict[str, Any]:
        content = None
        if k is not None:
            content = [
                {"token_id": e[0][0], "logprob": e[0][1], "rank": e[0][2],
                 "top_logprobs": [{"token_id": t, "logprob": v, "rank": r} for t, v, r in e]}
                for e in ranked(event, k)
            ]  # fmt: skip
        return {
            "index": event.index,
            "token_ids": event.token_ids,
            "logprobs": None if content is None else {"content": content},
            "finish_reason": event.finish_reason,
        }

    def completion_choice(event: TokenEvent, k: int | None) -> dict[str, Any]:
        logprobs = None
        if k is not None:
            logprobs = {
                "tokens": [f"token_id:{t}" for t in event.token_ids],
                "token_logprobs": event.logprobs,
                "top_logprobs": [{f"token_id:{t}": v for t, v, _ in e} for e in ranked(event, k)],
            }
        return {
            "index": event.index,
            "text": event.text_delta,
            "token_ids": event.token_ids,
            "logprobs": logprobs,
            "finish_reason": event.finish_reason,
        }

    async def answer(prompt: list[int], sp: _Sampling, stream: bool, choice, engine: InferenceEngine) -> Any:
        await resumed.wait()  # paused (a weight reload): requests wait, as vLLM queues them
        if faults.delay_s:
            await asyncio.sleep(faults.delay_s)
        if faults.status is not None:
            return _error(faults.status, f"injected fault: HTTP {faults.status}")
        try:
            sampling = params(sp)
            engine.check_fits(len(prompt), sampling.max_tokens)
        except (GrammarError, ContextOverflowError) as exc:
            return _error(400, str(exc))
        request_id = uuid.uuid4().hex
        if not stream:
            merged: dict[int, TokenEvent] = {}
            async for ev in engine.stream(prompt, sampling):
                merged[ev.index] = merged[ev.index].extend(ev) if ev.index in merged else ev
            return {"id": request_id, "choices": [choice(merged[i], sp.logprobs) for i in sorted(merged)]}

        async def events() -> AsyncIterator[str]:
            sent = 0
            async for ev in engine.stream(prompt, sampling):
                if faults.drop_after_chunks is not None and sent >= faults.drop_after_chunks:
                    raise ConnectionResetError("injected fault: stream dropped")  # uvicorn cuts the connection
                body = {"id": request_id, "choices": [choice(ev, sp.logprobs)]}
                yield f"data: {JSONResponse(body).body.decode()}\n\n"
                sent += 1
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    @app.get("/health")
    async def health():
        return {}

    @app.get("/v1/models")
    async def models():
        card = {
            "id": model,
            "object": "model",
            "owned_by": "vllm",
            "root": model,
            "max_model_len": engine.context_length,
        }
        cards = [card] + [
            {"id": name, "object": "model", "owned_by": "vllm", "root": adapter_paths[name], "parent": model}
            for name in adapters
        ]
        return {"object": "list", "data": cards}

    @app.post("/v1/load_lora_adapter")
    async def load_adapter(body: _LoadAdapter):
        if not body.lora_name or not body.lora_path:
            return _error(400, "Both 'lora_name' and 'lora_path' must be provided.", "InvalidUserInput")
        if body.lora_name == model or body.lora_name in adapters:
            what = "conflicts with a served base model" if body.lora_name == model else "has already been loaded"
            return _error(400, f"The lora adapter '{body.lora_name}' {what}.", "InvalidUserInput")
        if not (Path(body.lora_path) / "adapter_config.json").is_file():
            message = f"Loading lora {body.lora_name} failed: No adapter found for {body.lora_path}"
            return _error(404, message, "NotFoundError")
        faults.load_requests.append(body.lora_name)
        if faults.hold_loads is not None:
            await asyncio.to_thread(faults.hold_loads.wait)
        try:
            adapters[body.lora_name] = await asyncio.to_thread(_adapter_engine, engine, body.lora_path)
            adapter_paths[body.lora_name] = body.lora_path
        except (OSError, ValueError, RuntimeError, KeyError) as exc:  # vLLM: any other failure is a 500
            return _error(500, f"Loading lora {body.lora_name} failed: {exc}", "InternalServerError")
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' added successfully.")

    @app.post("/v1/unload_lora_adapter")
    async def unload_adapter(body: _UnloadAdapter):
        if not body.lora_name:
            return _error(400, "'lora_name' needs to be provided to unload a LoRA adapter.", "InvalidUserInput")
        if (dropped := adapters.pop(body.lora_name, None)) is None:
            return _error(404, f"The lora adapter '{body.lora_name}' cannot be found.", "NotFoundError")
        del adapter_paths[body.lora_name]
        dropped.close(drain=True)
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed successfully.")

    @app.post("/tokenize")
    async def tokenize(body: _Tokenize):
        if (refused := unserved(body.model)) is not None:
            return refused
        ids = engine.tokenizer.encode(body.prompt, add_special_tokens=body.add_special_tokens)
        ids = [t + faults.tokenize_shift for t in ids]
        return {"count": len(ids), "max_model_len": engine.context_length, "tokens": ids}

    @app.post("/inference/v1/generate")
    async def generate(body: _Generate):
        if not faults.generate_route:
            return _error(403, "Scale-out endpoints are disabled. Restart vllm serve with --enable-scale-out.")
        if (refused := unserved(body.model)) is not None:
            return refused
        return await answer(body.token_ids, body.sampling_params, body.stream, generate_choice, engine_of(body.model))

    @app.post("/v1/completions")
    async def completions(body: _Completions):
        if (refused := unserved(body.model)) is not None:
            return refused
        return await answer(body.prompt, body, body.stream, completion_choice, engine_of(body.model))

    # a weight reload, as vLLM serves it with VLLM_SERVER_DEV_MODE=1 (full fine-tuning). The shim's /pause holds new
    # requests; unlike vLLM's mode=wait it does not wait for those in flight (Flywheel's engine waits for them first)

    def no_dev_route() -> JSONResponse | None:
        return None if faults.dev_routes else JSONResponse({"detail": "Not Found"}, status_code=404)

    @app.post("/pause")
    async def pause():
        if (refused := no_dev_route()) is not None:
            return refused
        resumed.clear()
        return {"status": "paused"}

    @app.post("/resume")
    async def resume():
        if (refused := no_dev_route()) is not None:
            return refused
        resumed.set()
        return {"status": "resumed"}

    @app.post("/reset_prefix_cache")
    async def reset_prefix_cache():
        return no_dev_route() or PlainTextResponse("")  # the reload dropped the engine's cached prefixes already

    @app.post("/collective_rpc")
    async def collective_rpc(body: _CollectiveRpc):
        if (refused := no_dev_route()) is not None:
            return refused
        if body.method != "reload_weights":
            return _error(400, f"the stand-in runs only reload_weights, not {body.method}")
        try:
            await asyncio.to_thread(_reload_weights, engine, body.kwargs.get("weights_path", ""))
        except (OSError, KeyError, RuntimeError) as exc:  # vLLM: a failing worker method is a 500
            return _error(500, f"reload_weights failed: {exc}", "InternalServerError")
        return {"results": [None]}

    @app.exception_handler(ValueError)
    async def _bad(_: Request, exc: ValueError):
        return _error(400, str(exc))

    return app


def main() -> None:
    """``python -m flywheel.testing.vllm_shim [--model SPEC] [--served-model-name NAME] [--port N]``: the stand-in
    as a server of its own, for a job or a benchmark to sample through vLLM's protocol without vLLM."""
    import argparse

    import uvicorn

    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("--model", default=EMBEDDED_MODEL, help="the model it samples (a spec load_model takes)")
    parser.add_argument("--served-model-name", default="smol")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    args = parser.parse_args()
    model, tokenizer, _ = load_model(args.model)
    uvicorn.run(create_shim(InferenceEngine(model, tokenizer), args.served_model_name), host=args.host, port=args.port)


if __name__ == "__main__":
    main()
