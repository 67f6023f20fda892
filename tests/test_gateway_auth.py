"""Who may do what: API keys with roles on a real loopback server (the real model, the openai SDK, EpisodeClient,
httpx, a real SQLite store), and ``flywheel serve``'s key options as a process. Nothing is mocked."""

from __future__ import annotations

import os
import re
import secrets
import signal
import socket
import subprocess
import sys
from pathlib import Path

import httpx
import openai
import pytest
from fastapi.routing import iter_route_contexts
from sqlalchemy import select
from typer.testing import CliRunner, Result

from flywheel.cli import app
from flywheel.gateway.auth import BUDGETS_ENV_VAR, ENV_VAR, ApiKeyError, ApiKeys, Role, TokenBudgets, required_role
from flywheel.gateway.client import EpisodeClient, GatewayError
from flywheel.gateway.recorder import Gateway
from flywheel.inference.loading import EMBEDDED_MODEL
from flywheel.inference.registry import ModelRegistry
from flywheel.local.backend import LocalBackend
from flywheel.server.app import create_app
from flywheel.server.background import BackgroundServer
from flywheel.store import Store, deployments
from flywheel.store.schema import Base

from helpers import wait_until_healthy

FLYWHEEL = str(Path(sys.executable).parent / "flywheel")
KEYS = {role: secrets.token_urlsafe(32) for role in Role}
WRONG_KEY = secrets.token_urlsafe(32)
BODY_CAP = 64 * 1024

