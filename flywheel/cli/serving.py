"""``flywheel prepare | serve | runner``: a model resolved to a local checkpoint, served over an OpenAI-compatible
API with the gateway in front of it, and an agent run on the gateway's rollout queue."""

from __future__ import annotations

import asyncio
from enum import StrEnum
from pathlib import Path
from typing import Annotated

import typer

from flywheel.cli.common import VLLMApiKey, console, fail, open_store
from flywheel.inference.names import EMBEDDED_MODEL

DTYPES = {"auto": None, "bf16": "bfloat16", "fp32": "float32"}


def _dtype(name: str):
    import torch

    if name not in DTYPES:
        raise typer.BadParameter(f"dtype must be one of {', '.join(DTYPES)}")
    return getattr(torch, DTYPES[name]) if DTYPES[name] else None


class RedactScope(StrEnum):
    """``flywheel serve --redact``: whose calls are redacted before they are stored."""

    production = "production"
    all = "all"
    none = "none"


def prepare(
    model: Annotated[str, typer.Option(help="Model spec to resolve (and convert once if GGUF).")] = EMBEDDED_MODEL,
    chat_template: Annotated[
        Path | None,
        typer.Option(
            help="A Jinja chat template file to give the checkpoint (for a GGUF that carries none); checked, then "
            "saved as its chat_template.jinja, so every later use of the model formats chats with it."
        ),
    ] = None,
):
    """Resolve a model to a local safetensors checkpoint, converting GGUF once, and print where it is."""
    from flywheel.inference.loading import ModelNotFoundError, resolve_model, set_chat_template

    try:
        template = None if chat_template is None else chat_template.read_text(encoding="utf-8")
        resolved = resolve_model(model)
        if template is not None:
            written = set_chat_template(resolved, template, str(chat_template))
            console.print(f"chat template from {chat_template} saved as {written}")
    except (ModelNotFoundError, OSError, ValueError) as exc:  # ValueError: a bad template, or a file not UTF-8
        fail(str(exc))
    console.print(f"{resolved.name}: {resolved.path}")


