"""The served path on one device, end to end: `backfill serve` on loopback, a completion, a
streamed chat completion and /metrics checked, then `bench serve` of a generated workload
(all at once) against it. A JSON summary (the checks, the server's start time, the bench's
figures) goes to --result-file. Usage (the GPU check runs it with --device cuda):

    python scripts/serve_check.py [--device cuda] [--dtype bfloat16] [--num-requests 64]
        [--max-num-seqs 32] [--result-file F] [-- extra serve flags]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from backfill.bench.local_server import local_server
from backfill.bench.workloads import WorkloadSpec, generate_workload, save_workload


def check_endpoints(url: str) -> dict:
    """One completion, one streamed chat completion and /metrics; raises on a bad answer."""
    checks: dict = {}
    start = time.perf_counter()
    r = httpx.post(url + "/v1/completions", timeout=120,
                   json={"prompt": "The capital of France is", "max_tokens": 8, "temperature": 0})
    r.raise_for_status()
    text = r.json()["choices"][0]["text"]
    assert text.strip(), f"empty completion: {r.text}"
    checks["completion"] = {"text": text, "seconds": time.perf_counter() - start}
    start = time.perf_counter()
    chunks, first = [], None
    with httpx.stream("POST", url + "/v1/chat/completions", timeout=120,
                      json={"messages": [{"role": "user", "content": "Say hello."}], "max_tokens": 16,
                            "temperature": 0, "stream": True}) as stream:
        stream.raise_for_status()
        for line in stream.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            delta = json.loads(line[6:])["choices"][0]["delta"].get("content") or ""
            if delta and first is None:
                first = time.perf_counter() - start
            chunks.append(delta)
    assert "".join(chunks).strip(), "empty streamed chat completion"
    checks["chat_stream"] = {"text": "".join(chunks), "ttft_s": first, "seconds": time.perf_counter() - start}
    metrics = httpx.get(url + "/metrics", timeout=30).text
    assert "backfill" in metrics, "no backfill series in /metrics"
    checks["metrics_lines"] = len(metrics.splitlines())
    return checks


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--max-num-seqs", type=int, default=32)
    parser.add_argument("--result-file", default=None)
    parser.add_argument("serve_flags", nargs="*", help="more `backfill serve` flags (after --)")
    args = parser.parse_args()
    summary: dict = {"device": args.device, "dtype": args.dtype, "ok": False}
    work = Path(tempfile.mkdtemp(prefix="serve_check_"))
    bench = [sys.executable, "-m", "backfill.bench.cli"]
    workload = work / "workload.jsonl"
    save_workload(generate_workload(WorkloadSpec(num_requests=args.num_requests)), workload)
    flags = ["--device", args.device, "--dtype", args.dtype, "--max-num-seqs", str(args.max_num_seqs),
             *args.serve_flags]
    start = time.perf_counter()
    try:
        with local_server(flags, log_path=work / "server.log", start_timeout_s=300) as url:
            summary["start_s"] = time.perf_counter() - start
            summary["checks"] = check_endpoints(url)
            result = work / "bench_serve.json"
            subprocess.run([*bench, "serve", "--base-url", url, "--workload", str(workload), "--request-rate", "inf",
                            "--num-slots", str(args.max_num_seqs), "--no-progress", "--result-file", str(result)],
                           check=True)
            summary["bench_serve"] = json.loads(result.read_text())
        summary["ok"] = True
    except Exception as exc:  # noqa: BLE001 (reported in the summary, then the exit status)
        summary["error"] = f"{type(exc).__name__}: {exc}"[-3000:]
    log = work / "server.log"
    if log.exists():
        summary["server_log_tail"] = log.read_text(errors="replace").splitlines()[-20:]
    if args.result_file:
        Path(args.result_file).write_text(json.dumps(summary, indent=1, default=str))
    print(json.dumps({k: v for k, v in summary.items() if k not in ("bench_serve", "server_log_tail")}, default=str))
    return 0 if summary["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
