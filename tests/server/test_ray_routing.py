"""The Ray Serve pieces that need no Ray: the routing policy, the prefix index, the merged /metrics
text, running a forwarded request through an ASGI app (asgi_call), the muxes' two ends (mux), and
the ingress's relay of a response (on fakes)."""

from __future__ import annotations

import asyncio
import json
import random
from collections import Counter, defaultdict
from collections.abc import AsyncIterator

import pytest
from fastapi import FastAPI, Request
from fastapi.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from backfill.entrypoints.ray_serve.asgi_call import BODY_END, ForwardedRequest, ResponseStart, call_app
from backfill.entrypoints.ray_serve.metrics_merge import merge_metrics, router_metrics
from backfill.entrypoints.ray_serve.mux import Batch, Demux, MuxClosed, MuxReceiver, MuxSender, Outbox
from backfill.entrypoints.ray_serve.options import RouterConfig
from backfill.entrypoints.ray_serve.policy import RoutingPolicy
from backfill.entrypoints.ray_serve.prefix_index import BLOCK_CHARS, PrefixIndex, block_hashes, routing_text

REPLICAS = ["a", "b"]
SYSTEMS = [f"System prompt {k}: " + "you are a helpful assistant. " * 20 for k in range(8)]


def workload(seed: int = 0) -> list[tuple[int, str]]:
    """8 system prompts x 16 user turns, shuffled: (system index, prompt text)."""
    requests = [(k, SYSTEMS[k] + f"User {turn}: question {turn}?") for k in range(8) for turn in range(16)]
    random.Random(seed).shuffle(requests)
    return requests


def route_serially(policy: RoutingPolicy) -> dict[int, set[str]]:
    """Each request finishes before the next arrives; returns the replicas each system prompt met."""
    met: dict[int, set[str]] = defaultdict(set)
    for n, (k, text) in enumerate(workload()):
        replica, reason = policy.choose(f"r{n}", text, REPLICAS, {})
        policy.record(reason, replica)
        policy.complete(f"r{n}")
        met[k].add(replica)
    return met


def test_cache_aware_keeps_each_system_prompt_on_one_replica_and_spreads_them() -> None:
    policy = RoutingPolicy(RouterConfig())
    met = route_serially(policy)
    assert all(len(replicas) == 1 for replicas in met.values())
    per_replica = Counter(next(iter(replicas)) for replicas in met.values())
    assert per_replica == {"a": 4, "b": 4}  # each new prompt went to the replica holding less
    decisions = policy.decisions()
    assert sum(v for (reason, _), v in decisions.items() if reason == "smallest_tree") == 8
    assert sum(v for (reason, _), v in decisions.items() if reason == "prefix") == 8 * 15


def test_round_robin_sends_every_system_prompt_everywhere() -> None:
    met = route_serially(RoutingPolicy(RouterConfig(policy="round-robin")))
    assert all(replicas == {"a", "b"} for replicas in met.values())


def test_imbalance_follows_both_thresholds() -> None:
    policy = RoutingPolicy(RouterConfig(balance_abs_threshold=4, balance_rel_threshold=1.5))
    text = SYSTEMS[0]
    chosen = [policy.choose(f"r{n}", text, REPLICAS, {}) for n in range(7)]
    # 0..4 in flight on the first replica: balanced (5 - 0 > 4 first holds for the 6th request).
    assert [reason for _, reason in chosen] == ["smallest_tree"] + ["prefix"] * 4 + ["least_loaded", "prefix"]
    first = chosen[0][0]
    assert all(replica == first for replica, _ in chosen[:5]) and chosen[5][0] != first
    # The engines' own counts (running + waiting) weigh too: 20 reported vs 2 in flight.
    assert policy.choose("x", text, REPLICAS, {first: 20}) == (chosen[5][0], "least_loaded")
    # Both thresholds must be exceeded: 12 vs 9 differ by 3 > 2 but 12 <= 1.5 x 9: balanced, the
    # prefix wins; 14 vs 6: imbalanced.
    policy2 = RoutingPolicy(RouterConfig(balance_abs_threshold=2, balance_rel_threshold=1.5))
    policy2.choose("seed", text, REPLICAS, {})
    holder = policy2.choose("seed2", text, REPLICAS, {})[0]
    other2 = next(r for r in REPLICAS if r != holder)
    assert policy2.choose("y", text, REPLICAS, {holder: 12, other2: 9}) == (holder, "prefix")
    assert policy2.choose("z", text, REPLICAS, {holder: 14, other2: 6}) == (other2, "least_loaded")


