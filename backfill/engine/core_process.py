"""The engine core in a process of its own: its busy loop (child side) and its handle (parent side).

```
front end (event loop)                                  core process (main thread)
  CoreProcess.send(CoreInputs) ── PUSH ─ipc─▶ PULL ──▶  apply adds, then aborts
                                                        step() while work remains
  FD reader   ◀── CoreInfo | CoreOutputs | CoreFailed ── PUSH ◀──┘ one message per turn
  loop.add_reader(sentinel) ◀── the process ended
```

Why a process: a step is hundreds of small Python and torch calls, and the front end's HTTP,
JSON and detokenizing competed with them for the GIL when the core ran on a thread. Messages
are msgpack (msgspec) over ZMQ `ipc://` sockets in a private temporary folder.

Life and death: the core ignores SIGINT/SIGTERM (a terminal's Ctrl-C or a process-group kill
reaches it too; the front end drains first, then tells it to stop) and dies with its parent:
the kernel sends it SIGKILL when the parent exits (PR_SET_PDEATHSIG, Linux), and its loop checks
its parent's pid at every turn and every `IDLE_POLL_MS` when idle (every platform). An error in
loading or stepping is sent as `CoreFailed` before the process exits with status 1; any other end
(`kill -9`, the OOM killer) the front end sees on the process's sentinel.
"""

from __future__ import annotations

import asyncio
import ctypes
import logging
import multiprocessing
import os
import shutil
import signal
import socket
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any, Protocol

import msgspec
import zmq

from backfill.config import ConfigError, EngineConfig
from backfill.core.outputs import StepStats
from backfill.engine.messages import (CoreFailed, CoreInfo, CoreInputs, CoreLoad, CoreMessage, CoreOutputs,
                                      EngineCoreOutput, EngineCoreRequest)

logger = logging.getLogger(__name__)

IDLE_POLL_MS = 500  # an idle core wakes this often to check that its parent lives
STOP_TIMEOUT_S = 10.0  # after a shutdown message, how long the core gets to exit before SIGKILL
_PR_SET_PDEATHSIG = 1


class CoreLike(Protocol):
    """What the loop needs from an `EngineCore` (a fake with these members serves tests)."""

    info: CoreInfo

    def add_request(self, request: EngineCoreRequest) -> None: ...
    def abort(self, request_ids: list[str]) -> None: ...
    def has_unfinished_requests(self) -> bool: ...
    def step(self) -> tuple[list[EngineCoreOutput], StepStats]: ...
    def load(self) -> CoreLoad: ...


class CoreStartError(RuntimeError):
    """The core process failed to load (the message says why) or died while loading."""


def make_engine_core(config: EngineConfig) -> CoreLike:
    """The real core (`functools.partial(make_engine_core, config)` is a factory for
    `CoreProcess`); torch is imported in the core process only."""
    from backfill.engine.core import EngineCore

    core = EngineCore(config)
    core.structured_output.warm_up()  # the grammar engine's tokenizer, before the core says it is ready
    return core


# ---- child side ------------------------------------------------------------------------------


def _die_with_parent(parent_pid: int) -> None:
    if sys.platform.startswith("linux"):
        try:
            ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
        except (OSError, AttributeError):  # no prctl: the loop's pid checks remain
            pass
    if os.getppid() != parent_pid:  # the parent died before prctl took effect
        os._exit(1)


def run_core_process(factory: Callable[[], CoreLike], input_address: str, output_address: str,
                     parent_pid: int, log_level: int) -> None:
    """The core process's entry point: build the core, say so, then serve until told to stop."""
    _die_with_parent(parent_pid)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    logging.basicConfig(level=log_level, format="%(asctime)s %(levelname)s %(name)s [core]: %(message)s")
    context = zmq.Context()
    inputs = context.socket(zmq.PULL)
    inputs.connect(input_address)
    outputs = context.socket(zmq.PUSH)
    outputs.setsockopt(zmq.SNDHWM, 0)  # never block a step on a slow reader
    outputs.connect(output_address)
    encoder = msgspec.msgpack.Encoder()
    status = 0
    try:
        core = factory()
        outputs.send(encoder.encode(core.info))
        _serve(core, inputs, outputs, encoder, parent_pid)
    except BaseException as error:  # noqa: BLE001 - reported to the front end, then exit 1
        if isinstance(error, ConfigError):
            logger.error("engine core failed: %s", error)
        else:
            logger.exception("engine core failed")
        outputs.send(encoder.encode(CoreFailed(f"{type(error).__name__}: {error}")))
        status = 1
    finally:
        inputs.close(linger=0)
        outputs.close(linger=5000)  # the last message goes out before the process ends
        context.term()
    os._exit(status)  # NOTE: no interpreter teardown of the model: nothing of it needs doing


