"""Issue 13: `backfill serve --replicas 2` on Ray Serve (a local Ray instance on 127.0.0.1).

The official-client tests of test_openai_client.py and the bad-request tests of
test_bad_requests.py run again here, against two replicas behind the ingress (imported below: the
module's `server` fixture replaces the single server). Then what is
Ray's own: per-replica metrics and the router's decisions, prefix affinity, a saturated replica
passed over, SIGTERM draining both replicas with no Ray process left; and, on a server of its own
(round-robin routing), a replica killed mid-run.
"""

from __future__ import annotations

import asyncio
import contextlib
import glob
import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator

import httpx
import openai
import pytest

from tests.server.harness import (API_KEY, MODEL, ServerProcess, bound_socket_paths, cmdline, descendant_pids, is_alive,
                                  start_server, wait_until)
from tests.server.test_bad_requests import (test_a_body_of_countless_tiny_arrays_is_refused_before_parsing,  # noqa: F401
                                            test_bad_request, test_context_errors_have_the_openai_code,
                                            test_harmless_unknown_fields_are_ignored,
                                            test_oversized_body_is_refused_before_parsing)
from tests.server.test_openai_client import *  # noqa: F401,F403  (the official-client tests, run here too)

RAY_STARTUP_TIMEOUT_S = 600.0  # Ray, then two engines loading side by side on a small machine
RESTART_TIMEOUT_S = 600.0
GRACE_S = 30
BLOCK_SIZE = 16
EXIT_BOUND_S = 3.0  # the server guarantees 1 s past the grace period; the rest is for a loaded machine
HEADERS = {"Authorization": f"Bearer {API_KEY}"}
# Longer than a few of the router's 32-character blocks, so that it is matched as a prefix.
SATURATE_PROMPT = "Saturate: once upon a time, in a kingdom by the sea, there lived a king who had twelve daughters"


def stop_ray_server(server: ServerProcess) -> None:
    """SIGTERM, then SIGKILL for whatever of the server and its Ray processes is left."""
    processes = [server.process.pid, *descendant_pids(server.process.pid)]
    if server.process.poll() is None:
        server.process.send_signal(signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            server.process.wait(timeout=GRACE_S + 30)
    for pid in processes:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    server.process.wait(timeout=30)


@pytest.fixture(scope="module")
def server() -> Iterator[ServerProcess]:
    process = start_server("--replicas", "2", "--api-key", API_KEY, "--max-num-seqs", "32",
                           "--shutdown-timeout", str(GRACE_S), cli=True, startup_timeout=RAY_STARTUP_TIMEOUT_S)
    try:
        yield process
    finally:
        stop_ray_server(process)


def router_decisions(server: ServerProcess) -> dict[tuple[str, str], float]:
    """backfill:router_requests_total as (reason, replica) -> count."""
    decisions = {}
    for key, value in server.metrics().items():
        if key.startswith("backfill:router_requests_total{"):
            labels = dict(part.split("=", 1) for part in key[key.index("{") + 1:-1].split(","))
            decisions[(labels["reason"].strip('"'), labels["replica"].strip('"'))] = value
    return decisions


def replica_labels(server: ServerProcess) -> set[str]:
    return {key.split('replica="', 1)[1].split('"', 1)[0] for key in server.metrics()
            if key.startswith("backfill:num_requests_running{")}


def delta(after: dict[tuple[str, str], float], before: dict[tuple[str, str], float]) -> dict[tuple[str, str], float]:
    return {key: value - before.get(key, 0.0) for key, value in after.items() if value != before.get(key, 0.0)}


def test_single_process_server_does_not_import_ray() -> None:
    code = ("import sys\n"
            "from backfill.entrypoints.cli import _build_parser\n"
            "import backfill.entrypoints.openai.api_server, backfill.entrypoints.openai.launcher\n"
            "_build_parser().parse_args(['serve', '--port', '1'])\n"
            "assert not [m for m in sys.modules if m == 'ray' or m.startswith('ray.')], 'ray imported'\n")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_official_client_errors_through_the_ingress(server: ServerProcess) -> None:
    client = openai.OpenAI(base_url=server.v1, api_key=API_KEY, max_retries=0, timeout=60)
    with pytest.raises(openai.BadRequestError) as bad:
        client.completions.create(model=MODEL, prompt="Hi", max_tokens=0)
    assert bad.value.param == "max_tokens"
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="no-such-model", messages=[{"role": "user", "content": "Hi"}])
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=server.v1, api_key="wrong", max_retries=0).models.list()


