"""The chat completion service behind ``/v1/chat/completions`` (and its episode-scoped twin): a request resolved to
the engine that answers it (a deployment's alias through its traffic policy, a checkpoint loaded on demand, an
upstream for a model not served here), sampled (JSON or server-sent events), its tool calls through the deployment's
tool policy, and recorded in its episode by the gateway.

Responses are built from the openai SDK's own types, so any OpenAI client parses them. Each choice also carries
``token_ids`` (the exact sampled ids), ``prompt_token_ids`` and the ``temperature`` it was sampled at
(``flywheel.types.set_sampled_tokens``), which trajectories keep so that training never re-tokenises what the
model produced and scores it under the distribution it was drawn from.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from openai.types.chat import ChatCompletion, ChatCompletionChunk, ChatCompletionMessage
from openai.types.chat.chat_completion import Choice, ChoiceLogprobs
from openai.types.chat.chat_completion_chunk import Choice as ChunkChoice
from openai.types.chat.chat_completion_chunk import ChoiceDelta, ChoiceDeltaToolCall
from openai.types.chat.chat_completion_chunk import ChoiceLogprobs as ChunkLogprobs
from openai.types.chat.chat_completion_message_tool_call import ChatCompletionMessageToolCall
from openai.types.chat.chat_completion_token_logprob import ChatCompletionTokenLogprob, TopLogprob
from openai.types.completion_usage import CompletionUsage
from pydantic import ValidationError
from starlette.background import BackgroundTask

from flywheel.approvals.desk import ApprovalDesk, refuse_out_of_scope
from flywheel.approvals.policy import Decision
from flywheel.gateway.auth import Role, TokenBudgets
from flywheel.gateway.recorder import Gateway
from flywheel.gateway.splice import tokenizer_key
from flywheel.gateway.traffic import Route, TrafficPolicy
from flywheel.gateway.upstream import Relay, without_logprobs
from flywheel.inference.chat import parse_tool_calls, partial_tool_call, render_prompt
from flywheel.inference.engine import (
    Completion,
    InferenceEngine,
    TokenEvent,
)
from flywheel.inference.guided import (
    Guide,
    compile_choice_guide,
    compile_guide,
    compile_tool_call_guide,
)
from flywheel.inference.registry import ModelRegistry, ServedModel, UnknownModelError
from flywheel.inference.sampling import SamplingParams
from flywheel.openai_api import ChatCompletionRequest, JsonSchemaFormat, TextFormat
from flywheel.server.refusals import ModelNotAllowedError
from flywheel.store import UnknownEpisodeError, deployments
from flywheel.store.arms import is_shadow_episode_id
from flywheel.store.deployments import UnknownDeploymentError, list_deployments
from flywheel.types import set_sampled_tokens

APPROVALS = "flywheel_approvals"  # a reply's field: the decisions taken on its tool calls (a deployment's policy)


def _logprob_items(engine: InferenceEngine, c: Completion) -> list[ChatCompletionTokenLogprob]:
    tok = engine.tokenizer

    def piece(token_id: int) -> tuple[str, list[int]]:
        text = tok.decode([token_id], skip_special_tokens=False)
        return text, list(text.encode("utf-8"))

    items = []
    for i, (token_id, lp) in enumerate(zip(c.token_ids, c.logprobs)):
        text, raw = piece(token_id)
        tops = [
            TopLogprob(token=piece(t)[0], bytes=piece(t)[1], logprob=v)
            for t, v in (c.top_logprobs[i] if c.top_logprobs else [])
        ]
        items.append(ChatCompletionTokenLogprob(token=text, bytes=raw, logprob=lp, top_logprobs=tops))
    return items


def _message(c: Completion, tools: bool, forced: bool = False) -> tuple[ChatCompletionMessage, str]:
    """The reply's message and finish reason. A forced call (``forced``) cut by max_tokens is returned as the call it
    was writing, its arguments unfinished, with finish reason "length", as OpenAI and vLLM return one."""
    content, calls = parse_tool_calls(c.text) if tools else (c.text, [])
    if forced and not calls and c.finish_reason == "length" and (partial := partial_tool_call(c.text)):
        content, calls = None, [partial]
    tool_calls = [ChatCompletionMessageToolCall.model_validate(call) for call in calls] or None
    finish = "tool_calls" if tool_calls and c.finish_reason == "stop" else c.finish_reason
    return ChatCompletionMessage(role="assistant", content=content, tool_calls=tool_calls), finish


async def _guide(req: ChatCompletionRequest, engine: InferenceEngine) -> Guide | None:
    """The grammar the reply follows: vLLM's guided_choice (which the request allows with no other guide), a forced
    tool call (tool_choice "required" or a named function; the call has no content for a response_format to
    shape), else the response_format's, else none."""
    # compiling takes the engine's tokenizer through llguidance once (a fraction of a second): off the event loop
    if req.guided_choice is not None:
        return await asyncio.to_thread(compile_choice_guide, engine.tokenizer, engine.eos_ids, req.guided_choice)
    if forced := req.forced_tools:
        return await asyncio.to_thread(compile_tool_call_guide, engine.tokenizer, engine.eos_ids, forced)
    fmt = req.response_format
    if fmt is None or isinstance(fmt, TextFormat):
        return None
    schema = fmt.json_schema.schema_ if isinstance(fmt, JsonSchemaFormat) else None
    return await asyncio.to_thread(compile_guide, engine.tokenizer, engine.eos_ids, schema)