def test_complete_and_forget_release_what_a_request_held() -> None:
    policy = RoutingPolicy(RouterConfig(balance_abs_threshold=0, balance_rel_threshold=1.0))
    replica, _ = policy.choose("r1", SYSTEMS[0], REPLICAS, {})
    policy.complete("r1")
    assert policy.choose("r2", SYSTEMS[0], REPLICAS, {}) == (replica, "prefix")  # nothing in flight
    policy.choose("r2", SYSTEMS[0], REPLICAS, {})  # chosen again (Ray retried it): counted once
    policy.complete("r2")
    assert policy.choose("r3", SYSTEMS[0], REPLICAS, {}) == (replica, "prefix")  # any load left would tip it
    policy.forget(replica)
    assert policy.index.num_blocks(replica) == 0


def test_prefix_index_matches_leading_blocks_and_evicts_the_oldest() -> None:
    index = PrefixIndex(max_blocks_per_replica=4)
    text = "x" * (3 * BLOCK_CHARS + 5)
    index.insert(block_hashes(text), "a")
    assert index.match(block_hashes(text[:2 * BLOCK_CHARS] + "y" * BLOCK_CHARS), ["a", "b"]) == {"a": 2, "b": 0}
    index.insert(block_hashes("z" * 2 * BLOCK_CHARS), "a")
    assert index.num_blocks("a") == 4 and index.match(block_hashes(text), ["a"]) == {"a": 0}  # its first went


@pytest.mark.parametrize(("path", "body", "expected"), [
    ("/v1/completions", {"prompt": "Hello"}, "Hello"),
    ("/v1/completions", {"prompt": [1, 22]}, "1,22,"),
    ("/v1/completions", {"prompt": [[1, 2], [3]]}, "1,2,"),
    ("/v1/completions", {"prompt": ["first", "second"]}, "first"),
    ("/v1/chat/completions", {"messages": [{"role": "system", "content": "Be brief."},
                                           {"role": "user", "content": [{"type": "text", "text": "Hi"}]}]},
     "system:Be brief.\nuser:Hi\n"),
    ("/v1/responses", {"instructions": "Be brief. ", "input": "Hi"}, "Be brief. Hi"),
    ("/v1/completions", {"prompt": None}, ""),
])
def test_routing_text(path: str, body: dict[str, object], expected: str) -> None:
    assert routing_text(path, body) == expected


def test_merged_metrics_label_each_replica_and_keep_one_header_per_family() -> None:
    text = ("# HELP backfill:x_total X.\n# TYPE backfill:x_total counter\n"
            'backfill:x_total{model_name="m"} 1.0\n# HELP backfill:y Y.\n# TYPE backfill:y gauge\nbackfill:y 2.0\n')
    merged = merge_metrics({"r1": text, "r2": text.replace("1.0", "3.0")})
    assert merged.count("# HELP backfill:x_total") == 1 and merged.count("# TYPE backfill:y") == 1
    lines = merged.splitlines()
    assert lines[2:4] == ['backfill:x_total{replica="r1",model_name="m"} 1.0',
                          'backfill:x_total{replica="r2",model_name="m"} 3.0']
    assert 'backfill:y{replica="r2"} 2.0' in lines
    router = router_metrics({("prefix", "r1"): 3})
    assert 'backfill:router_requests_total{reason="prefix",replica="r1"} 3.0' in router.splitlines()


def test_call_app_streams_the_response_and_reports_a_disconnect() -> None:
    app = FastAPI()
    seen: list[str] = []

    @app.post("/echo")
    async def echo(request: Request) -> StreamingResponse:
        body = await request.body()

        async def parts() -> AsyncIterator[bytes]:
            try:
                for i in range(1000):
                    yield body + str(i).encode()
                    await asyncio.sleep(0.001)
            finally:
                seen.append("closed")

        return StreamingResponse(parts(), media_type="text/plain", headers={"X-A": "1"})

    async def main() -> list[object]:
        request = ForwardedRequest("POST", "/echo", b"", [(b"content-type", b"text/plain")], b"hi")
        received: list[object] = []
        parts = call_app(app, request)
        async for part in parts:
            received.append(part)
            if b"hi2" in b"".join(p for p in received if isinstance(p, bytes)):
                break
        await parts.aclose()  # the caller went away
        return received

    received = asyncio.run(main())
    start = received[0]
    assert isinstance(start, ResponseStart) and start.status == 200 and (b"x-a", b"1") in start.headers
    assert b"".join(received[1:]).startswith(b"hi0hi1hi2")  # type: ignore[arg-type]
    assert seen == ["closed"]  # the app saw the disconnect and stopped