def test_metrics_label_each_replica_and_count_the_routers_decisions(server: ServerProcess) -> None:
    assert len(replica_labels(server)) == 2
    before = router_decisions(server)
    client = openai.OpenAI(base_url=server.v1, api_key=API_KEY, max_retries=0, timeout=120)
    for word in ("alpha", "beta", "gamma"):
        client.completions.create(model=MODEL, prompt=f"Metrics test {word}:", max_tokens=1)
    changed = delta(router_decisions(server), before)
    assert sum(changed.values()) == 3
    assert {reason for reason, _ in changed} <= {"prefix", "smallest_tree", "least_loaded"}
    assert {replica for _, replica in changed} <= replica_labels(server)


def test_requests_sharing_a_system_prompt_go_where_it_is_cached(server: ServerProcess) -> None:
    """8 system prompts x 4 requests, shuffled, one at a time (so the load stays balanced): every
    request after the first of its system prompt finds that prompt in its replica's cache."""
    client = openai.OpenAI(base_url=server.v1, api_key=API_KEY, max_retries=0, timeout=120)
    systems = [list(range(41000 + 60 * k, 41000 + 60 * k + 3 * BLOCK_SIZE)) for k in range(8)]
    requests = [(k, turn) for k in range(8) for turn in range(4)]
    random.Random(0).shuffle(requests)
    before = router_decisions(server)
    seen = set()
    for k, turn in requests:
        result = client.completions.create(model=MODEL, prompt=systems[k] + [500 + turn, 600 + turn], max_tokens=1)
        cached = result.usage.prompt_tokens_details.cached_tokens
        assert cached == (3 * BLOCK_SIZE if k in seen else 0), (k, turn, cached)
        seen.add(k)
    changed = delta(router_decisions(server), before)
    assert sum(v for (reason, _), v in changed.items() if reason == "prefix") == 8 * 3


def test_a_saturated_replica_is_passed_over(server: ServerProcess) -> None:
    """12 requests for one prompt at once: its replica takes them until its load exceeds the
    other's by more than --router-balance-abs-threshold (4), then the other gets them."""
    before = router_decisions(server)

    async def burst() -> list[str]:
        client = openai.AsyncOpenAI(base_url=server.v1, api_key=API_KEY, max_retries=0, timeout=300)

        async def one() -> str:
            result = await client.completions.create(model=MODEL, prompt=SATURATE_PROMPT, max_tokens=48,
                                                     extra_body={"ignore_eos": True})
            return result.choices[0].finish_reason

        try:
            return list(await asyncio.gather(*(one() for _ in range(12))))
        finally:
            await client.close()

    assert asyncio.run(burst()) == ["length"] * 12
    changed = delta(router_decisions(server), before)
    assert sum(changed.values()) == 12
    first = [replica for (reason, replica) in changed if reason == "smallest_tree"]
    passed_over = {replica for (reason, replica) in changed if reason == "least_loaded"}
    assert len(first) == 1 and passed_over and first[0] not in passed_over, changed


def stream_items(server: ServerProcess) -> dict[str, float]:
    """backfill:ray_stream_items_total as kind -> count."""
    metrics = server.metrics()
    return {kind: metrics[f'backfill:ray_stream_items_total{{kind="{kind}"}}'] for kind in ("mux", "inline")}


MUX_PROMPT = "Mux test: " + "a story about a lighthouse keeper and the sea, " * 3  # prefix-routed: one replica


def stream_muxed(client: openai.OpenAI, server: ServerProcess, request: dict[str, object]) -> tuple[
        list[openai.types.Completion], dict[str, float]]:
    """`request` streamed until it comes through its replica's mux (its own stream carrying just
    Accepted, ResponseStart and End): its chunks and the Ray items the ingress received for it.

    NOTE: the ingress opens its muxes as it starts, or when a replica with none accepts a request
    (which then comes inline); a request may overtake the opening. Later ones come muxed.
    """
    for _ in range(5):
        before = stream_items(server)
        chunks = list(client.completions.create(**request, stream=True))  # type: ignore[call-overload]

        def received() -> dict[str, float]:
            return {kind: count - before[kind] for kind, count in stream_items(server).items()}

        # NOTE: the client stops at [DONE], which may come through the mux before End comes
        # through the request's own stream: wait for End.
        wait_until(lambda: received()["inline"] >= 3, timeout=30)
        items = received()
        if items["inline"] == 3:
            break
    return chunks, items