def serve(
    model: Annotated[str, typer.Option(help="Embedded name, local HF checkpoint dir, or .gguf file.")] = EMBEDDED_MODEL,
    host: Annotated[str, typer.Option()] = "127.0.0.1",
    port: Annotated[int, typer.Option()] = 8000,
    max_batch: Annotated[int, typer.Option(help="Most sequences decoded together.")] = 64,
    dtype: Annotated[str, typer.Option(help="auto (bf16 where the CPU has it) | bf16 | fp32")] = "auto",
    compile: Annotated[
        bool,
        typer.Option(
            help="Compile the decode step (torch.compile; needs a C++ compiler, ~1-2 min at start): faster at few concurrent requests."
        ),
    ] = False,
    db: Annotated[
        str | None,
        typer.Option(
            help="Database of the episodes recorded through /episodes (default: $FLYWHEEL_DB, else SQLite in $FLYWHEEL_HOME)."
        ),
    ] = None,
    api_keys: Annotated[
        Path | None,
        typer.Option(
            help="File of API keys, one 'role key' per line (roles: agent, runner, admin), with those of $FLYWHEEL_API_KEYS ('role:key,...'). Without any key, every route is open."
        ),
    ] = None,
    insecure_no_auth: Annotated[
        bool,
        typer.Option(
            help="Serve on a non-loopback --host without any API key (anyone who reaches it may do anything)."
        ),
    ] = False,
    upstream: Annotated[
        str | None,
        typer.Option(
            help="An OpenAI-compatible server (its base URL, e.g. http://vllm:8000/v1) that answers the models this one does not serve; calls to it in episodes are recorded."
        ),
    ] = None,
    upstream_api_key: Annotated[
        str | None,
        typer.Option(envvar="FLYWHEEL_UPSTREAM_API_KEY", show_default=False, help="The upstream's API key."),
    ] = None,
    upstream_timeout: Annotated[float, typer.Option(help="Seconds an upstream call may take.")] = 300.0,
    upstream_logprobs_mode: Annotated[
        str,
        typer.Option(
            help="The log-probs the upstream returns, as vLLM's --logprobs-mode it was started with: raw_logprobs"
            " (vLLM's default: T = 1's, never compared by TIS for a call at another temperature) or processed_logprobs."
        ),
    ] = "raw_logprobs",
    redact: Annotated[
        RedactScope,
        typer.Option(
            help="Whose calls are redacted before they are stored: production (episodes of split production or"
            " shadow, and calls asked under a deployment's alias) | all | none."
        ),
    ] = RedactScope.production,
    write_behind: Annotated[
        bool,
        typer.Option(
            help="Answer an episode's call once it is queued for the store's writer (default), or once it is"
            " committed (--no-write-behind: for replicas on one database that do not send an episode's calls to one"
            " replica)."
        ),
    ] = True,
    fine_tuning: Annotated[
        bool,
        typer.Option(
            help="Serve OpenAI's fine-tuning API (/v1/files, /v1/fine_tuning/jobs): jobs fine-tune --model, one at a"
            " time, and their models are served here."
        ),
    ] = True,
    fine_tune_alias: Annotated[
        list[str] | None,
        typer.Option(
            help="NAME=MODEL: a fine-tuning job may name MODEL (--model) as NAME, e.g. gpt-4.1-mini="
            + EMBEDDED_MODEL
            + ", so that a script written for OpenAI runs unchanged. Repeatable."
        ),
    ] = None,
    fine_tune_max_tokens: Annotated[
        int, typer.Option(min=1, help="The most tokens an answer may take when a reinforcement job samples its model.")
    ] = 512,
    vllm: Annotated[
        str | None,
        typer.Option(
            help="vLLM servers (URL[,URL]) that sample --model instead of the embedded engine, token ids in and out;"
            " started with --enable-scale-out --logprobs-mode processed_logprobs (docs/user-guide.md). Needs"
            " --vllm-model-dir. A request for NAME@k of a LoRA model under $FLYWHEEL_HOME loads checkpoint k into"
            " them as the adapter NAME@k (vLLM started with --enable-lora and VLLM_ALLOW_RUNTIME_LORA_UPDATING=1)."
        ),
    ] = None,
    vllm_model_dir: Annotated[
        Path | None,
        typer.Option(help="The model directory the vLLM servers serve (its tokenizer splices the turns here)."),
    ] = None,
    vllm_api_key: VLLMApiKey = None,
):
    """Serve a model over an OpenAI-compatible API (/v1/models, /v1/chat/completions), the gateway: episodes
    (POST /episodes) whose calls, through /episodes/<id>/v1, are recorded for training, OpenAI's fine-tuning
    API (/v1/files, /v1/fine_tuning/jobs) and the dashboard (/ui/; its data needs an admin key when keys are set)."""
    import uvicorn

    from flywheel.gateway.auth import ENV_VAR, ApiKeyError, ApiKeys, is_loopback

    try:  # keys first: a mistake in them, or an open server on the network, is refused before the model loads
        keys = ApiKeys.configured(api_keys)
    except ApiKeyError as exc:
        fail(f"Invalid API keys: {exc}")
    if not keys and not is_loopback(host) and not insecure_no_auth:
        fail(
            f"Refusing to serve on {host} without API keys: anyone who can reach it could use the model and"
            f" read, reward or change every episode. Give keys (--api-keys FILE or {ENV_VAR}), bind to 127.0.0.1,"
            " or pass --insecure-no-auth to serve it open anyway."
        )

    from flywheel.gateway.upstream import Upstream

    try:
        relay_to = (
            Upstream(upstream, api_key=upstream_api_key, timeout=upstream_timeout, logprobs_mode=upstream_logprobs_mode)
            if upstream
            else None
        )
    except ValueError as exc:
        fail(f"Invalid --upstream: {exc}")

    from flywheel.store.costs import Prices
    from flywheel.store.db import shown_url

    store = open_store(db)  # the database and the prices file too, before the model loads
    try:
        prices = Prices.from_env()
    except ValueError as exc:
        fail(str(exc))

    from flywheel.gateway.recorder import REDACTED_SPLITS, Gateway
    from flywheel.gateway.redact import default_redactor
    from flywheel.inference.engine import InferenceEngine
    from flywheel.inference.loading import ModelNotFoundError, ResolvedModel, load_model
    from flywheel.inference.registry import ModelRegistry
    from flywheel.server.app import create_app

    if (vllm is None) != (vllm_model_dir is None):
        fail("--vllm and --vllm-model-dir go together: the servers' URLs and the model directory they serve.")
    sampler = pool = None
    if vllm is not None and vllm_model_dir is not None:
        from flywheel.inference.vllm_engine import VLLMPool, VLLMRefusedError

        try:  # the probes refuse a server that would record wrong data, before anything else starts
            pool = asyncio.run(
                VLLMPool([u for u in vllm.split(",") if u], vllm_model_dir, model=model, api_key=vllm_api_key).start()
            )
        except (VLLMRefusedError, OSError, ValueError) as exc:
            fail(str(exc))
        sampler = pool.engine()
    if sampler is not None:  # vLLM holds the weights: nothing to load here
        resolved, hf_model = ResolvedModel(name=model, path=Path(str(vllm_model_dir)).resolve()), None
    else:
        try:
            hf_model, tokenizer, resolved = load_model(model, dtype=_dtype(dtype))
        except ModelNotFoundError as exc:
            fail(str(exc))
    aliases = {}
    for item in fine_tune_alias or []:
        name, sep, target = item.partition("=")
        if not sep or not name.strip() or target.strip() not in {model, resolved.name}:
            fail(f"Invalid --fine-tune-alias {item!r}: give NAME={model} (the model this server serves).")
        aliases[name.strip()] = model
    service = None
    if fine_tuning:
        from flywheel.finetuning.service import FineTuning
        from flywheel.home import default_home

        options = {"dtype": _dtype(dtype), "max_batch": max_batch}
        service = FineTuning(
            store, default_home(), [model], aliases, backend_options=options, max_tokens=fine_tune_max_tokens
        ).start()
    fallback = service.serve if service else None
    if pool is None:
        registry = ModelRegistry(loader=fallback)
    else:  # NAME@k of a LoRA model under the home: its checkpoint loaded into the vLLM servers as an adapter
        from flywheel.home import default_home
        from flywheel.inference.vllm_adapters import CheckpointAdapters

        registry = ModelRegistry(loader=lambda name: adapters(name))
        adapters = CheckpointAdapters(pool, registry, default_home(), fallback)
    try:  # the base model sampled by vLLM (--vllm), else by the embedded engine; fine-tuning stays embedded
        engine = sampler or InferenceEngine(hf_model, tokenizer, max_batch=max_batch, compile=compile)  # type: ignore[arg-type]
    except ValueError as exc:  # --compile where it cannot run
        fail(str(exc))
    registry.add(model, engine)
    if resolved.name != model:
        registry.add(resolved.name, engine)
    console.print(f"Serving [bold]{model}[/] ({hf_model.dtype if hf_model else 'on vLLM'}) at http://{host}:{port}/v1")
    if sampler is not None:
        console.print(f"Sampled by vLLM at {vllm} (context {sampler.context_length} tokens)")
    if compile:
        console.print("Compiling the decode step first (~1-2 minutes on 2 cores): requests wait until it is done.")
    console.print(f"Episodes: http://{host}:{port}/episodes, stored in {shown_url(store.url)}")
    console.print(f"API keys: {keys!r}" if keys else "No API keys: every route is open to whoever reaches the server.")
    if relay_to is not None:
        console.print(f"Other models: asked of the upstream at {relay_to.host}")
    gateway = Gateway(
        store,
        redactor=None if redact is RedactScope.none else default_redactor,
        redacted_splits=None if redact is RedactScope.all else REDACTED_SPLITS,
        write_behind=write_behind,
        prices=prices,
    )
    app = create_app(registry, gateway, auth=keys, upstream=relay_to, listed=service.models if service else None)
    if service is not None:
        from flywheel.finetuning.routes import mount

        mount(app, service)
        console.print(f"Fine-tuning: http://{host}:{port}/v1/fine_tuning/jobs (files and models in {default_home()})")
    from flywheel.dashboard.app import mount as mount_dashboard
    from flywheel.home import default_home

    mount_dashboard(app, store, default_home())
    console.print(f"Dashboard: http://{host}:{port}/ui/" + (" (its data needs an admin key)" if keys else ""))
    try:
        uvicorn.run(app, host=host, port=port, log_level="info")
    finally:
        if service is not None:  # a running job stays running: the next start resumes it
            service.stop()


