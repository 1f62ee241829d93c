"""The live dashboard: its /v1/stats feed, its key, and the page in a real headless Chromium
under load, whose numbers must move and then agree with /metrics."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from collections.abc import Iterator

import httpx
import openai
import pytest

from backfill.bench.dashboard_browser import browser_available, dashboard_url, open_dashboard
from backfill.entrypoints.openai.transport import redact_query
from tests.server.harness import API_KEY, MODEL, ServerProcess, engine_idle, wait_until

AUTH = {"Authorization": f"Bearer {API_KEY}"}
# Where the test saves its screenshot under load: docs/dashboard.png in the README is one.
SCREENSHOT_ENV = "BACKFILL_DASHBOARD_SCREENSHOT"
PAGE_TIMEOUT_S = 120.0


def _stats(server: ServerProcess, **params: object) -> dict:
    response = httpx.get(server.v1 + "/stats", params=params, headers=AUTH, timeout=30)
    assert response.status_code == 200, response.text
    return response.json()


def test_the_page_and_its_feed_need_the_key(server: ServerProcess) -> None:
    for url, headers in ((server.v1 + "/stats", {}), (server.v1 + "/stats", {"Authorization": "Bearer wrong"}),
                         (server.base_url + "/dashboard", {}), (server.base_url + "/dashboard?key=wrong", {})):
        response = httpx.get(url, headers=headers, timeout=30)
        assert response.status_code == 401, url
        assert response.json()["error"]["type"] == "invalid_request_error"
    for url, headers in ((dashboard_url(server.base_url, API_KEY), {}), (server.base_url + "/dashboard", AUTH)):
        response = httpx.get(url, headers=headers, timeout=30)
        assert response.status_code == 200 and response.headers["content-type"].startswith("text/html")
        assert response.headers["referrer-policy"] == "no-referrer"
        # Everything the page loads comes from this server: no external script, style or image.
        assert "http://" not in response.text and "https://" not in response.text
    bad = httpx.get(server.v1 + "/stats", params={"since_step": "last"}, headers=AUTH, timeout=30)
    assert bad.status_code == 400 and bad.json()["error"]["param"].endswith("since_step")


def test_the_feed_counts_what_metrics_counts(server: ServerProcess) -> None:
    client = openai.OpenAI(base_url=server.v1, api_key=API_KEY, max_retries=0, timeout=120)
    before = _stats(server)
    client.completions.create(model=MODEL, prompt="Slots that sit idle cost", max_tokens=7, temperature=0,
                              extra_body={"ignore_eos": True})
    assert wait_until(lambda: engine_idle(server), timeout=30)
    after, samples = _stats(server), server.metrics()
    assert after["tokens"]["output_total"] == before["tokens"]["output_total"] + 7
    assert after["tokens"]["output_total"] == samples["backfill:generation_tokens_total"]
    assert after["requests"]["finished"] == _finished(samples)
    assert after["num_steps"] == samples["backfill:engine_steps_total"] >= before["num_steps"] + 7
    assert after["ttft_ms"]["count"] >= 1 and after["ttft_ms"]["p50"] > 0
    assert after["num_slots"] == 32 and after["cost"]["price_per_hour"] == 2.0
    timeline = after["timeline"]
    assert timeline["last_step"] == after["num_steps"] and 7 <= len(timeline["states"]) <= timeline["max_steps"]
    assert all(len(states) == 32 and set(states) <= set("uie") for states in timeline["states"])
    assert any("u" in states for states in timeline["states"])
    assert _stats(server, since_step=timeline["last_step"])["timeline"]["states"] == []


def _finished(samples: dict[str, float]) -> float:
    """Sequences ended with a finish reason, as /metrics counts them."""
    return sum(value for name, value in samples.items()
               if name.startswith(("backfill:request_success_total", "backfill:request_timeout_total")))


@pytest.fixture(scope="module")
def browser_ok() -> None:
    why = browser_available()
    if why is not None:
        if os.environ.get("CI"):  # the set-up (make test) installs it: missing there is a failure
            pytest.fail(why)
        pytest.skip(why)


class Load:
    """Streaming completions from a few threads until stopped, more sequences than the server's
    32 slots (6 threads x n=6): a server under full load, requests waiting for a slot."""

    def __init__(self, server: ServerProcess, num_threads: int = 6) -> None:
        self.client = openai.OpenAI(base_url=server.v1, api_key=API_KEY, max_retries=0, timeout=300)
        self.stop = threading.Event()
        self.errors: list[BaseException] = []
        self.threads = [threading.Thread(target=self._run, args=(i,), daemon=True) for i in range(num_threads)]

    def _run(self, index: int) -> None:
        try:
            while not self.stop.is_set():
                # Lengths differ by thread, so requests end at different steps and slots turn over.
                stream = self.client.completions.create(
                    model=MODEL, prompt=f"Request {index}: a batch slot left idle", max_tokens=8 + 4 * index, n=6,
                    temperature=0.8, stream=True, extra_body={"ignore_eos": True})
                for _ in stream:
                    pass
        except BaseException as error:  # noqa: BLE001 - reported by the test
            self.errors.append(error)

    def __enter__(self) -> Load:
        for thread in self.threads:
            thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self.stop.set()
        for thread in self.threads:
            thread.join(timeout=300)


def _dom_number(driver: object, element_id: str) -> float | None:
    value = driver.find_element("id", element_id).get_attribute("data-value")  # type: ignore[attr-defined]
    return float(value) if value else None


def _canvas_count(driver: object, name: str) -> int:
    return int(driver.find_element("id", "timeline").get_attribute(f"data-{name}"))  # type: ignore[attr-defined]


@pytest.fixture
def dashboard(server: ServerProcess, browser_ok: None) -> Iterator[object]:
    with open_dashboard(server.base_url, API_KEY) as driver:
        yield driver


def test_the_page_under_load_moves_and_then_matches_metrics(server: ServerProcess, dashboard: object) -> None:
    driver = dashboard
    assert wait_until(lambda: _dom_number(driver, "output-total") is not None, PAGE_TIMEOUT_S), \
        driver.find_element("id", "status").text  # type: ignore[attr-defined]
    start_total = _dom_number(driver, "output-total")
    assert start_total is not None
    with Load(server) as load:
        # The numbers move: tokens flow, requests run, the timeline fills with useful slots.
        assert wait_until(lambda: (_dom_number(driver, "tokens-per-s") or 0) > 0
                          and (_dom_number(driver, "running") or 0) > 0
                          and (_dom_number(driver, "output-total") or 0) > start_total
                          and _canvas_count(driver, "useful") > 0, PAGE_TIMEOUT_S), load.errors
        first_total = _dom_number(driver, "output-total")
        assert wait_until(lambda: (_dom_number(driver, "output-total") or 0) > (first_total or 0), PAGE_TIMEOUT_S)
        assert wait_until(lambda: (_dom_number(driver, "ttft-p50") or 0) > 0
                          and (_dom_number(driver, "cost-per-million") or 0) > 0, PAGE_TIMEOUT_S)
        screenshot = os.environ.get(SCREENSHOT_ENV)
        if screenshot:
            driver.save_screenshot(screenshot)  # type: ignore[attr-defined]
    assert not load.errors, load.errors
    # Load over: once the engine is idle, the page shows exactly what /metrics counts.
    assert wait_until(lambda: engine_idle(server), timeout=60)
    samples = server.metrics()
    final = {"output-total": samples["backfill:generation_tokens_total"], "finished-total": _finished(samples),
             "running": samples["backfill:num_requests_running"], "waiting": samples["backfill:num_requests_waiting"],
             "kv-usage": samples["backfill:kv_cache_usage_perc"]}
    assert final["running"] == final["waiting"] == final["kv-usage"] == 0 < final["output-total"]
    shown = lambda: {name: _dom_number(driver, name) for name in final}  # noqa: E731
    assert wait_until(lambda: shown() == final, PAGE_TIMEOUT_S), (shown(), final)
    steps = _canvas_count(driver, "steps")
    assert 0 < steps <= 300
    assert sum(_canvas_count(driver, name) for name in ("useful", "idle", "empty")) == steps * 32
    assert "feed unavailable" not in driver.find_element("id", "status").text  # type: ignore[attr-defined]
    # The key in the page's URL never reaches the access log (--access-log), nor any other line.
    assert redact_query(dashboard_url("", API_KEY)) == "/dashboard?key=***"
    assert API_KEY not in server.log()


def test_a_negative_price_is_refused_before_loading() -> None:
    result = subprocess.run([sys.executable, "-m", "backfill.entrypoints.openai.api_server", "--price-per-hour", "-1"],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 2 and "invalid --price-per-hour: -1" in result.stderr