def test_streamed_tokens_come_through_the_replicas_mux(server: ServerProcess) -> None:
    """A streamed completion's 64 tokens come in its replica's mux; the text is the non-streamed one's."""
    client = openai.OpenAI(base_url=server.v1, api_key=API_KEY, max_retries=0, timeout=120)
    request = {"model": MODEL, "prompt": MUX_PROMPT, "max_tokens": 64, "temperature": 0,
               "extra_body": {"ignore_eos": True}}
    expected = client.completions.create(**request).choices[0].text  # type: ignore[call-overload]
    chunks, items = stream_muxed(client, server, request)
    assert items["inline"] == 3 and items["mux"] >= 1, items
    assert "".join(chunk.choices[0].text for chunk in chunks if chunk.choices) == expected
    assert chunks[-1].choices[0].finish_reason == "length"


def test_a_muxed_stream_whose_client_goes_away_is_aborted(server: ServerProcess) -> None:
    client = openai.OpenAI(base_url=server.v1, api_key=API_KEY, max_retries=0, timeout=120)
    stream_muxed(client, server, {"model": MODEL, "prompt": MUX_PROMPT, "max_tokens": 2})
    before, max_tokens = stream_items(server), 1000
    generated = sum_of(server.metrics(), "backfill:generation_tokens_total{")
    body = {"model": MODEL, "prompt": MUX_PROMPT, "max_tokens": max_tokens, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", server.v1 + "/completions", json=body, headers=HEADERS, timeout=120) as response:
        events = 0
        for line in response.iter_lines():
            events += line.startswith("data: ")
            if events == 5:
                break  # and the connection closes
    assert wait_until(lambda: not sum_of(server.metrics(), "backfill:num_requests_running{"), timeout=300)
    metrics = server.metrics()
    assert sum_of(metrics, "backfill:generation_tokens_total{") - generated < max_tokens  # aborted
    items = {kind: count - before[kind] for kind, count in stream_items(server).items()}
    assert items["inline"] == 2 and items["mux"] >= 1, items  # it came muxed (and ended with no End)


def sum_of(metrics: dict[str, float], prefix: str) -> float:
    return sum(value for key, value in metrics.items() if key.startswith(prefix))


def _stream(base_url: str, prompt: str, max_tokens: int, events: list[dict[str, object]],
            started: threading.Event) -> None:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True, "stream": True}
    try:
        with httpx.stream("POST", base_url + "/v1/completions", json=body, headers=HEADERS, timeout=600) as response:
            assert response.status_code == 200, response.read()
            for line in response.iter_lines():
                if line.startswith("data: "):
                    payload = line[len("data: "):]
                    events.append({"done": True} if payload == "[DONE]" else json.loads(payload))
                    started.set()
    except httpx.HTTPError as error:  # the connection broke: the stream's last event says how
        events.append({"broken": repr(error)})
    finally:
        started.set()


def _start_streams(server: ServerProcess, prompts: list[str], max_tokens: list[int]) -> tuple[
        list[threading.Thread], list[list[dict[str, object]]]]:
    """One streaming completion a prompt, each in a thread; returns once every one has begun."""
    events: list[list[dict[str, object]]] = [[] for _ in prompts]
    started = [threading.Event() for _ in prompts]
    threads = [threading.Thread(target=_stream, args=(server.base_url, prompt, limit, events[i], started[i]))
               for i, (prompt, limit) in enumerate(zip(prompts, max_tokens))]
    for thread in threads:
        thread.start()
    assert all(event.wait(300) for event in started)
    return threads, events


