"""A KV pool smaller than the model's context: the server's context length is what the pool
holds, so a request that could never fit is a 400, and one without max_tokens is served. The
pool holds bf16 K/V (`--kv-cache-dtype bfloat16`), which /metrics reports."""

from __future__ import annotations

import subprocess
import sys

import httpx
import pytest

from backfill.engine.llm import LLM
from tests.server.harness import MODEL, ServerProcess, start_server

NUM_BLOCKS = 24  # x 16 tokens: 384 positions, far below SmolLM2's 8192
CAPACITY = NUM_BLOCKS * 16


@pytest.fixture(scope="module")
def server() -> ServerProcess:
    server = start_server("--num-kv-blocks", str(NUM_BLOCKS), "--max-num-seqs", "4", "--kv-cache-dtype", "bfloat16")
    yield server
    server.stop()


def test_the_context_length_is_what_the_pool_holds(server: ServerProcess) -> None:
    card = httpx.get(server.v1 + "/models", timeout=30).json()["data"][0]
    assert card["max_model_len"] == CAPACITY
    assert "max_model_len lowered from 8192 to 384 tokens" in server.log()


def test_metrics_report_the_cache_configuration(server: ServerProcess) -> None:
    samples = server.metrics()
    key = ('backfill:cache_config_info{block_size="16",cache_dtype="bfloat16",enable_prefix_caching="True",'
           f'num_gpu_blocks="{NUM_BLOCKS}"}}')
    assert samples[key] == 1, [k for k in samples if "cache_config" in k]


def test_a_request_without_max_tokens_is_served_within_the_pool(server: ServerProcess) -> None:
    # Before: its default max_tokens (the rest of 8192) could never fit, and the core refused
    # it with a 500. Now the default is the rest of the 384, and the sequence fits.
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Write a long story."}],
            "temperature": 0, "ignore_eos": True}
    response = httpx.post(server.v1 + "/chat/completions", json=body, timeout=300)
    assert response.status_code == 200, response.text
    usage = response.json()["usage"]
    assert usage["total_tokens"] == CAPACITY and response.json()["choices"][0]["finish_reason"] == "length"


@pytest.mark.parametrize("body, param", [
    ({"prompt": [1] * (CAPACITY + 1), "max_tokens": 1}, "prompt"),
    ({"prompt": [1] * 300, "max_tokens": CAPACITY - 299}, "max_tokens"),
])
def test_what_the_pool_cannot_hold_is_a_400(server: ServerProcess, body: dict[str, object], param: str) -> None:
    response = httpx.post(server.v1 + "/completions", json={"model": MODEL, **body}, timeout=60)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and error["code"] == "context_length_exceeded", error
    ok = httpx.post(server.v1 + "/completions", json={"model": MODEL, "prompt": [1] * 300, "max_tokens": CAPACITY - 300},
                    timeout=300)
    assert ok.status_code == 200, ok.text


def test_an_explicit_context_the_pool_cannot_hold_is_lowered_too() -> None:
    llm = LLM(dtype="float32", num_kv_blocks=NUM_BLOCKS, max_model_len=1000, max_num_seqs=2)
    assert llm.engine.max_model_len == CAPACITY


def test_options_that_cannot_work_together_are_one_line_and_status_1() -> None:
    # Found only once the model is loaded (the weights-as-stored kernels compute in fp32).
    result = subprocess.run([sys.executable, "-m", "backfill.entrypoints.openai.api_server", "--dtype", "bfloat16",
                             "--quantization", "int8", "--num-threads", "1", "--port", "0"],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 1, result.stderr[-2000:]
    assert "quantization='int8' runs on the CPU kernels only" in result.stderr
    assert "Traceback" not in result.stderr
