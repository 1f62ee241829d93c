#!/usr/bin/env bash
# Prepare, on a machine that reaches the package registries, what scripts/gpu_check.sh needs on
# a GPU machine that reaches none, in .gpu_assets/ (git-ignored through .git/info/exclude):
#   .gpu_assets/1/wheels  backfill's Python dependencies such a machine lacks (its torch, numpy,
#                         safetensors... are its own), for CPython 3.12 on x86-64
#   .gpu_assets/2/wheels  the HTTP server's (scripts/serve_check.py runs `backfill serve` there)
#   .gpu_assets/{1,2}/model  the default GGUF cut in parts, with its checksum and part count
# Each of the two folders fits one device call's 64 MiB beside the repo. Usage:
#   scripts/gpu_pack.sh            (PYTHON=... to choose the pip)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
ASSETS=.gpu_assets
PART_MB=44  # part 1: wheels (17 MB) + 44 MB; part 2: the other 54 MB (and the repo in each)
# Not on the device image (or older there): the GGUF reader, the engine core's message codec,
# and the transformers / tokenizers backfill is tested with (its GGUF tokenizer mirrors 5.23).
WHEELS=(gguf==0.19.0 msgspec==0.23.0 transformers==5.23.0 tokenizers==0.23.3)
# `backfill serve`'s, for part 2 (7 MB; the image has httpx, aiohttp, jinja2, prometheus-client).
SERVER_WHEELS=(fastapi==0.163.2 starlette==1.10.0 pydantic==2.14.3 pydantic_core==2.50.4 annotated-types==0.8.0
               typing-inspection==0.4.5 uvicorn==0.54.0 httptools==0.9.0 pyzmq==27.3.0 llguidance==1.9.1)

exclude=$(git rev-parse --git-path info/exclude)
grep -qx "/$ASSETS/" "$exclude" 2>/dev/null || echo "/$ASSETS/" >>"$exclude"
rm -rf "$ASSETS"
mkdir -p "$ASSETS/1/wheels" "$ASSETS/1/model" "$ASSETS/2/wheels" "$ASSETS/2/model"

download() {  # download DIR WHEEL...
    local dir=$1; shift
    "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_31_x86_64 --platform manylinux_2_28_x86_64 --platform manylinux_2_26_x86_64 \
        --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d "$dir" "$@"
}
download "$ASSETS/1/wheels" "${WHEELS[@]}"
download "$ASSETS/2/wheels" "${SERVER_WHEELS[@]}"

model=$("$PY" -c "from backfill.model_files import default_model_path as p; print(p())")
name=$(basename "$model")
split -b "${PART_MB}M" -d "$model" "$ASSETS/1/model/$name.part"
num_parts=$(ls "$ASSETS/1/model/" | wc -l)
for part in "$ASSETS"/1/model/"$name".part*; do
    [ "$part" = "$ASSETS/1/model/$name.part00" ] || mv "$part" "$ASSETS/2/model/"
done
{ sha256sum "$model" | cut -d' ' -f1; echo "$num_parts"; } | tee "$ASSETS/1/model/$name.sha256" >"$ASSETS/2/model/$name.sha256"
du -sh "$ASSETS"/1 "$ASSETS"/2