def runner(
    url: Annotated[str, typer.Option(help="The gateway's root URL (flywheel serve's), e.g. http://127.0.0.1:8000.")],
    agent: Annotated[
        str,
        typer.Option(
            help="The agent as module:function (importable from here): async def agent(task: dict, base_url: str) -> float | dict."
        ),
    ],
    concurrency: Annotated[int, typer.Option(min=1, help="Attempts run at once.")] = 1,
    max_attempts: Annotated[
        int | None, typer.Option(min=1, help="Stop after claiming this many attempts (default: run until stopped).")
    ] = None,
    lease_seconds: Annotated[
        float, typer.Option(min=0.1, help="Lease per attempt, renewed every third of it while the agent runs.")
    ] = 60.0,
    runner_id: Annotated[
        str | None, typer.Option(help="This runner's name in the queue (default: host-pid-random).")
    ] = None,
    api_key: Annotated[
        str | None, typer.Option(envvar="FLYWHEEL_API_KEY", help="A runner (or admin) key, if the server has keys.")
    ] = None,
):
    """Run an agent on the gateway's rollout queue: claim attempts, run the agent against each one's episode URL,
    post its reward. SIGINT or SIGTERM stops it, giving its running attempts back to the queue."""
    import logging
    import os
    import signal
    import sys

    from flywheel.gateway.client import GatewayError
    from flywheel.gateway.runner import Runner, load_agent

    sys.path.insert(0, os.getcwd())  # --agent my_module:fn finds my_module.py here, as `python -m` would
    try:
        function = load_agent(agent)
    except ValueError as exc:
        fail(str(exc))
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    worker = Runner(
        url, function, runner_id=runner_id, lease_seconds=lease_seconds, concurrency=concurrency, api_key=api_key
    )

    async def main():
        task = asyncio.current_task()
        assert task is not None
        asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, task.cancel)
        return await worker.run(max_attempts=max_attempts)

    console.print(f"Runner [bold]{worker.runner_id}[/] on {url}")
    try:
        asyncio.run(main())
    except (KeyboardInterrupt, asyncio.CancelledError):
        console.print("Stopped.")
    except GatewayError as exc:
        fail(f"The gateway refused the runner: {exc}", 1)
    finally:
        stats = worker.stats
        console.print(
            f"Claimed {stats.claimed}, completed {stats.completed}, failed {stats.failed}, lost {stats.lost}."
        )
