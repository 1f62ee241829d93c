"""Acceptance 7, as far as a test can go: `backfill serve` with its defaults answers the README's
curl request coherently (`make serve` runs exactly this command after setting up)."""

from __future__ import annotations

import subprocess
import sys

import httpx

from tests.server.harness import MODEL, NUM_KV_BLOCKS, NUM_THREADS, start_server


def test_backfill_serve_with_defaults_answers_the_readme_request() -> None:
    # Only the KV pool and threads are set, to spare memory and CPU; dtype stays the default.
    server = start_server(cli=True, common_args=["--num-kv-blocks", str(NUM_KV_BLOCKS),
                                                 "--num-threads", str(NUM_THREADS)])
    try:
        body = {"model": MODEL, "messages": [{"role": "user", "content": "What is the capital of France?"}],
                "max_tokens": 50, "temperature": 0}
        response = httpx.post(server.v1 + "/chat/completions", json=body, timeout=120)
        assert response.status_code == 200, response.text
        answer = response.json()["choices"][0]["message"]["content"]
        assert "Paris" in answer, answer
    finally:
        server.stop()


def test_a_model_that_cannot_be_found_is_one_clear_line_and_status_1(tmp_path) -> None:  # type: ignore[no-untyped-def]
    missing = str(tmp_path / "no-such-model.gguf")
    result = subprocess.run([sys.executable, "-m", "backfill.entrypoints.openai.api_server", "--model", missing],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 1
    assert "no-such-model.gguf" in result.stderr and "does not download models" in result.stderr
    assert "Traceback" not in result.stderr
