#!/usr/bin/env bash
# The packed GEMM kernels on one core without torch (scripts/qgemm_harness.cpp), for quick A/B of
# kernel changes: builds the AVX2 and AVX-512 units of CSRC (default: this tree's) and runs
#   scripts/qgemm_harness.sh [N K TYPE M]...   e.g. scripts/qgemm_harness.sh "960 576 4 1" "4096 576 8 6"
# (TYPE 4: Q4_1, 8: Q8_0). CSRC=/path/to/other/tree/backfill/kernels/csrc to time another tree,
# EXTRA_CXXFLAGS to build with other flags, SUBNORMAL=0 for the converted 4-bit codes, GHZ the clock.
set -euo pipefail
cd "$(dirname "$0")/.."
CSRC=${CSRC:-$PWD/backfill/kernels/csrc}
OUT=$(mktemp -d)
trap 'rm -rf "$OUT"' EXIT
FLAGS=(-std=c++20 -O3 -fno-math-errno -fno-trapping-math -I"$CSRC" ${EXTRA_CXXFLAGS:-})
for unit in avx2 avx512; do g++ "${FLAGS[@]}" -c "$CSRC/qgemm_$unit.cpp" -o "$OUT/$unit.o"; done
g++ "${FLAGS[@]}" scripts/qgemm_harness.cpp "$OUT/avx2.o" "$OUT/avx512.o" -o "$OUT/harness"
for shape in "${@:-960 576 4 1}"; do
  taskset -c 0 "$OUT/harness" $shape
done
