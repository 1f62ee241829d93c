"""Starting real server processes, and reading their /metrics, for the HTTP tests."""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

import httpx

API_KEY = "sk-backfill-test"
MODEL = "SmolLM2-135M-Instruct"
STARTUP_TIMEOUT_S = 180.0
# Small KV pools keep three float32 servers' memory modest; they still hold 64 short requests.
# One torch thread: on a small shared machine, two threads that wait on each other's barrier
# while other processes hold the cores run several times slower than one.
NUM_KV_BLOCKS = 768
NUM_THREADS = 1
COMMON_ARGS = ["--dtype", "float32", "--num-kv-blocks", str(NUM_KV_BLOCKS), "--num-threads", str(NUM_THREADS)]


@dataclass
class ServerProcess:
    process: subprocess.Popen[bytes]
    base_url: str
    log_path: str

    @property
    def v1(self) -> str:
        return self.base_url + "/v1"

    def log(self) -> str:
        with open(self.log_path, errors="replace") as f:
            return f.read()

    def metrics(self) -> dict[str, float]:
        """The /metrics samples, as 'name{labels}' -> value (the model_name label dropped)."""
        text = httpx.get(self.base_url + "/metrics", timeout=10).text
        samples: dict[str, float] = {}
        for line in text.splitlines():
            if not line or line.startswith("#"):
                continue
            key, value = line.rsplit(" ", 1)
            key = re.sub(r'model_name="[^"]*",?', "", key).replace("{}", "").replace(",}", "}")
            samples[key] = float(value)
        return samples

    def core_pids(self) -> list[int]:
        """The server's engine core process (among its live children: multiprocessing's
        resource tracker is one too)."""
        return [pid for pid in child_pids(self.process.pid) if b"spawn_main" in cmdline(pid)]

    def stop(self) -> None:
        children = child_pids(self.process.pid)
        # SIGKILL leaves the engine cores' socket folders (a drained server removes them): found
        # now, removed once the processes are gone, so the suite leaves nothing in /tmp
        folders = {os.path.dirname(path) for path in bound_socket_paths([self.process.pid, *children])
                   if os.path.basename(os.path.dirname(path)).startswith("backfill-core-")}
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait(timeout=30)
        for pid in children:  # they die with the server anyway (the core watches its parent)
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        for folder in folders:
            shutil.rmtree(folder, ignore_errors=True)


def descendant_pids(pid: int) -> list[int]:
    """Every live process under `pid` (children, theirs, ...)."""
    found, frontier = [], [pid]
    while frontier:
        children = child_pids(frontier.pop())
        found += children
        frontier += children
    return found


def child_pids(pid: int) -> list[int]:
    """The live (not zombie) processes whose parent is `pid`, from /proc."""
    children = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                state, parent = f.read().rsplit(")", 1)[1].split()[:2]
        except (OSError, ValueError):
            continue
        if int(parent) == pid and state != "Z":
            children.append(int(entry))
    return children


def cmdline(pid: int) -> bytes:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read()
    except OSError:
        return b""


def bound_socket_paths(pids: list[int]) -> set[str]:
    """The file-system paths of the Unix sockets these processes hold open (bound or listening),
    from /proc/net/unix and each process's descriptors."""
    inodes = set()
    for pid in pids:
        with contextlib.suppress(OSError):
            for fd in os.listdir(f"/proc/{pid}/fd"):
                with contextlib.suppress(OSError):
                    target = os.readlink(f"/proc/{pid}/fd/{fd}")
                    if target.startswith("socket:["):
                        inodes.add(target[len("socket:["):-1])
    paths = set()
    with open("/proc/net/unix") as f:
        next(f)  # Num RefCount Protocol Flags Type St Inode Path
        for line in f:
            fields = line.split()
            if len(fields) >= 8 and fields[6] in inodes and fields[7].startswith("/"):
                paths.add(fields[7])
    return paths


def is_alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def start_server(*args: str, env: dict[str, str] | None = None, cli: bool = False,
                 common_args: list[str] | None = None, startup_timeout: float = STARTUP_TIMEOUT_S) -> ServerProcess:
    """Start the server on a free port and wait for /health.

    By default `python -m backfill.entrypoints.openai.api_server` with COMMON_ARGS; `cli=True`
    runs the installed `backfill serve` command instead.
    """
    port = _free_port()
    log = tempfile.NamedTemporaryFile(prefix="backfill-server-", suffix=".log", delete=False)
    if cli:
        entry = [os.path.join(os.path.dirname(sys.executable), "backfill"), "serve"]
    else:
        entry = [sys.executable, "-m", "backfill.entrypoints.openai.api_server"]
    common = COMMON_ARGS if common_args is None else common_args
    command = [*entry, "--host", "127.0.0.1", "--port", str(port), *common, *args]
    process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT,
                               env={**os.environ, **(env or {})})
    server = ServerProcess(process, f"http://127.0.0.1:{port}", log.name)
    deadline = time.monotonic() + startup_timeout
    try:
        while time.monotonic() < deadline:
            if process.poll() is not None:
                raise RuntimeError(f"server exited with {process.returncode}:\n{server.log()[-4000:]}")
            try:
                if httpx.get(server.base_url + "/health", timeout=2).status_code == 200:
                    return server
            except httpx.TransportError:
                pass
            time.sleep(0.25)
        raise RuntimeError(f"server not healthy after {startup_timeout} s:\n{server.log()[-4000:]}")
    except BaseException:
        server.stop()
        raise


def wait_until(predicate: object, timeout: float, interval: float = 0.05) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():  # type: ignore[operator]
            return True
        time.sleep(interval)
    return bool(predicate())  # type: ignore[operator]


def engine_idle(server: ServerProcess) -> bool:
    samples = server.metrics()
    return (samples["backfill:num_requests_running"] == 0 and samples["backfill:num_requests_waiting"] == 0
            and samples["backfill:kv_cache_usage_perc"] == 0)

