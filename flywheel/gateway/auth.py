"""Who may do what: API keys with roles (agent < runner < admin), checked before any route of the server runs.

Keys come from ``FLYWHEEL_API_KEYS`` (``"admin:KEY1,runner:KEY2,agent:KEY3"``) or a file (one ``role key`` per
line, ``#`` comments). Only their SHA-256 digests are kept, and a request's key is compared in constant time with
every configured one. A request sends its key as ``Authorization: Bearer KEY`` (what the openai SDK sends as its
``api_key``) or ``X-API-Key: KEY``. Each route needs a least role (``RULES``; a route not listed needs admin,
``/health`` none): a missing or unknown key is a 401, a key of too low a role a 403, both with OpenAI's error body
and before the route reads the request's body. With no key configured the server is open (on loopback by default).

A request let through carries its key's role (``request_role``) for what the routes decide by role: an agent key
may ask only for the models served now and deployment aliases (and the checkpoints they point at), never have
another checkpoint loaded (it would evict the engines that production and the canary answer with); and each role
may ask a chat completion for at most so many tokens, ``n`` x ``max_tokens`` (``TokenBudgets``, from
``FLYWHEEL_TOKEN_BUDGETS``, ``"agent:32768,runner:262144,admin:none"`` by default).
"""

from __future__ import annotations

import enum
import functools
import hashlib
import hmac
import ipaddress
import json
import os
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from starlette._utils import get_route_path  # the path the router matches routes against (root_path removed)
from starlette.requests import Request
from starlette.types import ASGIApp, Receive, Scope, Send

ENV_VAR = "FLYWHEEL_API_KEYS"
BUDGETS_ENV_VAR = "FLYWHEEL_TOKEN_BUDGETS"
ROLE_STATE = "flywheel_role"  # where ApiKeyAuth puts the role of a request it lets through (its scope's state)
MIN_KEY_LENGTH = 16
# printable ASCII without spaces, "#" (a file's comments) or "," (the variable's separator)
_KEY_CHARS = re.compile(r"[!\"$-+\--~]+")


class Role(enum.IntEnum):
    """A key's role; each may do all that a lower one may."""

    agent = 1  # completions (plain, or in an episode it is given the URL or id of)
    runner = 2  # creates episodes, posts their outcomes; claims tasks and reports on its attempts
    admin = 3  # reads every episode and export, enqueues tasks, and every route not listed in RULES


class ApiKeyError(ValueError):
    """Keys that cannot be used: the message names where (variable item or file line), never the key itself."""


@dataclass(frozen=True)
class Rule:
    """Requests with one of ``methods`` on a path matching ``template`` need ``role`` (None: anyone)."""

    methods: frozenset[str]
    template: str  # "{name}": one path segment; "{name:path}": the rest of the path
    role: Role | None

    def matches(self, method: str, path: str) -> bool:
        return method in self.methods and _regex(self.template).fullmatch(path) is not None


@functools.cache
def _regex(template: str) -> re.Pattern[str]:
    parts = re.split(r"(\{\w+(?::path)?\})", template)
    return re.compile(
        "".join((".+" if p.endswith(":path}") else "[^/]+") if p.startswith("{") else re.escape(p) for p in parts if p)
    )


def _rule(methods: str, template: str, role: Role | None) -> Rule:
    return Rule(frozenset(methods.split()), template, role)


RULES: tuple[Rule, ...] = (
    _rule("GET", "/health", None),
    _rule("GET", "/v1/models", Role.agent),
    _rule("POST", "/v1/chat/completions", Role.agent),  # X-Flywheel-Episode: an episode's call
    _rule("GET POST", "/episodes/{episode_id}/v1/{rest:path}", Role.agent),
    _rule("POST", "/episodes", Role.runner),
    _rule("GET", "/episodes/{episode_id}", Role.runner),
    _rule("POST", "/episodes/{episode_id}/reward", Role.runner),
    _rule("POST", "/episodes/{episode_id}/finish", Role.runner),
    _rule("POST", "/episodes/{episode_id}/abandon", Role.runner),
    _rule("POST", "/episodes/{episode_id}/feedback", Role.runner),  # outcome feedback from the production system
    _rule("POST", "/tasks/claim", Role.runner),
    _rule("POST", "/attempts/{attempt_id}/heartbeat", Role.runner),
    _rule("POST", "/attempts/{attempt_id}/complete", Role.runner),
    _rule("POST", "/attempts/{attempt_id}/fail", Role.runner),
    _rule("POST", "/approvals", Role.agent),  # an agent that runs its own tools asks a person (HumanApprover)
    _rule("GET", "/approvals/{approval_id}/decision", Role.agent),  # and reads the decision (not the others')
    _rule("GET", "/ui/api/{rest:path}", Role.admin),  # the dashboard's data (flywheel.dashboard)
    *(_rule("GET", page, None) for page in ("/ui", "/ui/", "/ui/{rest:path}")),  # its page, script, styles: no
    # data in them (the page asks for an admin key to read the data with)
)  # anything else (listing and reading episodes, exports, groups, enqueuing and reading tasks, docs): admin