def _sampling(
    req: ChatCompletionRequest,
    engine: InferenceEngine,
    prompt_len: int,
    guide: Guide | None = None,
    logprobs: bool = False,
    cap: int | None = None,
) -> SamplingParams:
    """``logprobs``: compute them even if the client did not ask (a recorded call keeps them for training);
    ``cap``: the most tokens a choice may take when the request does not say (its key's share of a budget)."""
    max_tokens = req.max_completion_tokens or req.max_tokens or max(engine.context_length - prompt_len, 1)
    if cap is not None:
        max_tokens = min(max_tokens, cap)
    engine.check_fits(prompt_len, max_tokens)
    return SamplingParams(
        temperature=req.temperature,
        top_p=req.top_p,
        max_tokens=max_tokens,
        stop=req.stop_list,
        seed=req.seed,
        logprobs=req.logprobs or logprobs,
        top_logprobs=req.top_logprobs if req.logprobs else 0,
        n=req.n,
        ignore_eos=req.ignore_eos,
        guide=guide,
    )


async def json_body(request: Request) -> Any:
    """The request's JSON body (a 400 saying where it stopped parsing, if it is not JSON)."""
    try:
        return json.loads(await request.body())
    except (ValueError, UnicodeDecodeError) as exc:
        where = getattr(exc, "pos", 0)
        raise RequestValidationError(
            [{"type": "json_invalid", "loc": ("body", where), "msg": "JSON decode error", "input": {}}]
        ) from None


def _sampled_how(engine: InferenceEngine, params: SamplingParams, step: int | None) -> dict[str, Any]:
    """How a choice was drawn, recorded on it with its ids (extra fields, kept by the SDK): its top-p, whether a
    grammar guided it (its log-probs are then the masked distribution's, which TIS leaves out), the tokenizer its
    ids are of (what a later call's prompt may splice them into) and the step of the weights that drew it (what
    bounded staleness reads, ``train/staleness.py``)."""
    return {"top_p": params.top_p, "guided": params.guide is not None, "tokenizer": tokenizer_key(engine.tokenizer),
            "weights_step": step}  # fmt: skip


def _completion_body(
    engine: InferenceEngine,
    results: list[Completion],
    prompt: list[int],
    params: SamplingParams,
    completion_id: str,
    created: int,
    model: str,
    tools: bool,
    forced: bool,
    step: int | None,
) -> dict:
    """A chat.completion body; each choice carries its token ids (``set_sampled_tokens``), and log-probs when
    ``params.logprobs``."""
    choices = []
    for c in results:
        message, finish = _message(c, tools, forced)
        logprobs = ChoiceLogprobs(content=_logprob_items(engine, c)) if params.logprobs else None
        choice = Choice(index=c.index, message=message, finish_reason=finish, logprobs=logprobs)
        set_sampled_tokens(choice, prompt, c.token_ids, params.temperature, **_sampled_how(engine, params, step))
        choices.append(choice)
    completion_tokens = sum(len(c.token_ids) for c in results)
    usage = CompletionUsage(
        prompt_tokens=len(prompt), completion_tokens=completion_tokens, total_tokens=len(prompt) + completion_tokens
    )
    body = ChatCompletion(
        id=completion_id, object="chat.completion", created=created, model=model, choices=choices, usage=usage
    )
    return body.model_dump(mode="json", exclude_none=True)