# The issue's table (issue #24, "who may do what"), written here independently of auth.RULES; any other route:
# admin. Path parameters are written "{}" (whatever a route names them).
EXPECTED: dict[tuple[str, str], Role | None] = {
    ("GET", "/health"): None,
    ("GET", "/v1/models"): Role.agent,
    ("POST", "/v1/chat/completions"): Role.agent,
    ("GET", "/episodes/{}/v1/models"): Role.agent,
    ("POST", "/episodes/{}/v1/chat/completions"): Role.agent,
    ("POST", "/episodes"): Role.runner,
    ("GET", "/episodes/{}"): Role.runner,
    ("POST", "/episodes/{}/reward"): Role.runner,
    ("POST", "/episodes/{}/finish"): Role.runner,
    ("POST", "/episodes/{}/abandon"): Role.runner,
    ("POST", "/episodes/{}/feedback"): Role.runner,  # issue #25: outcome feedback from the production system
    ("POST", "/tasks/claim"): Role.runner,
    ("POST", "/attempts/{}/heartbeat"): Role.runner,
    ("POST", "/attempts/{}/complete"): Role.runner,
    ("POST", "/attempts/{}/fail"): Role.runner,
    ("POST", "/approvals"): Role.agent,  # issue #42: an agent that runs its own tools asks a person
    ("GET", "/approvals/{}/decision"): Role.agent,  # and reads the decision (never the others' calls)
    ("GET", "/episodes"): Role.admin,
    ("GET", "/episodes/{}/calls"): Role.admin,
    ("GET", "/episodes/{}/trajectory"): Role.admin,
    ("GET", "/episodes/{}/transitions"): Role.admin,
    ("GET", "/groups"): Role.admin,
    ("POST", "/tasks"): Role.admin,
    ("GET", "/tasks"): Role.admin,
    ("GET", "/tasks/{}"): Role.admin,
}
CHAT = {"model": EMBEDDED_MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
BODIES = {  # what each route would act on if it let the request through
    "/episodes": {"task_id": "intruder"},
    "/episodes/{}/reward": {"reward": 1.0},
    "/episodes/{}/finish": {"reward": 1.0},
    "/episodes/{}/abandon": {"reason": "intruder"},
    "/episodes/{}/feedback": {"kind": "rating", "value": 0.0},
    "/approvals": {"tool": "intruder"},
    "/v1/chat/completions": CHAT,
    "/episodes/{}/v1/chat/completions": CHAT,
}


def generic(template: str) -> str:
    return re.sub(r"\{[^}]*\}", "{}", template)


def expected_role(method: str, template: str) -> Role | None:
    return EXPECTED.get((method, generic(template)), Role.admin)


def app_routes(app) -> list[tuple[str, str]]:
    """Every (method, path template) the app serves, those of included routers too."""
    routes = list(iter_route_contexts(app.routes))
    assert all(r.path and r.methods for r in routes), "a route kind this test does not try"
    return sorted((method, r.path) for r in routes for method in r.methods)


class Served:
    def __init__(self, engine, tmp_path: Path):
        registry = ModelRegistry()
        registry.add(EMBEDDED_MODEL, engine)
        self.store = Store(f"sqlite:///{tmp_path / 'flywheel.db'}")
        self.gateway = Gateway(self.store)
        self.app = create_app(registry, self.gateway, auth=ApiKeys(KEYS.items()), max_body_bytes=BODY_CAP)
        self.server = BackgroundServer(self.app).start()
        self.root = f"http://127.0.0.1:{self.server.port}"

    def snapshot(self) -> dict[str, list[str]]:
        """Every row of every table."""
        with self.store.session() as s:
            return {
                t.name: sorted(repr(tuple(row)) for row in s.execute(select(t))) for t in Base.metadata.sorted_tables
            }

    def request(self, method: str, template: str, episode_id: str, headers: dict[str, str]) -> httpx.Response:
        path = template.replace("{episode_id}", episode_id)
        path = re.sub(r"\{[^}]*\}", "x", path)
        if path == "/v1/chat/completions":
            headers = {**headers, "X-Flywheel-Episode": episode_id}
        body = BODIES.get(generic(template), {}) if method == "POST" else None
        return httpx.request(method, self.root + path, json=body, headers=headers, timeout=60)


@pytest.fixture
def served(engine, tmp_path):
    s = Served(engine, tmp_path)
    yield s
    s.server.stop()
    s.store.close()


async def open_episode_with_a_call(served: Served) -> str:
    async with EpisodeClient(served.root, api_key=KEYS[Role.runner]) as runner:
        episode = await runner.create("task-auth")
    agent = openai.AsyncOpenAI(base_url=episode.base_url, api_key=KEYS[Role.agent], max_retries=0)
    await agent.chat.completions.create(model=EMBEDDED_MODEL, messages=CHAT["messages"], max_tokens=2)
    await served.gateway.settled(episode.id)  # write-behind: the answer comes before the call is committed
    return episode.id


def test_every_route_of_the_app_and_of_the_issue_needs_its_role_and_a_route_not_listed_needs_admin(served):
    routes = app_routes(served.app)
    assert ("POST", "/episodes/{episode_id}/finish") in routes and ("GET", "/openapi.json") in routes
    for method, template in routes:
        concrete = re.sub(r"\{[^}]*\}", "abc123", template)
        assert required_role(method, concrete) == expected_role(method, template), (method, template)
    for (method, template), role in EXPECTED.items():  # the runner queue's routes too, mounted or not yet
        assert required_role(method, template.replace("{}", "abc123")) == role, (method, template)
    assert required_role("GET", "/tasks/claim") == Role.admin  # a route's method counts, not only its path
    assert required_role("GET", "/episodes/abc/v1") == Role.admin  # nothing under it: not an agent route
    assert required_role("GET", "/never/heard/of") == Role.admin


async def test_every_route_refuses_no_key_a_wrong_key_and_each_lower_role_and_nothing_changes(served):
    episode_id = await open_episode_with_a_call(served)
    before = served.snapshot()
    assert len(before["episodes"]) == 1 and len(before["calls"]) == 1
    for method, template in app_routes(served.app):
        needed = expected_role(method, template)
        if needed is None:
            assert served.request(method, template, episode_id, {}).status_code == 200
            continue
        attempts = [({}, 401, "missing_api_key"), ({"Authorization": "Basic abc"}, 401, "missing_api_key")]
        attempts += [({"Authorization": f"Bearer {WRONG_KEY}"}, 401, "invalid_api_key")]
        attempts += [({"X-API-Key": WRONG_KEY}, 401, "invalid_api_key")]
        for role in Role:
            if role < needed:
                attempts += [({"Authorization": f"Bearer {KEYS[role]}"}, 403, "insufficient_role")]
                attempts += [({"X-API-Key": KEYS[role]}, 403, "insufficient_role")]
        for headers, status, code in attempts:
            r = served.request(method, template, episode_id, headers)
            assert r.status_code == status, (method, template, headers, r.text)
            assert (r.headers.get("www-authenticate") == "Bearer") == (status == 401)
            if method == "HEAD":  # a HEAD answer has no body
                continue
            error = r.json()["error"]
            assert error["code"] == code and error["type"] == "invalid_request_error" and "param" in error
            assert error["message"] and not any(key in r.text for key in [*KEYS.values(), WRONG_KEY])
    assert served.snapshot() == before  # nothing recorded, nothing changed


async def test_each_route_lets_its_own_role_through(served):
    episode_id = await open_episode_with_a_call(served)
    for method, template in app_routes(served.app):
        role = expected_role(method, template)
        headers = {} if role is None else {"Authorization": f"Bearer {KEYS[role]}"}
        r = served.request(method, template, episode_id, headers)
        assert r.status_code not in (401, 403), (method, template, r.text)


async def test_the_right_roles_work_through_the_openai_sdk_and_episode_client(served):
    async with (
        EpisodeClient(served.root, api_key=KEYS[Role.runner]) as runner,
        EpisodeClient(served.root, api_key=KEYS[Role.admin]) as admin,
        EpisodeClient(served.root, api_key=KEYS[Role.agent]) as agent_episodes,
    ):
        episode = await runner.create("task-roles")
        agent = openai.AsyncOpenAI(base_url=episode.base_url, api_key=KEYS[Role.agent], max_retries=0)
        reply = await agent.chat.completions.create(model=EMBEDDED_MODEL, messages=CHAT["messages"], max_tokens=4)
        assert reply.choices[0].message.content is not None
        with pytest.raises(GatewayError) as refused:  # an agent may not reward, even its own episode
            await agent_episodes.finish(episode.id, reward=1.0)
        assert refused.value.status == 403 and "needs a runner key" in str(refused.value)
        with pytest.raises(GatewayError) as refused:  # a runner may not read every episode
            await runner.list()
        assert refused.value.status == 403
        finished = await runner.finish(episode.id, reward=0.5)
        assert finished.status == "finished" and finished.reward == 0.5
        listed = await admin.list(task_id="task-roles")
        assert [e.id for e in listed] == [episode.id] and len(await admin.calls(episode.id)) == 1
    # a higher role may do what a lower one may; a wrong key is the SDK's AuthenticationError
    models = await openai.AsyncOpenAI(base_url=f"{served.root}/v1", api_key=KEYS[Role.admin]).models.list()
    assert EMBEDDED_MODEL in [m.id for m in models.data]
    with pytest.raises(openai.AuthenticationError) as wrong:
        await openai.AsyncOpenAI(base_url=f"{served.root}/v1", api_key=WRONG_KEY, max_retries=0).models.list()
    assert wrong.value.code == "invalid_api_key"
    with pytest.raises(openai.PermissionDeniedError) as low:
        await openai.AsyncOpenAI(base_url=served.root, api_key=KEYS[Role.agent], max_retries=0).post(
            "/episodes", body={"task_id": "t"}, cast_to=object
        )
    assert low.value.code == "insufficient_role"
    assert httpx.get(f"{served.root}/health").status_code == 200  # open to all


def test_the_key_is_checked_before_the_body_is_read(served):
    """A body over the server's cap is a 413 once the key is right, a 401 or 403 before: the key comes first."""
    big = {"task_id": "x" * (2 * BODY_CAP)}
    assert httpx.post(f"{served.root}/episodes", json=big).status_code == 401
    agent = {"X-API-Key": KEYS[Role.agent]}
    assert httpx.post(f"{served.root}/episodes", json=big, headers=agent).status_code == 403
    runner = {"X-API-Key": KEYS[Role.runner]}
    assert httpx.post(f"{served.root}/episodes", json=big, headers=runner).status_code == 413
    # X-API-Key comes before Authorization (which the openai SDK always sends, with whatever api_key it has)
    both = {"X-API-Key": KEYS[Role.runner], "Authorization": f"Bearer {KEYS[Role.agent]}"}
    assert httpx.post(f"{served.root}/episodes", json={"task_id": "t"}, headers=both).status_code == 201


@pytest.mark.parametrize(
    ("text", "where", "what"),
    [
        ("# keys\n\nadmin {k}\nrunner {k2} extra\n", "line 4", "two words"),
        ("{k} admin\n", "line 1", "unknown role"),  # role and key swapped: the key is not echoed
        ("agent short\n", "line 1", "at least 16"),
        ("agent {k}\nadmin {k}  # again\n", "line 2", "two different roles"),
    ],
)
def test_a_malformed_key_file_names_the_line_and_never_the_key(tmp_path, text, where, what):
    k, k2 = secrets.token_urlsafe(32), secrets.token_urlsafe(32)
    path = tmp_path / "keys.txt"
    path.write_text(text.format(k=k, k2=k2))
    with pytest.raises(ApiKeyError) as error:
        ApiKeys.read(path)
    message = str(error.value)
    assert f"{path}, {where}" in message and what in message and k not in message and k2 not in message


def test_keys_from_the_environment_and_a_file_together(tmp_path, monkeypatch):
    path = tmp_path / "keys"
    path.write_text(f"runner {KEYS[Role.runner]}  # the runners' key\n")
    monkeypatch.setenv(ENV_VAR, f"admin:{KEYS[Role.admin]}, agent:{KEYS[Role.agent]},")
    keys = ApiKeys.configured(path)
    assert {role: keys.role_of(key.encode()) for role, key in KEYS.items()} == {r: r for r in Role}
    assert keys.role_of(WRONG_KEY.encode()) is None
    assert not any(key in repr(keys) for key in KEYS.values()) and repr(keys) == "ApiKeys(agent=1, runner=1, admin=1)"
    monkeypatch.setenv(ENV_VAR, f"admin={KEYS[Role.admin]}")
    with pytest.raises(ApiKeyError, match=f"{ENV_VAR}, item 1: expected 'role:key'") as error:
        ApiKeys.configured()
    assert KEYS[Role.admin] not in str(error.value)


def cli_env(home: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != ENV_VAR}
    return env | {"FLYWHEEL_HOME": str(home), "COLUMNS": "200"}


def serve_refusal(home: Path, *args: str) -> Result:
    """``flywheel serve ARGS`` in this process, without the keys' environment variable: a refusal comes before the
    model loads, in a fraction of a second (a process of its own spent seconds importing torch first)."""
    result = CliRunner().invoke(
        app, ["serve", *args], env={ENV_VAR: None, "FLYWHEEL_HOME": str(home), "COLUMNS": "200"}
    )
    assert result.exception is None or isinstance(result.exception, SystemExit), result.exception  # no traceback
    return result


def test_serve_on_the_network_without_keys_refuses_before_loading_the_model(tmp_path, caplog):
    # a model that does not exist: had serve loaded it first, it would have said so instead
    missing = str(tmp_path / "no-such-model")
    args = ["--model", missing, "--host", "0.0.0.0"]
    refused = serve_refusal(tmp_path, *args)
    assert refused.exit_code == 2, refused.output
    assert "Refusing to serve on 0.0.0.0 without API keys" in refused.output and "--insecure-no-auth" in refused.output
    allowed = serve_refusal(tmp_path, *args, "--insecure-no-auth")
    assert allowed.exit_code == 2 and "Refusing" not in allowed.output and "no-such-model" in allowed.output
    bad = tmp_path / "keys"
    bad.write_text(f"admin {KEYS[Role.admin]}\nrunner\n")
    malformed = serve_refusal(tmp_path, "--model", missing, "--api-keys", str(bad))
    assert malformed.exit_code == 2 and "line 2: expected 'role key'" in malformed.output
    assert KEYS[Role.admin] not in malformed.output + caplog.text  # output (stdout and stderr) and logs


def test_serve_with_keys_answers_by_role_and_never_logs_a_key(tmp_path):
    path = tmp_path / "keys"
    path.write_text("".join(f"{role.name} {key}\n" for role, key in KEYS.items()))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen(
        [FLYWHEEL, "serve", "--port", str(port), "--api-keys", str(path)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=cli_env(tmp_path),
    )
    try:
        root = f"http://127.0.0.1:{port}"
        wait_until_healthy(proc, root, proc.communicate)
        agent = openai.OpenAI(base_url=f"{root}/v1", api_key=KEYS[Role.agent], max_retries=0)
        assert EMBEDDED_MODEL in [m.id for m in agent.models.list().data]
        assert httpx.get(f"{root}/v1/models", headers={"X-API-Key": WRONG_KEY}).status_code == 401
        runner = {"Authorization": f"Bearer {KEYS[Role.runner]}"}
        assert httpx.post(f"{root}/episodes", json={"task_id": "t"}, headers=runner).status_code == 201
        assert httpx.get(f"{root}/episodes", headers=runner).status_code == 403
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    log = out + err
    assert "ApiKeys(agent=1, runner=1, admin=1)" in out
    assert '"GET /v1/models HTTP/1.1" 401' in log and '"POST /episodes HTTP/1.1" 201' in log  # the access log
    assert not any(key in log for key in [*KEYS.values(), WRONG_KEY])


async def test_local_backend_serves_with_its_keys_and_refuses_the_network_without(tmp_path):
    with pytest.raises(ValueError, match="give api_keys, or insecure_no_auth=True"):
        LocalBackend(path=tmp_path, host="0.0.0.0")
    backend = LocalBackend(path=tmp_path, api_keys=ApiKeys([("agent", KEYS[Role.agent])]))
    try:
        await backend.load(EMBEDDED_MODEL)
        assert httpx.get(f"{backend.base_url}/models").status_code == 401
        sdk = openai.AsyncOpenAI(base_url=backend.base_url, api_key=KEYS[Role.agent], max_retries=0)
        assert EMBEDDED_MODEL in [m.id for m in (await sdk.models.list()).data]
    finally:
        await backend.close()


class Checkpoints:
    """A registry whose loader serves the engine as ``MODEL@1`` .. ``MODEL@3`` when asked (as LocalBackend loads a
    saved checkpoint into an engine of its own, evicting the oldest) and notes each load; a real server on it."""

    def __init__(self, engine, tmp_path: Path, budgets: TokenBudgets | None = None):
        self.engine, self.loaded = engine, []
        self.registry = ModelRegistry(loader=self.load)
        self.registry.add(EMBEDDED_MODEL, engine)
        self.store = Store(f"sqlite:///{tmp_path / 'flywheel.db'}")
        limits = {} if budgets is None else {"budgets": budgets}
        app = create_app(self.registry, Gateway(self.store), auth=ApiKeys(KEYS.items()), **limits)
        self.server = BackgroundServer(app).start()
        self.root = f"http://127.0.0.1:{self.server.port}"

    def load(self, name: str):
        model, _, step = name.rpartition("@")
        if model != EMBEDDED_MODEL or step not in ("1", "2", "3"):
            return None
        self.loaded.append(name)
        self.registry.add(name, self.engine, step=int(step))
        return self.registry.get(name)

    def sdk(self, role: Role) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(base_url=f"{self.root}/v1", api_key=KEYS[role], max_retries=0)

    def close(self) -> None:
        self.server.stop()
        self.store.close()


async def test_an_agent_key_uses_served_models_and_deployments_and_never_has_a_checkpoint_loaded(engine, tmp_path):
    """Issue #37, item 18: an agent key asking for ``MODEL@1`` had it loaded (and the oldest checkpoint engine,
    production's or the canary's, evicted). It may use the names served now, deployment aliases and the
    checkpoints they point at; a runner key may still load any checkpoint."""
    served = Checkpoints(engine, tmp_path)
    try:
        with served.store.session() as s:
            deployments.deploy(s, f"{EMBEDDED_MODEL}@production", 2, actor="test")
            deployments.deploy(s, f"{EMBEDDED_MODEL}@canary", 3, actor="test", share=0.0)
        agent, runner = served.sdk(Role.agent), served.sdk(Role.runner)

        async def ask(client: openai.AsyncOpenAI, model: str) -> str | None:
            reply = await client.chat.completions.create(model=model, messages=CHAT["messages"], max_tokens=2)
            return reply.choices[0].message.content

        with pytest.raises(openai.PermissionDeniedError) as refused:
            await ask(agent, f"{EMBEDDED_MODEL}@1")
        assert refused.value.code == "model_not_allowed" and refused.value.body["param"] == "model"
        assert "needs a runner key" in refused.value.message and EMBEDDED_MODEL in refused.value.message
        assert served.loaded == []  # refused before the loader was asked
        assert await ask(agent, EMBEDDED_MODEL) is not None  # served now
        assert await ask(agent, f"{EMBEDDED_MODEL}@production") is not None  # an alias loads its checkpoint
        assert served.loaded == [f"{EMBEDDED_MODEL}@2"]
        assert await ask(agent, f"{EMBEDDED_MODEL}@2") is not None  # served now
        assert await ask(agent, f"{EMBEDDED_MODEL}@3") is not None  # the canary's checkpoint: a deployment's
        assert served.loaded == [f"{EMBEDDED_MODEL}@2", f"{EMBEDDED_MODEL}@3"]
        with pytest.raises(openai.PermissionDeniedError):
            await ask(agent, f"{EMBEDDED_MODEL}@1")
        with pytest.raises(openai.PermissionDeniedError):  # a name nobody serves: the agent's answer is the same
            await ask(agent, "no-such-model")
        assert await ask(runner, f"{EMBEDDED_MODEL}@1") is not None  # the training side may load any checkpoint
        assert served.loaded[-1] == f"{EMBEDDED_MODEL}@1"
        with pytest.raises(openai.NotFoundError):
            await ask(runner, "no-such-model")
    finally:
        served.close()


async def test_n_times_max_tokens_is_capped_by_the_keys_role(engine, tmp_path):
    """Issue #37, item 18: an agent key could ask ``n`` = 128 choices of the whole context. ``n`` x ``max_tokens``
    is capped by role (a clear 400 naming the limit and the field); a request that does not say ``max_tokens``
    gets its share of the budget; an admin key has no cap here."""
    budgets = TokenBudgets({Role.agent: 24, Role.runner: 64, Role.admin: None})
    served = Checkpoints(engine, tmp_path, budgets)
    try:
        agent, runner, admin = served.sdk(Role.agent), served.sdk(Role.runner), served.sdk(Role.admin)
        with pytest.raises(openai.BadRequestError) as refused:
            await agent.chat.completions.create(model=EMBEDDED_MODEL, messages=CHAT["messages"], n=4, max_tokens=8)
        error = refused.value.body
        assert refused.value.code == "token_budget_exceeded" and error["param"] == "max_tokens"
        assert (
            "n (4) x max_tokens (8) = 32 is over the 24 tokens" in error["message"] and "agent key" in error["message"]
        )
        with pytest.raises(openai.BadRequestError) as refused:  # n alone over it
            await agent.chat.completions.create(model=EMBEDDED_MODEL, messages=CHAT["messages"], n=25)
        assert refused.value.body["param"] == "n" and "n (25)" in refused.value.body["message"]
        fits = await agent.chat.completions.create(model=EMBEDDED_MODEL, messages=CHAT["messages"], n=3, max_tokens=8)
        assert len(fits.choices) == 3
        unsaid = await agent.chat.completions.create(
            model=EMBEDDED_MODEL,
            messages=CHAT["messages"],
            n=4,
            temperature=1.0,
            seed=1,
            extra_body={"ignore_eos": True},
        )
        assert [len(c.model_extra["token_ids"]) for c in unsaid.choices] == [6] * 4  # 24 // 4 each, not the context
        assert unsaid.choices[0].finish_reason == "length"
        assert len((await runner.chat.completions.create(
            model=EMBEDDED_MODEL, messages=CHAT["messages"], n=4, max_tokens=8
        )).choices) == 4  # fmt: skip
        with pytest.raises(openai.BadRequestError):
            await runner.chat.completions.create(model=EMBEDDED_MODEL, messages=CHAT["messages"], n=9, max_tokens=8)
        reply = await admin.chat.completions.create(model=EMBEDDED_MODEL, messages=CHAT["messages"], n=9, max_tokens=8)
        assert len(reply.choices) == 9
    finally:
        served.close()


def test_token_budgets_from_the_environment(monkeypatch):
    monkeypatch.setenv(BUDGETS_ENV_VAR, "agent:100, admin:5000,")
    budgets = TokenBudgets.configured()
    assert budgets.by_role == {Role.agent: 100, Role.runner: 262_144, Role.admin: 5000}
    assert budgets.check(Role.agent, 4, 25) == 25 and budgets.check(None, 128, 10**6) is None  # no keys: no cap
    monkeypatch.setenv(BUDGETS_ENV_VAR, "runner:none")
    assert TokenBudgets.configured().check(Role.runner, 128, 10**6) is None
    for bad, what in (("agent=5", "expected 'role:TOKENS'"), ("agent:0", "expected"), ("robot:5", "unknown role")):
        monkeypatch.setenv(BUDGETS_ENV_VAR, bad)
        with pytest.raises(ApiKeyError, match=f"{BUDGETS_ENV_VAR}, item 1: .*{what}"):
            TokenBudgets.configured()