def required_role(method: str, path: str) -> Role | None:
    """The least role a request needs: its first matching rule's, else admin (a new route is closed by default)."""
    return next((rule.role for rule in RULES if rule.matches(method, path)), Role.admin)


def is_loopback(host: str) -> bool:
    """Whether a server bound to ``host`` is reachable from this machine only."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:  # a name other than localhost: it may resolve anywhere
        return False


class ApiKeys:
    """Configured keys, kept as SHA-256 digests only. ``ApiKeys([("admin", key), ...])``, ``parse``, ``read``."""

    def __init__(self, keys: Iterable[tuple[Role | str, str]] = ()):
        self._digests: dict[bytes, Role] = {}
        for i, (role, key) in enumerate(keys, 1):
            self._add(role, key, f"key {i}")

    def _add(self, role: Role | str, key: str, where: str) -> None:
        if isinstance(role, str):
            if role not in Role.__members__:
                raise ApiKeyError(f"{where}: unknown role; the roles are {', '.join(Role.__members__)}.")
            role = Role[role]
        if len(key) < MIN_KEY_LENGTH or not _KEY_CHARS.fullmatch(key):
            raise ApiKeyError(
                f"{where}: a key must be at least {MIN_KEY_LENGTH} printable ASCII characters without spaces,"
                " '#' or ',' (e.g. python -c 'import secrets; print(secrets.token_urlsafe(32))')."
            )
        digest = hashlib.sha256(key.encode()).digest()
        if self._digests.setdefault(digest, role) != role:
            raise ApiKeyError(f"{where}: this key is given with two different roles.")

    @classmethod
    def parse(cls, text: str, source: str = ENV_VAR) -> ApiKeys:
        """``"role:key,role:key"`` (the environment variable's form); blank items are skipped."""
        keys = cls()
        for i, item in enumerate(text.split(","), 1):
            if not item.strip():
                continue
            role, sep, key = item.strip().partition(":")
            if not sep:
                raise ApiKeyError(f"{source}, item {i}: expected 'role:key'.")
            keys._add(role.strip(), key.strip(), f"{source}, item {i}")
        return keys

    @classmethod
    def read(cls, path: str | Path) -> ApiKeys:
        """A file of ``role key`` lines; ``#`` starts a comment, blank lines are skipped."""
        try:
            text = Path(path).read_text()
        except (OSError, UnicodeDecodeError) as exc:
            raise ApiKeyError(f"Cannot read the API key file {path}: {exc.__class__.__name__}.") from None
        keys = cls()
        for n, line in enumerate(text.splitlines(), 1):
            words = line.split("#", 1)[0].split()
            if not words:
                continue
            if len(words) != 2:
                raise ApiKeyError(f"{path}, line {n}: expected 'role key' (two words), found {len(words)}.")
            keys._add(words[0], words[1], f"{path}, line {n}")
        return keys

    @classmethod
    def configured(cls, path: str | Path | None = None) -> ApiKeys:
        """The keys of ``$FLYWHEEL_API_KEYS`` and of the file at ``path``, if given, together."""
        keys = cls.parse(os.environ.get(ENV_VAR, ""))
        if path is not None:
            for digest, role in cls.read(path)._digests.items():
                if keys._digests.setdefault(digest, role) != role:
                    raise ApiKeyError(f"{path}: a key of it is in {ENV_VAR} with another role.")
        return keys

    def role_of(self, key: bytes) -> Role | None:
        """The role of ``key``, or None; compared with every configured key, so the time taken says nothing."""
        digest = hashlib.sha256(key).digest()
        found = None
        for stored, role in self._digests.items():
            if hmac.compare_digest(stored, digest):
                found = role
        return found

    def __len__(self) -> int:
        return len(self._digests)

    def __repr__(self) -> str:  # counts only: never a key, nor its digest
        counts = {r.name: sum(v == r for v in self._digests.values()) for r in Role}
        return "ApiKeys(" + ", ".join(f"{k}={v}" for k, v in counts.items()) + ")"


def _default_budgets() -> dict[Role, int | None]:
    # an agent: 8 choices of 4096 tokens (or one of 32768); a runner (the training side's own sampling): 64 x 4096
    return {Role.agent: 32_768, Role.runner: 262_144, Role.admin: None}


@dataclass(frozen=True)
class TokenBudgets:
    """The most tokens one chat completion may ask for, ``n`` x ``max_tokens``, by its key's role (None: no cap;
    a server with no keys has none). A request over its budget is refused (``TokenBudgetError``); one that does
    not say ``max_tokens`` gets its share of the budget at most (``budget // n``) instead of the whole context."""

    by_role: Mapping[Role, int | None] = field(default_factory=_default_budgets)

    @classmethod
    def parse(cls, text: str, source: str = BUDGETS_ENV_VAR) -> TokenBudgets:
        """``"agent:32768,runner:none"``: the roles named replace their default (``none``: no cap)."""
        budgets = _default_budgets()
        for i, item in enumerate(text.split(","), 1):
            if not item.strip():
                continue
            role, sep, value = (part.strip() for part in item.partition(":"))
            if not sep:
                raise ApiKeyError(f"{source}, item {i}: expected 'role:TOKENS', got {item.strip()!r}.")
            if role not in Role.__members__:
                raise ApiKeyError(
                    f"{source}, item {i}: unknown role {role!r}; the roles are {', '.join(Role.__members__)}."
                )
            if value.lower() == "none":
                budgets[Role[role]] = None
            elif value.isdigit() and int(value) >= 1:
                budgets[Role[role]] = int(value)
            else:
                raise ApiKeyError(
                    f"{source}, item {i}: expected 'role:TOKENS' (a positive integer, or none), got {item.strip()!r}."
                )
        return cls(budgets)

    @classmethod
    def configured(cls) -> TokenBudgets:
        """``$FLYWHEEL_TOKEN_BUDGETS`` over the defaults."""
        return cls.parse(os.environ.get(BUDGETS_ENV_VAR, ""))

    def check(self, role: Role | None, n: int, max_tokens: int | None) -> int | None:
        """The most tokens each of a request's ``n`` choices may take (None: no cap) if ``n`` choices of ``max_tokens``
        (None: not said) fit its role's budget; else a ``TokenBudgetError`` that names the limit."""
        if role is None or (budget := self.by_role.get(role)) is None:  # no keys, or the gateway's own call
            return None
        asked = n * (max_tokens or 1)
        if asked > budget:
            what = f"n ({n}) x max_tokens ({max_tokens}) = {asked}" if max_tokens else f"n ({n})"
            raise TokenBudgetError(
                f"{what} is over the {budget} tokens that one request with a {role.name} key may ask for "
                f"(n x max_tokens; {BUDGETS_ENV_VAR} sets it): ask for fewer choices or fewer tokens.",
                "max_tokens" if max_tokens else "n",
            )
        return budget // n


class TokenBudgetError(ValueError):
    """A request asks for more tokens than its key's role may (``param``: the field to lower)."""

    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param


def request_role(request: Request) -> Role | None:
    """The role of the key a request was let through with (None: the server has no keys)."""
    return request.scope.get("state", {}).get(ROLE_STATE)


def request_key(headers: dict[bytes, bytes]) -> bytes | None:
    """The key a request sends: ``X-API-Key``, else an ``Authorization: Bearer`` token."""
    if key := headers.get(b"x-api-key", b"").strip():
        return key
    scheme, _, token = headers.get(b"authorization", b"").strip().partition(b" ")
    if scheme.lower() != b"bearer":
        return None
    return token.strip() or None


class ApiKeyAuth:
    """ASGI middleware: a request reaches the app only with a key of the role its route needs."""

    def __init__(self, app: ASGIApp, keys: ApiKeys):
        self.app, self.keys = app, keys

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "websocket":  # no route takes one: never let one past unchecked
            return await send({"type": "websocket.close", "code": 1008})
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        needed = required_role(scope["method"], get_route_path(scope))
        if needed is None:
            return await self.app(scope, receive, send)
        key = request_key(dict(scope["headers"]))
        if key is None:
            how = "send it as 'Authorization: Bearer KEY' (the openai SDK's api_key) or 'X-API-Key: KEY'"
            return await _refuse(send, 401, f"This server needs an API key: {how}.", "missing_api_key")
        role = self.keys.role_of(key)
        if role is None:
            return await _refuse(send, 401, "The API key is not one of this server's keys.", "invalid_api_key")
        if role < needed:
            message = f"{scope['method']} {get_route_path(scope)} needs a {needed.name} key; this one is {role.name}."
            return await _refuse(send, 403, message, "insufficient_role")
        scope.setdefault("state", {})[ROLE_STATE] = role
        await self.app(scope, receive, send)


async def _refuse(send: Send, status: int, message: str, code: str) -> None:
    payload = json.dumps(
        {"error": {"message": message, "type": "invalid_request_error", "param": None, "code": code}}
    ).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode())]
    if status == 401:
        headers.append((b"www-authenticate", b"Bearer"))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": payload})