def _serve(core: CoreLike, inputs: zmq.Socket, outputs: zmq.Socket, encoder: msgspec.msgpack.Encoder,
           parent_pid: int) -> None:
    """The busy loop: apply what arrived, step while there is work, send one message per turn."""
    decoder = msgspec.msgpack.Decoder(CoreInputs)
    poller = zmq.Poller()
    poller.register(inputs, zmq.POLLIN)
    while True:
        # Sleep in poll() only when idle; with work, just look for inputs and step.
        if not core.has_unfinished_requests() and not poller.poll(IDLE_POLL_MS) and os.getppid() == parent_pid:
            continue
        if os.getppid() != parent_pid:
            logger.warning("the front end is gone: the core exits")
            return
        applied = stop = False
        num_added = 0
        refused: list[tuple[str, str]] = []
        while True:
            try:
                frame = inputs.recv(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                break
            message = decoder.decode(frame.buffer)
            applied = True
            for request in message.add:
                num_added += 1
                try:
                    core.add_request(request)
                except Exception as error:  # a defect hit by one request must not stop the core
                    logger.exception("engine core refused request %s", request.request_id)
                    refused.append((request.request_id, f"{type(error).__name__}: {error}"))
            # Aborts after adds: an abort may target a request added by the same message.
            if message.abort:
                core.abort(message.abort)
            stop = stop or message.shutdown
        if stop:
            return
        step_outputs: list[EngineCoreOutput] = []
        stats = None
        if core.has_unfinished_requests():
            step_outputs, stats = core.step()
        if applied or stats is not None:
            outputs.send(encoder.encode(CoreOutputs(step_outputs, stats, core.load(), num_added, refused)),
                         copy=False)


# ---- parent side -----------------------------------------------------------------------------



def receive_ready(socket: zmq.Socket[Any], on_frame: Callable[[memoryview], None], what: str) -> None:
    """Hand every message ready on `socket` to `on_frame`, for a reader of its FD on an event loop.

    NOTE: a ZMQ socket's FD is edge-triggered: every message ready must be taken, or the next one
    would not wake the loop. A plain callback, not zmq.asyncio's futures: those cost ~85 us of CPU
    more per message, taken from the engine's cores once per step. An exception from one message
    is logged (`what` names it) and the others are still taken.
    """
    while True:
        try:
            frame = socket.recv(zmq.NOBLOCK, copy=False)
        except zmq.Again:
            return
        try:
            on_frame(frame.buffer)
        except Exception:  # noqa: BLE001 - one bad message must not stop the reading
            logger.exception("failed to handle %s", what)

# The sockets' folder: FOLDER_PREFIX + the front end's pid + "-" + a random suffix (mode 0700).
FOLDER_PREFIX = "backfill-core-"


def remove_stale_folders() -> None:
    """Remove the socket folders of front ends that are gone: one killed with SIGKILL had no
    chance to remove its own. Only this user's, only those whose pid is not running (a folder
    whose pid was reused stays until that process ends), and only those whose sockets nothing
    listens on (a /tmp shared with another pid namespace shows a live front end's pid as gone)."""
    root = tempfile.gettempdir()
    try:
        names = os.listdir(root)
    except OSError:
        return
    for name in names:
        pid, sep, _ = name.removeprefix(FOLDER_PREFIX).partition("-")
        if not name.startswith(FOLDER_PREFIX) or not sep or not pid.isdigit() or int(pid) in (0, os.getpid()):
            continue
        path = os.path.join(root, name)
        try:
            if os.lstat(path).st_uid != os.getuid():
                continue
            os.kill(int(pid), 0)
        except ProcessLookupError:
            if not _listened_on(os.path.join(path, "outputs")):
                shutil.rmtree(path, ignore_errors=True)
        except (OSError, OverflowError):  # gone already, or a running process of another user
            continue


def _listened_on(path: str) -> bool:
    """Whether a process listens on the Unix socket at `path` (its file alone is no proof)."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
        probe.settimeout(1.0)
        try:
            probe.connect(path)
        except OSError:  # refused (no listener), or no such file
            return False
    return True


class CoreProcess:
    """The front end's handle on a core process.

    `start()` (blocking: the model loads; or `launch()`, then `wait_ready()`) returns the core's
    `CoreInfo`; call it from the main thread, whose exit is what PR_SET_PDEATHSIG watches. Then
    `attach()` on the event loop that consumes the outputs. `send()` never blocks. `shutdown()` stops the core; `kill()` is the
    last resort of every exit path.
    """

    def __init__(self, factory: Callable[[], CoreLike], log_level: int | None = None) -> None:
        self._factory = factory
        self._log_level = logging.getLogger().getEffectiveLevel() if log_level is None else log_level
        remove_stale_folders()
        self._folder = tempfile.mkdtemp(prefix=f"{FOLDER_PREFIX}{os.getpid()}-")
        self._context = zmq.Context()
        self._inputs = self._context.socket(zmq.PUSH)
        self._inputs.setsockopt(zmq.SNDHWM, 0)
        self._inputs.bind(f"ipc://{self._folder}/inputs")
        self._outputs = self._context.socket(zmq.PULL)
        self._outputs.bind(f"ipc://{self._folder}/outputs")
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder(CoreMessage)
        self.process: multiprocessing.process.BaseProcess | None = None
        self._reader_fd: int | None = None  # the outputs socket's FD, once attached
        self._loop: asyncio.AbstractEventLoop | None = None
        self.stopping = False

    @property
    def pid(self) -> int | None:
        return self.process.pid if self.process is not None else None

    def start(self, timeout: float | None = None) -> CoreInfo:
        """Start the process and wait until its core is built. Raises `CoreStartError`."""
        self.launch()
        return self.wait_ready(timeout)

    def launch(self) -> None:
        """Start the process; the core builds itself while the caller does something else."""
        context = multiprocessing.get_context("spawn")
        self.process = context.Process(
            target=run_core_process, name="backfill-core", daemon=True,
            args=(self._factory, self._inputs.getsockopt_string(zmq.LAST_ENDPOINT),
                  self._outputs.getsockopt_string(zmq.LAST_ENDPOINT), os.getpid(), self._log_level))
        self.process.start()

    def wait_ready(self, timeout: float | None = None) -> CoreInfo:
        """Wait until the launched core is built; its `CoreInfo`. Raises `CoreStartError` (and
        kills the process) if it failed, died or took longer than `timeout` seconds."""
        assert self.process is not None, "launch() first"
        deadline = None if timeout is None else time.monotonic() + timeout
        try:
            while not self._outputs.poll(100):
                if not self.process.is_alive():
                    raise CoreStartError(f"the engine core process exited with status {self.process.exitcode} "
                                         "while loading")
                if deadline is not None and time.monotonic() > deadline:
                    raise CoreStartError(f"the engine core did not load within {timeout} s")
            message = self._decoder.decode(self._outputs.recv())
            if isinstance(message, CoreFailed):
                raise CoreStartError(f"the engine core failed to load: {message.error}")
            assert isinstance(message, CoreInfo), message
            return message
        except BaseException:
            self.kill()
            raise

    def attach(self, on_outputs: Callable[[CoreOutputs], None], on_death: Callable[[str], None]) -> None:
        """Deliver the core's messages on the running loop; `on_death(why)` once if it dies
        (not after `shutdown()`)."""
        assert self.process is not None and self._reader_fd is None
        self._loop = asyncio.get_running_loop()
        died = False

        def dead(why: str) -> None:
            nonlocal died
            if not died and not self.stopping:
                died = True
                on_death(why)

        def on_frame(buffer: memoryview) -> None:
            message = self._decoder.decode(buffer)
            if isinstance(message, CoreFailed):
                dead(message.error)
            elif isinstance(message, CoreOutputs):
                on_outputs(message)

        def readable() -> None:
            receive_ready(self._outputs, on_frame, "a message from the engine core")

        def exited() -> None:
            assert self._loop is not None and self.process is not None
            self._loop.remove_reader(self.process.sentinel)
            self.process.join(1.0)  # readable sentinel: the process has ended, reap it
            dead(f"the engine core process exited (status {self.process.exitcode})")

        self._reader_fd = self._outputs.getsockopt(zmq.FD)
        self._loop.add_reader(self._reader_fd, readable)
        self._loop.add_reader(self.process.sentinel, exited)
        readable()  # what arrived before: its edge has passed

    def send(self, message: CoreInputs) -> bool:
        """Queue a message for the core; False (dropped) if the core is gone.

        NOTE: never blocks. With no high-water mark a PUSH socket only blocks when no peer is
        connected, i.e. when the core has died (its death is reported through the sentinel) or
        is dying: a blocking send would then hang the event loop for good.
        """
        try:
            self._inputs.send(self._encoder.encode(message), zmq.NOBLOCK, copy=False)
        except zmq.Again:
            logger.warning("the engine core is gone: a message to it was dropped")
            return False
        return True

    async def shutdown(self, timeout: float = STOP_TIMEOUT_S) -> None:
        """Tell the core to stop, wait for it (SIGKILL after `timeout` s), release everything."""
        self.stopping = True
        if self.process is not None and self.process.is_alive():
            if self.send(CoreInputs(shutdown=True)):
                await asyncio.to_thread(self.process.join, timeout)
        self.close()

    def kill(self) -> None:
        """End the core now, whatever it is doing (idempotent)."""
        self.stopping = True
        process = self.process
        if process is not None and process.is_alive():
            process.kill()
            process.join(5)

    def close(self) -> None:
        """Kill the core if it still runs, and release the sockets and their folder."""
        self.kill()
        if self._loop is not None:
            for fd in (self.process.sentinel if self.process is not None else None, self._reader_fd):
                if fd is None:
                    continue
                try:
                    self._loop.remove_reader(fd)
                except (RuntimeError, ValueError, OSError):  # the loop is closed already
                    pass
            self._reader_fd = None
        self._inputs.close(linger=0)
        self._outputs.close(linger=0)
        self._context.term()
        shutil.rmtree(self._folder, ignore_errors=True)

    def __del__(self) -> None:
        process: Any = getattr(self, "process", None)
        if process is not None and process.is_alive():
            process.kill()