class ChatService:
    """Answers chat completions over ``registry``'s engines; with a ``gateway``, records the calls of episodes, routes
    deployments' aliases by ``traffic`` and screens their tool calls at ``desk``; ``relay``: the upstream for models
    not served here; ``budgets``: each key role's cap on ``n`` x ``max_tokens``."""

    def __init__(
        self,
        registry: ModelRegistry,
        gateway: Gateway | None,
        *,
        relay: Relay | None,
        traffic: TrafficPolicy | None,
        desk: ApprovalDesk | None,
        budgets: TokenBudgets,
    ) -> None:
        self.registry, self.gateway, self.relay = registry, gateway, relay
        self.traffic, self.desk, self.budgets = traffic, desk, budgets

    async def answer(self, body: Any, episode_id: str | None, role: Role | None):
        """The upstream's call if its model is not served here, else the engine's (the body checked as its). A
        shadow episode is unknown to outside calls: only the gateway's own mirror (``after``) records there.
        ``role``: the request's key's (None: the server has no keys)."""
        if episode_id is not None and is_shadow_episode_id(episode_id):
            raise UnknownEpisodeError(episode_id)
        if self.relay is not None and isinstance(body, dict) and not await self.served_here(body.get("model"), role):
            if episode_id is not None and self.gateway is None:
                raise UnknownEpisodeError(episode_id)  # this server records no episodes
            return await self.relay.chat(body, episode_id)
        try:
            req = ChatCompletionRequest.model_validate(body)
        except ValidationError as exc:
            raise RequestValidationError(exc.errors()) from None
        return await self.chat(req, episode_id, role)

    async def served_here(self, model: Any, role: Role | None) -> bool:
        if not isinstance(model, str):
            return True  # the engine's checks say what is wrong with it
        try:
            await self.resolve(model, role=role)
        except (UnknownModelError, UnknownDeploymentError):
            return False
        return True

    async def deployed(self, model: str) -> bool:
        """Whether a deployment points at the checkpoint ``model`` names (``calc@3``)."""
        name, _, step = model.rpartition("@")
        if self.gateway is None or not step.isdigit():
            return False
        return any(d.target == model for d in await self.gateway.store.run(list_deployments, name))

    async def resolve(
        self, model: str, episode_id: str | None = None, role: Role | None = None
    ) -> tuple[ServedModel, Route | None]:
        """The served model a request names, and the route of an alias: an alias (``calc@production``, with a
        gateway's store) is the checkpoint its traffic policy sends the request to now (``calc@3``, or the
        canary's step for a canary's share of episodes), read at each request. A name not served now is loaded
        (a checkpoint, by the registry's loader) unless the request has an agent key and no deployment points at
        it (``ModelNotAllowedError``)."""
        if self.traffic is not None and deployments.is_alias(model):
            route = await self.traffic.route(model, episode_id)
            try:
                return await self.registry.resolve(route.answer.target), route
            except UnknownModelError:
                if (route := self.traffic.fall_back(route)) is None:
                    raise
                return await self.registry.resolve(route.answer.target), route
        if role is not None and role < Role.runner:
            try:
                return self.registry.get(model), None
            except UnknownModelError:
                if not await self.deployed(model):
                    raise ModelNotAllowedError(model, sorted(m.name for m in self.registry.all())) from None
        return await self.registry.resolve(model), None

    def after(self, req: ChatCompletionRequest, episode_id: str | None, route: Route | None) -> BackgroundTask | None:
        """What follows the answer to an aliased call, once it is sent: its episode's arm recorded, the call
        mirrored to a shadow (``TrafficPolicy.after``: in tasks of their own)."""
        if self.traffic is None or route is None or episode_id is None:
            return None

        async def mirror(shadow: str, shadow_episode: str) -> None:  # the same request, recorded in the shadow's
            await self.chat(
                req.model_copy(update={"model": shadow, "stream": False, "stream_options": None}), shadow_episode, None
            )

        return BackgroundTask(self.traffic.after, route, episode_id, mirror)

    async def chat(self, req: ChatCompletionRequest, episode_id: str | None, role: Role | None):
        """``role``: the request's key's (None: no keys, or the gateway's own mirror: no cap, any checkpoint)."""
        if episode_id is not None and self.gateway is None:
            raise UnknownEpisodeError(episode_id)  # this server records no episodes
        start = time.perf_counter()
        cap = self.budgets.check(role, req.n, req.max_completion_tokens or req.max_tokens)  # before anything runs
        served, route = await self.resolve(req.model, episode_id, role)
        deployment = None if route is None else route.deployment  # the alias that answered
        engine, step = served.engine, served.current_step()  # the weights it starts with
        messages = [m.model_dump(exclude_none=True) for m in req.messages]
        tools, forced = req.offered_tools, req.forced_tools is not None
        # a deployment's tool policy (the alias asked for): its scope now, its high-impact calls once sampled
        policy = await self.desk.policy(req.model) if self.desk is not None and route is not None else None
        if policy is not None:
            refuse_out_of_scope(policy, req.tools)
        eos = set(engine.eos_ids)
        if self.gateway is not None and episode_id is not None:
            splice = await self.gateway.prepare(episode_id, messages, tools, engine.tokenizer, eos)
            prompt = splice.prompt
        else:
            splice, prompt = None, render_prompt(engine.tokenizer, messages, tools)
        split = self.gateway.split_of(episode_id) if self.gateway is not None and episode_id is not None else None
        decisions: list[Decision] = []
        waited = [0.0]  # seconds spent waiting for decisions: not the call's latency

        async def screen(message: ChatCompletionMessage, finish: str) -> tuple[ChatCompletionMessage, str]:
            """A reply as its agent may have it: its tool calls through the deployment's tool policy."""
            if policy is None or self.desk is None or not message.tool_calls:
                return message, finish
            began = time.perf_counter()
            message, finish, decided = await self.desk.screen(
                policy, message, finish, episode_id=episode_id, split=split
            )
            waited[0] += time.perf_counter() - began
            decisions.extend(decided)
            return message, finish

        params = _sampling(req, engine, len(prompt), await _guide(req, engine), logprobs=splice is not None, cap=cap)
        completion_id = f"chatcmpl-{uuid.uuid4().hex}"
        created = int(time.time())

        def body(results: list[Completion]) -> dict:
            return _completion_body(
                engine, results, prompt, params, completion_id, created, req.model, bool(tools), forced, step
            )

        async def record(full: dict) -> None:
            assert self.gateway is not None and splice is not None and episode_id is not None
            request = req.model_dump(mode="json", exclude_none=True) | {"messages": messages, "tools": tools}
            if decisions:  # the model's reply is recorded as sampled, with what became of its calls
                full = full | {APPROVALS: [d.model_dump(mode="json") for d in decisions]}
            await self.gateway.record(
                episode_id,
                splice,
                eos,
                model=req.model,
                step=step,
                deployment=deployment,
                request=request,
                response=full,
                latency_ms=(time.perf_counter() - start - waited[0]) * 1000,
            )

        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            on_done = (lambda results: record(body(results))) if splice is not None else None
            # the first token drawn before the status line is sent: a sampler that fails before it (a vLLM server
            # down, a request it refuses, a closed engine) answers with the error's status, as without stream
            tokens = await _primed(engine.stream(prompt, params))
            events = _stream(
                engine, tokens, prompt, params, completion_id, created, req.model, bool(tools), forced, include_usage, req.logprobs,
                step, on_done, screen if policy is not None else None,
            )  # fmt: skip
            return StreamingResponse(
                events, media_type="text/event-stream", background=self.after(req, episode_id, route)
            )
        full = body(await engine.generate(prompt, params))
        answer = await _screened(full, screen) if policy is not None else full
        if decisions:
            answer = answer | {APPROVALS: [d.model_dump(mode="json") for d in decisions]}
        if splice is not None:
            await record(full)  # queued for the writer (its episode's outcome and reads wait for it)
        answer = answer if req.logprobs else without_logprobs(answer)  # else computed for the record only
        return JSONResponse(answer, background=self.after(req, episode_id, route))