def test_call_app_says_the_body_is_complete_before_the_app_returns() -> None:
    """BODY_END follows the body's last message at once, not the app's return: the replica ends
    the muxed stream in the same batch as its last chunk."""
    released = asyncio.Event()

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"data: [DONE]\n\n", "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})
        await released.wait()  # e.g. closing the engine's streams

    async def main() -> list[object]:
        parts = call_app(app, ForwardedRequest("POST", "/x", b"", [], b""))
        received = [await anext(parts) for _ in range(3)]
        assert not released.is_set()
        released.set()
        received += [part async for part in parts]
        return received

    received = asyncio.run(asyncio.wait_for(main(), 10))
    assert isinstance(received[0], ResponseStart)
    assert received[1:] == [b"data: [DONE]\n\n", BODY_END]


async def _take(bodies: AsyncIterator[bytes]) -> list[bytes]:
    return [body async for body in bodies]


def test_an_inbox_takes_its_chunks_before_and_after_its_end() -> None:
    async def main() -> None:
        demux = Demux()
        (key_a, a), (key_b, b) = demux.add(), demux.add()
        demux.dispatch([(key_a, b"a0"), (key_b, b"b0"), (key_a, b"a1")])  # before either End
        a.end(3)
        b.end(1)
        assert await _take(b.bodies()) == [b"b0"]  # complete: End's count reached
        taking = asyncio.ensure_future(_take(a.bodies()))
        await asyncio.sleep(0.01)
        assert not taking.done()  # End said 3: one is still to come
        demux.dispatch([(key_a, b"a2"), (999, b"nobody's")])
        assert b"".join(await asyncio.wait_for(taking, 5)) == b"a0a1a2"
        demux.remove(key_a)
        demux.remove(key_b)
        demux.dispatch([(key_a, b"late")])  # dropped
        assert len(demux) == 0

    asyncio.run(main())


def test_an_inbox_is_complete_at_the_muxs_end_of_its_stream_without_waiting_for_end() -> None:
    async def main() -> None:
        demux = Demux()
        key, inbox = demux.add()
        taking = asyncio.ensure_future(_take(inbox.bodies()))
        demux.dispatch([(key, b"x0")])
        await asyncio.sleep(0.01)
        assert not taking.done()
        demux.dispatch([(key, b"x1"), (key, None)])  # the replica's last chunk, then its end
        assert b"".join(await asyncio.wait_for(taking, 5)) == b"x0x1"
        inbox.fail(MuxClosed("the mux broke afterwards"))  # not this request's failure
        assert await _take(inbox.bodies()) == []

    asyncio.run(main())


def test_a_broken_mux_fails_the_requests_bound_to_it_only() -> None:
    async def main() -> None:
        demux = Demux()
        (key_a, a), (key_b, b), (key_c, c) = demux.add(), demux.add(), demux.add()
        a.mux, b.mux, c.mux = 1, 1, 2
        b.end(1)
        demux.dispatch([(key_a, b"a0"), (key_b, b"b0"), (key_c, b"c0")])
        waiting = asyncio.ensure_future(_take(a.bodies()))
        await asyncio.sleep(0.01)
        demux.fail_mux(1, MuxClosed("mux 1 broke"))
        with pytest.raises(MuxClosed):  # woken: the chunks it had, then the failure
            await asyncio.wait_for(waiting, 5)
        assert await _take(b.bodies()) == [b"b0"]  # complete before the mux broke: not failed
        c.end(1)
        assert await _take(c.bodies()) == [b"c0"]  # another mux's request

    asyncio.run(main())


def test_an_outbox_sends_what_is_ready_as_one_batch() -> None:
    async def main() -> list[list[tuple[int, bytes]]]:
        outbox = Outbox(mux=7)
        batches = outbox.batches()
        for key in (1, 2, 3):  # one engine step: three requests' tokens
            outbox.put(key, b"t%d" % key)
        first = await batches.__anext__()
        outbox.put(1, b"u1")
        outbox.close()
        return [first] + [batch async for batch in batches]

    assert asyncio.run(main()) == [[(1, b"t1"), (2, b"t2"), (3, b"t3")], [(1, b"u1")]]


def test_a_mux_message_over_the_limit_is_refused_and_the_others_still_come() -> None:
    """A peer that sends a message larger than the receiver's limit (here 4 KB; 256 MiB by
    default) is cut off before the message is read whole: nothing of it is delivered, even with
    the right token, and a replica's batches on their own connection keep arriving."""

    async def main() -> list[tuple[int, int, Batch]]:
        received: list[tuple[int, int, Batch]] = []
        receiver = MuxReceiver("127.0.0.1", "ingress-token", lambda mux, load, batch: received.append((mux, load, batch)),
                               max_message_bytes=4096)
        receiver.start()
        flood = MuxSender(receiver.address, "ingress-token", 9)
        replica = MuxSender(receiver.address, "ingress-token", 1)
        try:
            flood.send([(5, b"x" * 65536)], load=0)
            for step in range(20):
                replica.send([(1, b"step %d" % step)], load=step)
            for _ in range(3000):  # up to 30 s on a loaded machine; done as soon as all came
                if len(received) >= 20:
                    break
                await asyncio.sleep(0.01)
            await asyncio.sleep(0.3)  # the flood's message, were it delivered, would have come by now
        finally:
            flood.close()
            replica.close()
            receiver.close()
        return received

    received = asyncio.run(main())
    assert received == [(1, step, [(1, b"step %d" % step)]) for step in range(20)]


