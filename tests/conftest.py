"""Shared fixtures: the real embedded model, loaded once per test session, served on a real loopback port; a real
PostgreSQL server with a new database per test, and ``db_url``, which runs a store test on SQLite and on PostgreSQL.
And a closing section that lists what the run did not check (skipped tests, by reason)."""

from __future__ import annotations

import itertools
import os
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
import pytest_asyncio
from postgres import PostgresServer, find_bindir

from flywheel.inference.engine import InferenceEngine
from flywheel.inference.loading import EMBEDDED_MODEL
from flywheel.local.backend import LocalBackend
from flywheel.model import TrainableModel


@pytest_asyncio.fixture(scope="session", loop_scope="session")
async def backend(tmp_path_factory: pytest.TempPathFactory):
    backend = LocalBackend(path=tmp_path_factory.mktemp("flywheel-home"))
    await backend.load(EMBEDDED_MODEL)
    yield backend
    await backend.close()


@pytest.fixture(scope="session")
def engine(backend: LocalBackend) -> InferenceEngine:
    return backend.engine(EMBEDDED_MODEL)


@pytest.fixture(scope="session")
def tokenizer(engine: InferenceEngine):
    return engine.tokenizer


@pytest.fixture
def client(backend: LocalBackend) -> openai.AsyncOpenAI:
    """The openai SDK on the session's server."""
    return openai.AsyncOpenAI(base_url=backend.base_url, api_key="unused", max_retries=0)


@pytest.fixture
async def fresh_backend(tmp_path):
    """A backend of the test's own (its own home directory), closed after it."""
    backend = LocalBackend(path=tmp_path)
    yield backend
    await backend.close()


@pytest_asyncio.fixture(scope="session", loop_scope="session")
async def model(backend: LocalBackend) -> TrainableModel:
    model = TrainableModel(name="test-agent", project="tests", base_model=EMBEDDED_MODEL)
    await model.register(backend)
    return model


@pytest.fixture(scope="session")
def fp32_engine():
    """A float32 engine for exactness tests: in bf16, a different batch size changes matmul rounding, so batched
    and sequential greedy decoding may part ways after some tokens (true of any batching engine)."""
    import torch

    from flywheel.inference.loading import load_model

    model, tokenizer, _ = load_model(EMBEDDED_MODEL, dtype=torch.float32)
    engine = InferenceEngine(model, tokenizer)
    yield engine
    engine.close()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Tests marked ``slow`` (minutes each) run in CI (``CI=true``, which has 90 minutes) and with
    ``FLYWHEEL_SLOW_TESTS=1``; a developer's plain ``./dev test`` skips them, so it stays under 20 minutes."""
    if os.environ.get("CI") == "true" or os.environ.get("FLYWHEEL_SLOW_TESTS"):
        return
    skip = pytest.mark.skip(reason="slow: runs in CI (CI=true) or with FLYWHEEL_SLOW_TESTS=1")
    for item in items:
        if item.get_closest_marker("slow"):
            item.add_marker(skip)


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    """Skips must not pass silently: a machine without a C++ compiler (compiled decode), user namespaces (the
    sandbox's kernel isolation) or an optional package leaves capabilities unchecked; say which, and where."""
    reasons: dict[str, list[str]] = {}
    for report in terminalreporter.stats.get("skipped", []):
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
        reasons.setdefault(reason.removeprefix("Skipped: "), []).append(report.nodeid)
    if not reasons:
        return
    terminalreporter.section("NOT CHECKED on this machine: skipped tests, by reason", sep="!", yellow=True, bold=True)
    for reason, tests in reasons.items():
        terminalreporter.line(f"{len(tests)} skipped: {reason}", yellow=True, bold=True)
        for nodeid in tests:
            terminalreporter.line(f"    {nodeid}")


@pytest.fixture(scope="session")
def postgres() -> Iterator[PostgresServer]:
    """A PostgreSQL server of this test session's own (tests/postgres.py). Without Debian's ``postgresql`` the tests
    that need it are skipped, saying so; in CI (``CI=true``, where .ci/run installs it) that is an error."""
    bindir = find_bindir()
    if bindir is None:
        missing = (
            "PostgreSQL is not installed (no initdb in /usr/lib/postgresql/*/bin or on PATH):"
            " the store was not tested on it"
        )
        if os.environ.get("CI") == "true":
            pytest.fail(f"{missing}; CI must test it: install Debian's postgresql (apt-get install postgresql)")
        pytest.skip(f"{missing} (apt-get install postgresql)")
    server = PostgresServer(bindir)
    try:
        server.start()
        yield server
    finally:
        server.stop()


_databases = itertools.count()


@pytest.fixture
def pg_url(postgres: PostgresServer) -> Iterator[str]:
    """A new, empty database on the session's PostgreSQL server, dropped after the test."""
    name = f"t{next(_databases)}"
    yield postgres.create_database(name)
    postgres.drop_database(name)


@pytest.fixture(params=["sqlite", "postgresql"])
def db_url(request: pytest.FixtureRequest, tmp_path) -> str:
    """A new, empty store database: SQLite in the test's directory, then PostgreSQL (a database of its own)."""
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'flywheel.db'}"
    return request.getfixturevalue("pg_url")


CHROMIUM, CHROMEDRIVER = Path("/usr/bin/chromium"), Path("/usr/bin/chromedriver")


@pytest.fixture(scope="module")
def browser():
    """A real headless Chromium driven through Selenium (Debian's chromium and chromium-driver: the dashboard's
    tests); skipped without them, except in CI, which must have them (.ci/run installs them)."""
    if not (CHROMIUM.exists() and CHROMEDRIVER.exists()):
        if os.environ.get("CI") == "true":
            pytest.fail(f"CI must drive the dashboard in Chromium: {CHROMIUM} or {CHROMEDRIVER} is missing (.ci/run)")
        pytest.skip(f"no Chromium here ({CHROMIUM}, {CHROMEDRIVER}: Debian's chromium and chromium-driver)")
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = str(CHROMIUM)
    for argument in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu"):
        options.add_argument(argument)
    driver = webdriver.Chrome(service=Service(str(CHROMEDRIVER)), options=options)
    yield driver
    driver.quit()
