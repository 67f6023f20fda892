"""Python graders in the sandbox: they grade, and every attempt to get out is contained (scores 0 with an error
kind) while this process carries on. Real processes, real limits, no mocks."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from flywheel.graders import PythonSandbox, Sample, SandboxLimits, grade, parse_grader
from flywheel.graders.sandbox import _python_dirs, isolation

SECRET = "flywheel-test-secret-4b1d"


def python(source: str) -> dict:
    return {"type": "python", "name": "py", "source": source}


@pytest.fixture(scope="module")
def sandbox() -> PythonSandbox:
    # Small limits keep the runaway cases quick; 256 MiB is still plenty for Python and numpy.
    return PythonSandbox(SandboxLimits(timeout_s=3, memory_mb=256))


async def run(sandbox: PythonSandbox, source: str, sample: str | Sample = "x", item: dict | None = None):
    return await grade(parse_grader(python(source)), sample, item or {}, sandbox=sandbox)


async def test_openai_python_grader_example(sandbox):
    """The guide's python grader: rapidfuzz's WRatio between the output and the reference answer."""
    from rapidfuzz import fuzz, utils

    source = (
        "from rapidfuzz import fuzz, utils\n\n"
        "def grade(sample, item) -> float:\n"
        "    output_text = sample['output_text']\n"
        "    reference_answer = item['reference_answer']\n"
        "    return fuzz.WRatio(output_text, reference_answer, processor=utils.default_process) / 100.0\n"
    )
    result = await run(sandbox, source, "fuzzy wuzzy was a bear", {"reference_answer": "fuzzy wuzzy was a bear"})
    assert (result.reward, result.errors) == (1.0, {})
    close = await run(sandbox, source, "Fuzzy Wuzzy was a bear!", {"reference_answer": "fuzzy wuzzy was a bear"})
    assert close.reward == pytest.approx(
        fuzz.WRatio("Fuzzy Wuzzy was a bear!", "fuzzy wuzzy was a bear", processor=utils.default_process) / 100
    )


async def test_grader_sees_sample_and_item_and_may_use_its_directory(sandbox):
    source = (
        "import json, os, numpy, statistics\n"
        "def grade(sample, item):\n"
        "    with open('scratch.txt', 'w') as f:\n"
        "        f.write(sample['output_json']['answer'])\n"
        "    same = open(os.path.join(os.environ['HOME'], 'scratch.txt')).read() == item['answer']\n"
        "    tool = sample['output_tools'][0]['function']['name'] == 'lookup'\n"
        "    return float(numpy.mean([same, tool, sample['choices'][0]['message']['role'] == 'assistant']))\n"
    )
    sample = Sample(
        output_text='{"answer": "42"}',
        output_tools=[{"id": "1", "type": "function", "function": {"name": "lookup", "arguments": "{}"}}],
    )
    result = await run(sandbox, source, sample, {"answer": "42"})
    assert (result.reward, result.errors) == (1.0, {})
    plain = await run(
        sandbox, "def grade(sample, item):\n    return float(sample['output_json'] is None)\n", "not json"
    )
    assert plain.reward == 1.0


@pytest.mark.parametrize(
    ("source", "fragment"),
    [
        ("def grade(sample, item):\n    return 1 / 0\n", "ZeroDivisionError"),
        ("def grade(sample, item):\n    return 'high'\n", "returned 'high', not a finite number"),
        ("def grade(sample, item):\n    return float('nan')\n", "not a finite number"),
        ("import sys\ndef grade(sample, item):\n    sys.exit(0)\n", "SystemExit"),
        ("def grade(sample, item):\n    return grade(sample, item)\n", "RecursionError"),
    ],
)
async def test_grader_failures_score_zero(sandbox, source, fragment):
    result = await run(sandbox, source)
    assert result.reward == 0.0
    assert result.errors == {"python_grader_runtime_error": 1}
    assert fragment in result.error_details["python_grader_runtime_error"]


async def test_traceback_quotes_the_grader_line(sandbox):
    result = await run(sandbox, "def grade(sample, item):\n    value = item['missing']\n    return value\n")
    detail = result.error_details["python_grader_runtime_error"]
    assert 'File "<grader>", line 2, in grade' in detail and "value = item['missing']" in detail


# ---- containment ----------------------------------------------------------------------------------------------------


async def test_network_is_refused(sandbox):
    source = (
        "import socket\n"
        "def grade(sample, item):\n"
        "    socket.create_connection(('127.0.0.1', item['port']), timeout=1)\n"
        "    return 1.0\n"
    )
    result = await run(sandbox, source, item={"port": 9})
    assert (result.reward, result.errors) == (0.0, {"python_grader_forbidden": 1})
    assert "network access" in result.error_details["python_grader_forbidden"]


async def test_parent_environment_secrets_are_unreachable(sandbox, monkeypatch):
    monkeypatch.setenv("FLYWHEEL_TEST_SECRET", SECRET)
    from_env = await run(
        sandbox, "import os\ndef grade(sample, item):\n    return float(os.environ['FLYWHEEL_TEST_SECRET'] != '')\n"
    )
    assert (from_env.reward, from_env.errors) == (0.0, {"python_grader_runtime_error": 1})
    assert "KeyError" in from_env.error_details["python_grader_runtime_error"]
    source = (
        "def grade(sample, item):\n    return float(item['secret'] in open(f\"/proc/{item['pid']}/environ\").read())\n"
    )
    from_proc = await run(sandbox, source, item={"pid": os.getpid(), "secret": SECRET})
    assert (from_proc.reward, from_proc.errors) == (0.0, {"python_grader_forbidden": 1})


async def test_writes_outside_the_temporary_directory_are_refused(sandbox, tmp_path: Path):
    target = tmp_path / "escaped.txt"
    for source in [
        "def grade(sample, item):\n    open(item['path'], 'w').write('x')\n    return 1.0\n",
        "import os\ndef grade(sample, item):\n    os.close(os.open(item['path'], os.O_CREAT | os.O_WRONLY))\n    return 1.0\n",
        "import os\ndef grade(sample, item):\n    os.symlink('/etc/hostname', item['path'])\n    return 1.0\n",
        "import shutil\ndef grade(sample, item):\n    shutil.rmtree(item['dir'])\n    return 1.0\n",
    ]:
        result = await run(sandbox, source, item={"path": str(target), "dir": str(tmp_path)})
        assert (result.reward, result.errors) == (0.0, {"python_grader_forbidden": 1}), source
    assert tmp_path.exists() and not target.exists() and not target.is_symlink()


async def test_a_refusal_fails_the_grade_even_when_caught(sandbox):
    source = (
        "def grade(sample, item):\n"
        "    try:\n"
        "        open('/root/.bash_history').read()\n"
        "    except Exception:\n"
        "        pass\n"
        "    return 1.0\n"
    )
    result = await run(sandbox, source)
    assert (result.reward, result.errors) == (0.0, {"python_grader_forbidden": 1})


@pytest.mark.parametrize(
    "source",
    [
        "def grade(sample, item):\n    while True:\n        pass\n",
        "import time\ndef grade(sample, item):\n    time.sleep(3600)\n",
    ],
    ids=["busy-loop", "sleep"],
)
async def test_endless_graders_are_stopped(sandbox, source):
    result = await run(sandbox, source)
    assert (result.reward, result.errors) == (0.0, {"python_grader_timeout": 1})


@pytest.mark.parametrize(
    "source",
    [
        "def grade(sample, item):\n    block = bytearray(8 * 1024 ** 3)\n    return 1.0\n",
        "def grade(sample, item):\n    blocks = []\n    while True:\n        blocks.append(bytearray(16 * 1024 ** 2))\n",
    ],
    ids=["one-block", "growing"],
)
async def test_unbounded_memory_is_contained(sandbox, source):
    result = await run(sandbox, source)
    assert (result.reward, result.errors) == (0.0, {"python_grader_memory": 1})


@pytest.mark.parametrize(
    "source",
    [
        "import os\ndef grade(sample, item):\n    while True:\n        os.fork()\n",
        "import subprocess\ndef grade(sample, item):\n    subprocess.run(['sh', '-c', ':(){ :|:& };:'])\n    return 1.0\n",
        "import ctypes\ndef grade(sample, item):\n    libc = ctypes.CDLL('libc.so.6')\n    while True:\n        libc.fork()\n",
        "import os, signal\ndef grade(sample, item):\n    os.kill(item['pid'], signal.SIGKILL)\n    return 1.0\n",
    ],
    ids=["os.fork", "subprocess", "ctypes-fork", "kill-parent"],
)
async def test_process_creation_and_signals_are_refused(sandbox, source):
    result = await run(sandbox, source, item={"pid": os.getpid()})
    assert (result.reward, result.errors) == (0.0, {"python_grader_forbidden": 1})
    assert os.getpid() and sys.modules["flywheel"]  # still here


async def test_threads_cannot_start(sandbox):
    """RLIMIT_NPROC is 0; enforced by the kernel wherever the grader does not run as root."""
    if not isolation()[0] and os.geteuid() == 0:
        pytest.skip("no kernel isolation here and root ignores RLIMIT_NPROC")
    source = "import threading\ndef grade(sample, item):\n    t = threading.Thread(target=print)\n    t.start()\n    return 1.0\n"
    result = await run(sandbox, source)
    assert (result.reward, result.errors) == (0.0, {"python_grader_runtime_error": 1})
    assert "can't start new thread" in result.error_details["python_grader_runtime_error"]


async def test_kernel_isolation_where_available(sandbox):
    """What the kernel itself enforces, seen from inside: no network interface but loopback, an environment of
    four variables, and (as root) user nobody without capabilities but read-search."""
    prefix, description = isolation()
    if not prefix:
        pytest.skip(f"no kernel isolation on this machine: {description}")
    source = (
        "import os, socket\n"
        "def grade(sample, item):\n"
        "    names = [name for _, name in socket.if_nameindex()]\n"
        "    assert names == ['lo'], names\n"
        "    assert os.getppid() == 0, os.getppid()  # the parent is outside this PID namespace\n"
        "    assert sorted(os.environ) == ['HOME', 'LANG', 'MKL_NUM_THREADS', 'OMP_NUM_THREADS', 'OPENBLAS_NUM_THREADS', 'PATH', 'TMPDIR'], sorted(os.environ)\n"
        "    if item['root']:\n"
        "        assert os.getuid() == item['nobody'], os.getuid()\n"
        "        caps = int(open('/proc/self/status').read().split('CapEff:')[1].split()[0], 16)\n"
        "        assert caps & ~item['allowed_caps'] == 0, hex(caps)\n"
        "    return 1.0\n"
    )
    import pwd

    # CAP_DAC_READ_SEARCH only where Python cannot be made reachable otherwise (see the sandbox's docstring)
    allowed = (1 << 2) if any("dac_read_search" in arg for arg in prefix) else 0
    item = {"root": os.geteuid() == 0, "nobody": pwd.getpwnam("nobody").pw_uid, "allowed_caps": allowed}
    result = await run(sandbox, source, item=item)
    assert (result.reward, result.errors) == (1.0, {}), result.error_details


def test_the_kernel_alone_keeps_private_files_private(tmp_path: Path):
    """Layer 2 without the audit hook (plain ``python -c`` under the isolation prefix): a file only its owner may
    read stays closed, and a directory closed to others on the way to Python shows nothing but that way."""
    prefix, description = isolation()
    if not prefix or os.geteuid() != 0:
        pytest.skip(f"needs kernel isolation as root; here: {description}")
    if any("dac_read_search" in arg for arg in prefix):
        pytest.skip("a Python directory itself is closed to others here, so the grader keeps read-search")
    secret = tmp_path / "secret.txt"
    secret.write_text(SECRET)
    secret.chmod(0o600)
    assert secret.read_text() == SECRET  # readable to us, outside the sandbox
    closed = sorted({d for p in _python_dirs() for d in p.parents if not os.stat(d).st_mode & 0o001})
    code = (
        "import json, os, sys\n"
        "try:\n    open(sys.argv[1]).read(); read = 'read'\n"
        "except PermissionError:\n    read = 'refused'\n"
        "print(json.dumps({'read': read, 'listing': {d: sorted(os.listdir(d)) for d in sys.argv[2:]}}))\n"
    )
    with tempfile.TemporaryDirectory() as stage:
        done = subprocess.run([*prefix, sys.executable, "-I", "-c", code, str(secret), *map(str, closed)],
                              capture_output=True, text=True, timeout=60, env={**os.environ, "TMPDIR": stage})  # fmt: skip
    assert done.returncode == 0, done.stderr
    seen = json.loads(done.stdout)
    assert seen["read"] == "refused"
    for directory, listing in seen["listing"].items():  # only the first step towards each Python directory
        towards = {p.relative_to(directory).parts[0] for p in _python_dirs() if Path(directory) in p.parents}
        assert set(listing) == towards, (directory, listing)


async def test_concurrency_is_limited_and_temporary_directories_removed():
    seen: list[str] = []
    running = peak = 0

    class Watched(PythonSandbox):
        """Observes the real runs: how many overlap, and which temporary directories they used."""

        async def _run(self, prefix, tmpdir, *args):
            nonlocal running, peak
            seen.append(tmpdir)
            running += 1
            peak = max(peak, running)
            try:
                return await super()._run(prefix, tmpdir, *args)
            finally:
                running -= 1

    import asyncio

    watched = Watched(SandboxLimits(timeout_s=30), max_concurrency=2)
    grader = parse_grader(python("def grade(sample, item):\n    open('f', 'w').write('x')\n    return item['n']\n"))
    results = await asyncio.gather(*(grade(grader, "x", {"n": n}, sandbox=watched) for n in range(5)))
    assert [r.reward for r in results] == [0, 1, 2, 3, 4]
    assert peak == 2 and len(set(seen)) == 5
    assert not any(Path(d).exists() for d in seen)


def test_a_grader_runs_under_a_lower_limit_the_parent_inherited():
    """Under ``ulimit -f`` (here a hard RLIMIT_FSIZE of 64 MB, set for real in a process of its own) the sandbox's
    larger default cannot be set: it keeps the inherited limit and the grader grades."""
    script = (
        "import asyncio, resource, sys\n"
        "resource.setrlimit(resource.RLIMIT_FSIZE, (64 << 20, 64 << 20))\n"
        "from flywheel.graders import PythonSandbox, grade, parse_grader\n"
        "spec = {'type': 'python', 'name': 'g', 'source': 'def grade(sample, item):\\n    return 0.75\\n'}\n"
        "result = asyncio.run(grade(parse_grader(spec), 'x', {}, sandbox=PythonSandbox()))\n"
        "print(result.reward, dict(result.errors))\n"
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split("\n")[-2] == "0.75 {}", out.stdout
