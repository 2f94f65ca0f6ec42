"""A real ``octavo serve`` process on 127.0.0.1 for the OpenAI-server tests.

``ServerProcess`` starts ``python -m octavo.cli.main serve`` on the tiny Llama checkpoint on a
free port, waits for ``/health``, and on ``stop()`` checks that it exited and left no process
behind. The session-wide ``server`` is shared by most tests; lifecycle tests start their own.
Expected outputs come from the offline ``octavo.LLM`` on the same folder (``offline_llm``).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.helpers.engine import make_llm

API_KEY = "test-key-123"
SERVED_NAME = "tiny"
# Small enough that a test can exceed it cheaply, large enough for every normal request.
MAX_BODY_BYTES = 200_000
NUM_BLOCKS = 256


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def descendants(pid: int) -> list[int]:
    """Pids of every live descendant of ``pid`` (from /proc)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[1].split()
        if fields[0] == "Z":
            continue
        children.setdefault(int(fields[1]), []).append(int(entry))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def pid_alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


class ServerProcess:
    """One ``octavo serve`` subprocess."""

    def __init__(self, model: Path, *extra_args: str, api_key: str | None = API_KEY,
                 env: dict[str, str] | None = None) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.api_key = api_key
        self.log = tempfile.NamedTemporaryFile("w+", prefix="octavo-serve-", suffix=".log", delete=False)
        args = [
            sys.executable, "-m", "octavo.cli.main", "serve", str(model),
            "--port", str(self.port), "--dtype", "float32",
            "--num-gpu-blocks-override", str(NUM_BLOCKS), "--served-model-name", SERVED_NAME, str(model),
            *extra_args,
        ]
        if api_key is not None:
            args += ["--api-key", api_key]
        self.proc = subprocess.Popen(args, stdout=self.log, stderr=subprocess.STDOUT,
                                     env={**os.environ, **(env or {})})
        self.descendant_pids: list[int] = []
        try:
            self.wait_healthy()
        except BaseException:
            self.kill()
            raise

    def wait_healthy(self, timeout_s: float = 120.0) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.read_log()}")
            try:
                if httpx.get(f"{self.url}/health", timeout=1.0).status_code == 200:
                    self.descendant_pids = descendants(self.proc.pid)
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise TimeoutError(f"server not healthy after {timeout_s} s:\n{self.read_log()}")

    @property
    def engine_core_pid(self) -> int:
        """Pid of the engine-core process (the spawned child that is not the resource tracker)."""
        for pid in descendants(self.proc.pid):
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if b"spawn_main" in f.read():
                    return pid
        raise AssertionError("no engine-core process found")

    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def read_log(self) -> str:
        return Path(self.log.name).read_text(errors="replace")

    def wait_exit(self, timeout_s: float) -> int:
        code = self.proc.wait(timeout_s)
        self.assert_no_orphans()
        return code

    def assert_no_orphans(self, timeout_s: float = 10.0) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            alive = [pid for pid in self.descendant_pids if pid_alive(pid)]
            if not alive:
                return
            time.sleep(0.1)
        raise AssertionError(f"processes left behind by the server: {alive}")

    def stop(self, sig: int = signal.SIGTERM) -> int:
        """Send ``sig``, wait for the exit, check nothing is left behind; return the exit code."""
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        try:
            return self.wait_exit(60)
        finally:
            self.kill()

    def kill(self) -> None:
        """Last resort: kill the server and whatever it started."""
        for pid in [self.proc.pid, *self.descendant_pids]:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.proc.wait(10)
        self.log.close()
        os.unlink(self.log.name)


@pytest.fixture(scope="session")
def tiny_model(tiny_llama: Path) -> Path:
    return tiny_llama


@pytest.fixture(scope="session")
def long_context_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny Llama with an 8,192-token context, for tests that need a request still running
    a while later: with the default tiny model's 512 positions a request ends within ~0.15 s
    on two cores (~0.3 ms a token); 4,000 tokens (what the test servers' 256 KV blocks of 16
    hold) take over a second."""
    from octavo.testing.tiny_models import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("tiny-llama-8k"), "llama",
                           max_position_embeddings=8192)


@pytest.fixture(scope="session")
def server(tiny_model: Path):
    """The shared server: API key, body limit, two served names, and async scheduling (the
    GPU backends' default; off by default on the CPU), so every server test also checks the
    pipelined engine core against the offline engine, which runs one step at a time."""
    srv = ServerProcess(tiny_model, "--max-request-body-bytes", str(MAX_BODY_BYTES),
                        "--async-scheduling")
    try:
        yield srv
    finally:
        code = srv.stop(signal.SIGINT)  # Ctrl-C: a clean exit too (the lifecycle tests use SIGTERM)
        assert code == 0, f"server exited with {code}"


@pytest.fixture(scope="session")
def offline_llm(tiny_model: Path):
    """The offline engine on the same folder, for expected outputs."""
    llm = make_llm(tiny_model, num_gpu_blocks_override=NUM_BLOCKS)
    yield llm
    llm.llm_engine.shutdown()


@pytest.fixture
def client(server: ServerProcess):
    import openai

    with openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0, timeout=120) as c:
        yield c


@pytest.fixture
def async_client(server: ServerProcess):
    import openai

    return openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0, timeout=120)


@pytest.fixture
def http(server: ServerProcess):
    """An httpx client with the API key."""
    with httpx.Client(base_url=server.url, headers=server.headers(), timeout=60) as c:
        yield c


def metrics(server: ServerProcess) -> dict[str, float]:
    """Every sample of /metrics as {'name{label="v",...}': value} (parsed by prometheus_client)."""
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(f"{server.url}/metrics", timeout=10).text
    samples: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = ",".join(f'{k}="{v}"' for k, v in sorted(sample.labels.items()) if k != "model_name")
            samples[f"{sample.name}{{{labels}}}" if labels else sample.name] = sample.value
    return samples


def wait_idle(server: ServerProcess, timeout_s: float = 20.0) -> dict[str, float]:
    """Wait until no request runs or waits and every KV block is free; return the metrics."""
    deadline = time.monotonic() + timeout_s
    while True:
        m = metrics(server)
        idle = (m["octavo:num_requests_running"] == 0 and m["octavo:num_requests_waiting"] == 0
                and m["octavo:kv_cache_usage_perc"] == 0)
        if idle or time.monotonic() > deadline:
            return m
        time.sleep(0.05)


def greedy_kwargs(max_tokens: int = 12) -> dict[str, Any]:
    """Greedy request fields that make exactly ``max_tokens`` tokens (EOS ignored)."""
    return {"temperature": 0.0, "max_tokens": max_tokens, "extra_body": {"ignore_eos": True}}
