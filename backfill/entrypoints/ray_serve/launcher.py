"""`backfill serve --replicas N [--ray-address ADDR]`: Ray up, the engine deployment, the ingress.

Without --ray-address a local Ray instance is started on 127.0.0.1 (no dashboard, no usage
stats, its files in a temporary directory), and stopped on exit: no Ray process outlives the
server. The ingress is served by uvicorn in this process exactly as the single server is
(launcher.serve_app: the same read timeout, access log and SIGTERM drain).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import logging
import os
import shutil
import signal
import tempfile
import time
from collections.abc import Callable

from backfill.entrypoints.openai.launcher import EXIT_HOOKS, api_key_from_args, check_server_args, exit_now, serve_app
from backfill.entrypoints.ray_serve.options import RouterConfig

logger = logging.getLogger(__name__)

APP_NAME = "backfill"
DEPLOYMENT_NAME = "EngineReplica"
# The engine has its own admission control (--max-queue): Ray Serve must not queue or refuse.
MAX_ONGOING_REQUESTS = 100_000
# How often Ray Serve asks each replica for its routing stats and relays them to the router.
# The router polls the replicas' loads itself (router.LOAD_POLL_PERIOD_S), and uses these only
# before its first poll answers: at 0.5 s the relay took the replicas and the controller ~0.5
# CPU-seconds of a 33 s mixed run on 2 replicas (2 cores, Zen 4 EPYC), and 0.5 of every 30 s idle.
ROUTING_STATS_PERIOD_S = 5.0
HEALTH_CHECK_PERIOD_S = 2.0
# The Serve controller's reconcile loop (Ray's default 0.1 s). Every turn polls the GCS: at 0.1 s
# the controller and the GCS took ~2 CPU-seconds of a 33 s run of the mixed workload on 2 replicas
# (2 cores, Zen 4 EPYC), at 0.5 s ~1; start-up and a dead replica's replacement are not slower
# by more than the difference. Only for the local instance: a cluster's controller is its own.
CONTROL_LOOP_INTERVAL_S = 0.5
KILL_WAIT_S = 0.5  # for the local Ray instance's processes to be stopped, or gone once killed
# By import path: Ray Serve imports it in the process that holds the handle (this one).
ROUTER_CLASS = "backfill.entrypoints.ray_serve.router.BackfillRouter"


def run_ray_server(args: argparse.Namespace) -> int:
    config = check_server_args(args)
    if config is None:
        return 2
    try:
        router_config = RouterConfig.from_cli_args(args)
    except ValueError as error:
        logger.error("%s", error)
        return 2
    num_replicas = 1 if args.replicas is None else args.replicas
    if num_replicas < 1:
        logger.error("invalid --replicas: %s", num_replicas)
        return 2
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")  # nothing leaves the machine
    # NOTE: else a Ray call still under way after ray.shutdown() (the router's load poll) would
    # start a new local instance, which nothing would stop.
    os.environ["RAY_ENABLE_AUTO_CONNECT"] = "0"
    local = args.ray_address is None
    temp_dir = None
    if local:
        # NOTE: else Ray binds its local instance to the machine's address, not to 127.0.0.1.
        os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
        temp_dir = tempfile.mkdtemp(prefix="backfill-ray-")
        os.environ["RAY_TMPDIR"] = temp_dir  # for every Ray process: nothing lands in /tmp/ray
        # NOTE: and their own temporary files (a replica's engine core's socket folder) in it too:
        # the instance is stopped with SIGKILL, which leaves them no chance to remove them.
        os.environ["TMPDIR"] = temp_dir
        os.environ.setdefault("RAY_SERVE_CONTROL_LOOP_INTERVAL_S", str(CONTROL_LOOP_INTERVAL_S))
        # However the process ends (the drain's deadline included), the local instance goes too.
        EXIT_HOOKS.append(functools.partial(_remove_local_ray, temp_dir))
    import ray

    num_threads = config.num_threads or 1
    status, drained = 1, False
    try:
        if local:
            ray.init(_node_ip_address="127.0.0.1", include_dashboard=False, _temp_dir=temp_dir,
                     num_cpus=max(os.cpu_count() or 1, num_replicas * num_threads), logging_level=logging.WARNING)
        else:
            ray.init(address=args.ray_address, logging_level=logging.WARNING)
        status, drained = _serve(args, router_config, num_replicas, num_threads)
    except (ConnectionError, RuntimeError) as error:  # no cluster there, or the replicas failed to start
        logger.error("%s", error)
    finally:
        if temp_dir is not None:
            _remove_local_ray(temp_dir)
        else:
            _leave_cluster()
    if drained or local:
        # NOTE: not a return: Ray's own exit handler would call ray.shutdown(), which waits
        # seconds on the daemons just killed.
        exit_now(status)
    return status


def _leave_cluster() -> None:
    """Remove our replicas from the cluster we joined, and disconnect."""
    import ray
    from ray import serve

    with contextlib.suppress(Exception):
        serve.delete(APP_NAME)
    with contextlib.suppress(Exception):
        ray.shutdown()


def _remove_local_ray(temp_dir: str) -> None:
    """Stop the local Ray instance: every process this server started (the Ray daemons, the
    replicas, their engine cores) is stopped (SIGSTOP), the temporary directory removed, then
    they are killed (SIGKILL).

    NOTE: in this order on purpose. This process's Ray client ends the process on the spot
    when it sees the raylet die (exit status 1, and whatever was left to do undone: the
    directory stayed behind now and then); a process stopped first writes no more files, and a
    stopped raylet keeps its socket open. ray.shutdown() first is no better: the Serve handle's
    threads still call into Ray and end the process too (status 1, or a segfault).
    """
    pids: list[int] = []
    while new := [pid for pid in _descendants(os.getpid()) if pid not in pids]:  # a stopped process forks no more
        _signal_all(new, signal.SIGSTOP, _is_running)
        pids += new
    shutil.rmtree(temp_dir, ignore_errors=True)
    _signal_all(pids, signal.SIGKILL, _is_alive)


def _signal_all(pids: list[int], sig: signal.Signals, pending: Callable[[int], bool]) -> None:
    """Send `sig` to `pids`, then wait (KILL_WAIT_S at most) until `pending` is false for all."""
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, sig)
    deadline = time.monotonic() + KILL_WAIT_S
    while any(map(pending, pids)) and time.monotonic() < deadline:
        time.sleep(0.005)


def _state(pid: int) -> str:
    """The process's state letter (R, S, D, T, Z, ...), or "" when it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return ""