async def _screened(
    full: dict, screen: Callable[[ChatCompletionMessage, str], Awaitable[tuple[ChatCompletionMessage, str]]]
) -> dict:
    """A chat.completion body with each choice's reply screened (its calls decided concurrently)."""

    async def one(choice: dict) -> dict:
        message = ChatCompletionMessage.model_validate(choice["message"])
        message, finish = await screen(message, choice["finish_reason"])
        return choice | {"message": message.model_dump(mode="json", exclude_none=True), "finish_reason": finish}

    return full | {"choices": list(await asyncio.gather(*(one(c) for c in full["choices"])))}


async def _primed(events: AsyncIterator[TokenEvent]) -> AsyncIterator[TokenEvent]:
    """``events`` with its first event already drawn: an error before it is raised here, where the route can still
    answer with the error's status; the events, the first included, then follow from the returned iterator."""
    first = await anext(events)

    async def chained() -> AsyncIterator[TokenEvent]:
        yield first
        async for event in events:
            yield event

    return chained()


async def _stream(
    engine: InferenceEngine,
    tokens: AsyncIterator[TokenEvent],
    prompt: list[int],
    params: SamplingParams,
    completion_id: str,
    created: int,
    model: str,
    tools: bool,
    forced: bool,
    include_usage: bool,
    show_logprobs: bool,
    step: int | None,
    on_done: Callable[[list[Completion]], Awaitable[None]] | None = None,
    screen: Callable[[ChatCompletionMessage, str], Awaitable[tuple[ChatCompletionMessage, str]]] | None = None,
) -> AsyncIterator[str]:
    """Server-sent events of ``tokens`` (``engine``'s stream of ``prompt``, its first event drawn: ``_primed``).
    With tools, text is held until the end because a tool call is only known then. ``show_logprobs``: send the
    log-probs ``params`` computes; ``on_done``: given every choice once all ended (the gateway records the call);
    ``screen``: what a reply with tool calls becomes before it is sent (a deployment's tool policy). An error once
    the status line is sent (the sampler failing after the first token, ``on_done``'s) is one error event, and the
    stream ends there (no ``[DONE]``; the openai SDK raises ``APIError`` with its message)."""

    def chunk(choices: list[ChunkChoice], usage: CompletionUsage | None = None) -> str:
        body = ChatCompletionChunk(
            id=completion_id, object="chat.completion.chunk", created=created, model=model, choices=choices, usage=usage
        )
        return f"data: {body.model_dump_json(exclude_none=True)}\n\n"

    for i in range(params.n):
        yield chunk([ChunkChoice(index=i, delta=ChoiceDelta(role="assistant", content=""))])
    held: dict[int, Completion] = {i: Completion(i, "", [], [], [], "") for i in range(params.n)}
    completion_tokens = 0
    try:
        async for ev in tokens:
            completion_tokens += len(ev.token_ids)
            c = held[ev.index]
            c.text += ev.text_delta
            c.token_ids += ev.token_ids
            c.logprobs += ev.logprobs
            c.top_logprobs += ev.top_logprobs
            lp = None
            if show_logprobs:
                part = Completion(ev.index, "", ev.token_ids, ev.logprobs, ev.top_logprobs, "")
                lp = ChunkLogprobs(content=_logprob_items(engine, part))
            if not tools and (ev.text_delta or lp):
                yield chunk([ChunkChoice(index=ev.index, delta=ChoiceDelta(content=ev.text_delta), logprobs=lp)])
            if ev.finish_reason is None:
                continue
            c.finish_reason = ev.finish_reason
            finish = ev.finish_reason
            if tools:  # the held text and its tokens' logprobs, as one delta
                message, finish = _message(c, True, forced)
                if screen is not None:
                    message, finish = await screen(message, finish)
                calls = [
                    ChoiceDeltaToolCall(index=k, id=tc.id, type="function", function=tc.function.model_dump())
                    for k, tc in enumerate(message.tool_calls or [])
                ]
                delta = ChoiceDelta(content=message.content, tool_calls=calls or None)
                lp = ChunkLogprobs(content=_logprob_items(engine, c)) if show_logprobs else None
                yield chunk([ChunkChoice(index=ev.index, delta=delta, logprobs=lp)])
            final = ChunkChoice(index=ev.index, delta=ChoiceDelta(), finish_reason=finish)
            set_sampled_tokens(final, prompt, c.token_ids, params.temperature, **_sampled_how(engine, params, step))  # type: ignore[arg-type]  # same extras
            yield chunk([final])
        if on_done is not None:
            await on_done([held[i] for i in range(params.n)])
    except Exception as exc:  # the status line is already sent: report the error in-band, as OpenAI does
        yield f"data: {json.dumps({'error': {'message': str(exc), 'type': 'server_error'}})}\n\n"
        return
    if include_usage:
        usage = CompletionUsage(
            prompt_tokens=len(prompt), completion_tokens=completion_tokens, total_tokens=len(prompt) + completion_tokens
        )
        yield chunk([], usage)
    yield "data: [DONE]\n\n"