def test_sigterm_drains_both_replicas_and_leaves_no_ray_process(server: ServerProcess) -> None:
    processes = descendant_pids(server.process.pid)
    assert any(b"raylet" in cmdline(pid) for pid in processes)
    assert sum(b"ServeReplica" in cmdline(pid) for pid in processes) == 2
    temp_dirs = {path for pid in processes for path in glob.glob("/tmp/backfill-ray-*") if path.encode() in cmdline(pid)}
    assert len(temp_dirs) == 1
    # Ray's sockets, and each replica's engine core's (ipc://, in a folder of its own)
    sockets = bound_socket_paths([server.process.pid, *processes])
    assert sum("backfill-core-" in path for path in sockets) >= 4, sockets  # inputs and outputs, per replica
    # 10 streams of one prompt (the burst spreads over both replicas, as above), and one that
    # cannot finish within the grace period.
    prompts = ["Drain: long ago, in a land far away, where the rivers ran uphill"] * 10 + ["Drain: the long one"]
    threads, events = _start_streams(server, prompts, max_tokens=[60] * 10 + [8000])
    running = {k: v for k, v in server.metrics().items() if k.startswith("backfill:num_requests_running{")}
    assert len(running) == 2 and all(v >= 1 for v in running.values()), running

    server.process.send_signal(signal.SIGTERM)
    signalled = time.monotonic()
    refused = httpx.post(server.v1 + "/completions", json={"model": MODEL, "prompt": "late"}, headers=HEADERS,
                         timeout=30)
    assert refused.status_code == 503 and refused.json()["error"]["code"] == "shutting_down"
    assert server.process.wait(timeout=GRACE_S + 30) == 0
    # The process ends a second after the grace period at the latest (launcher.EXIT_GRACE_S).
    assert time.monotonic() - signalled < GRACE_S + EXIT_BOUND_S
    for thread in threads:
        thread.join(timeout=30)
    for stream in events[:10]:  # every stream that could finish in time did
        assert stream[-1] == {"done": True} and stream[-2]["choices"][0]["finish_reason"] == "length", stream[-2:]
    assert events[10][-1] == {"done": True}, events[10][-2:]
    assert events[10][-2]["error"]["code"] == "shutting_down", events[10][-2:]  # type: ignore[index]
    assert wait_until(lambda: not any(is_alive(pid) for pid in processes), timeout=30), \
        [cmdline(pid)[:80] for pid in processes if is_alive(pid)]
    time.sleep(2)  # nothing starts Ray again once the server is gone
    assert not any(os.path.exists(path) for path in temp_dirs)
    assert not [path for path in sockets if os.path.exists(path)]  # nor any socket's file (or folder)
    assert not [path for path in sockets if os.path.exists(os.path.dirname(path))]
    assert not [pid for pid in map(int, filter(str.isdigit, os.listdir("/proc")))
                if any(path.encode() in cmdline(pid) for path in temp_dirs)]


def test_a_killed_replica_fails_its_requests_and_is_replaced() -> None:
    server = start_server("--replicas", "2", "--router", "round-robin", "--api-key", API_KEY, cli=True,
                          startup_timeout=RAY_STARTUP_TIMEOUT_S)
    try:
        labels = replica_labels(server)
        replicas = [pid for pid in descendant_pids(server.process.pid) if b"ServeReplica" in cmdline(pid)]
        assert len(labels) == 2 and len(replicas) == 2
        # Round-robin: one stream on each replica.
        threads, events = _start_streams(server, ["Kill test: the first", "Kill test: the second"], max_tokens=[300] * 2)
        os.kill(replicas[0], signal.SIGKILL)
        client = openai.OpenAI(base_url=server.v1, api_key=API_KEY, max_retries=0, timeout=300)
        # Accepted while one replica is dead or restarting: none is lost.
        for i in range(6):
            assert client.completions.create(model=MODEL, prompt=f"After the kill {i}", max_tokens=2).choices
        for thread in threads:
            thread.join(timeout=600)
        endings = sorted(str(stream[-2].get("error", {}).get("code", "ok")) for stream in events)  # type: ignore[union-attr]
        assert endings == ["ok", "replica_failed"], [stream[-2:] for stream in events]
        assert all(stream[-1] == {"done": True} for stream in events)
        # Ray Serve starts a new replica in place of the dead one, and it takes requests.
        assert wait_until(lambda: len(replica_labels(server)) == 2 and replica_labels(server) != labels,
                          timeout=RESTART_TIMEOUT_S, interval=2.0)
        new = (replica_labels(server) - labels).pop()
        before = router_decisions(server)

        def new_replica_served() -> bool:
            assert client.completions.create(model=MODEL, prompt="After the restart", max_tokens=2).choices
            return delta(router_decisions(server), before).get(("round_robin", new), 0) >= 1

        # (once the router has heard of it, which follows its start by a moment)
        assert wait_until(new_replica_served, timeout=120, interval=0.5)
    finally:
        stop_ray_server(server)