def _is_running(pid: int) -> bool:
    """Neither stopped nor dead (a zombie, a dead child not yet reaped, does nothing more)."""
    return _state(pid) not in ("", "T", "t", "Z", "X")


def _is_alive(pid: int) -> bool:
    return _state(pid) not in ("", "Z", "X")


def _descendants(pid: int) -> list[int]:
    """Every live process under `pid`, from /proc (Linux)."""
    parents: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    parent = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
            parents.setdefault(parent, []).append(int(entry))
    found, frontier = [], [pid]
    while frontier:
        children = parents.get(frontier.pop(), [])
        found += children
        frontier += children
    return found


def _serve(args: argparse.Namespace, router_config: RouterConfig, num_replicas: int,
           num_threads: int) -> tuple[int, bool]:
    import ray
    from ray import serve
    from ray.serve.config import RequestRouterConfig

    from backfill.entrypoints.ray_serve.engine_replica import EngineReplica
    from backfill.entrypoints.ray_serve.ingress import build_ingress

    serve.start(proxy_location="Disabled")  # the ingress below is the only HTTP server
    deployment = serve.deployment(
        EngineReplica, name=DEPLOYMENT_NAME, num_replicas=num_replicas, max_ongoing_requests=MAX_ONGOING_REQUESTS,
        max_queued_requests=-1, ray_actor_options={"num_cpus": num_threads},
        health_check_period_s=HEALTH_CHECK_PERIOD_S, graceful_shutdown_timeout_s=args.shutdown_timeout,
        # NOTE: the ingress logs requests as the single server does (--access-log); Ray Serve's
        # own line per call in every replica (relayed to this process's stdout) would log each
        # one regardless, and each mux and metrics call besides.
        logging_config={"enable_access_log": False},
        request_router_config=RequestRouterConfig(
            request_router_class=ROUTER_CLASS, request_router_kwargs=dataclasses.asdict(router_config),
            request_routing_stats_period_s=ROUTING_STATS_PERIOD_S))
    server_args = {k: v for k, v in vars(args).items() if k not in ("func",)}
    handle = serve.run(deployment.bind(server_args), name=APP_NAME, route_prefix=None)
    # The replicas send their streamed events to a socket of this process, on this node's address in Ray.
    app = build_ingress(handle, f"SERVE_REPLICA::{APP_NAME}#{DEPLOYMENT_NAME}#", api_key=api_key_from_args(args),
                        shutdown_timeout=args.shutdown_timeout, mux_host=ray.util.get_node_ip_address())
    logger.info("serving %s on %d replicas (router: %s) on http://%s:%d", args.model or "the default model",
                num_replicas, router_config.policy, args.host, args.port)
    return serve_app(app, args, app.state.drain)