def test_mux_batches_cross_zmq_in_order_with_the_load_and_only_for_their_ingress() -> None:
    """Two replicas' senders, one ingress receiver: every batch arrives whole, each sender's in
    order, with its mux id and load; a sender with another ingress's token is not heard."""

    async def main() -> list[tuple[int, int, Batch]]:
        received: list[tuple[int, int, Batch]] = []
        receiver = MuxReceiver("127.0.0.1", "ingress-token", lambda mux, load, batch: received.append((mux, load, batch)))
        receiver.start()
        senders = [MuxSender(receiver.address, "ingress-token", mux) for mux in (1, 2)]
        stranger = MuxSender(receiver.address, "another-ingress", 3)
        try:
            stranger.send([(1, b"injected")], load=0)
            for step in range(50):
                for mux, sender in zip((1, 2), senders):
                    sender.send([(10 * mux, b"step %d" % step), (10 * mux + 1, bytes([step]) * step)], load=step)
            for _ in range(3000):  # up to 30 s on a loaded machine; done as soon as all came
                if len(received) == 100:
                    break
                await asyncio.sleep(0.01)
            await asyncio.sleep(0.1)  # anything more would have come by now
        finally:
            for sender in (*senders, stranger):
                sender.close()
            receiver.close()
        return received

    received = asyncio.run(main())
    assert len(received) == 100
    for mux in (1, 2):
        mine = [(load, batch) for m, load, batch in received if m == mux]
        assert mine == [(step, [(10 * mux, b"step %d" % step), (10 * mux + 1, bytes([step]) * step)])
                        for step in range(50)]


# ---- the ingress's relay of a replica's response (ingress.Forwarder._relay), on fakes --------


class _FakeHandle:
    """Stands in for a DeploymentHandle: the relay tested here makes no Ray call."""

    def options(self, **_: object) -> _FakeHandle:
        return self


async def _parts(parts: list[object]) -> AsyncIterator[object]:
    for part in parts:
        yield part


def _relay(parts: list[object], draining: bool = False) -> tuple[bytes, list[dict]]:
    """The body a client gets when a replica answers `parts` inline (no mux), and the messages."""
    from backfill.entrypoints.ray_serve.asgi_call import Accepted
    from backfill.entrypoints.ray_serve.ingress import Forwarder
    from backfill.entrypoints.ray_serve.mux import Inbox

    sent: list[dict] = []

    async def send(message: dict) -> None:
        sent.append(message)

    async def run() -> None:
        forwarder = Forwarder(_FakeHandle(), "replica", "127.0.0.1")  # type: ignore[arg-type]
        forwarder.draining = draining
        try:
            start = ResponseStart(200, [(b"content-type", b"text/event-stream")])
            assert await forwarder._relay(_parts([Accepted(), start, *parts]), Inbox(), send,  # type: ignore[arg-type]
                                          last_attempt=True)
        finally:
            forwarder.muxes._receiver.close()

    asyncio.run(run())
    assert sent[-1]["type"] == "http.response.body" and sent[-1]["more_body"] is False
    return b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body"), sent


def test_an_event_stream_a_replica_ends_without_done_ends_with_an_error_event_and_done() -> None:
    chunk = b'data: {"choices": [{"text": "x", "finish_reason": null}]}\n\n'
    body, _ = _relay([chunk, chunk])
    events = [e for e in body.decode().split("\n\n") if e]
    assert events[:2] == [chunk.decode().strip()] * 2
    assert json.loads(events[2].removeprefix("data: "))["error"]["code"] == "replica_failed"
    assert events[3] == "data: [DONE]"
    # the server shutting down: the code says so
    body, _ = _relay([chunk], draining=True)
    assert json.loads(body.decode().split("\n\n")[1].removeprefix("data: "))["error"]["code"] == "shutting_down"
    assert body.endswith(b"data: [DONE]\n\n")
    # a stream that ends as it should is passed on unchanged (its [DONE] split across parts too)
    body, _ = _relay([chunk, b"data: [DO", b"NE]\n\n"])
    assert body == chunk + b"data: [DONE]\n\n"
