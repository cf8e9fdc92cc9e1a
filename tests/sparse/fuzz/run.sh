#!/usr/bin/env bash
# Builds the libFuzzer target for the sparse formats' validating constructors with clang
# (-fsanitize=fuzzer,address,undefined) and runs it for a bounded time.
#   bash tests/sparse/fuzz/run.sh [seconds=60] [build dir=build/fuzz]
# Needs clang++ with libFuzzer (Debian: clang, which brings libclang-rt-*-dev).
set -euo pipefail
cd "$(dirname "$0")/../../.."
seconds=${1:-60}
out=${2:-build/fuzz}
cxx=${CXX_FUZZ:-clang++}
mkdir -p "$out/corpus"
"$cxx" -std=c++20 -O1 -g -fsanitize=fuzzer,address,undefined -fno-sanitize-recover=undefined -Iinclude \
  tests/sparse/fuzz/fuzz_formats.cpp -o "$out/fuzz_sparse_formats"
# A few valid seeds so the fuzzer starts from inputs that construct (kind, rows, cols, slack = 2 -> 0).
printf '\x00\x02\x05\x02\x00\x00\x01\x00\x02\x00\x00\x00\x03\x00\x00\x00\x80\x3f\x00\x00\x00\x40' >"$out/corpus/csr"
printf '\x01\x03\x0a\x02' >"$out/corpus/bitmap"
printf '\x02\x01\x04\x02\x00\x00\x80\x3f\x00\x00\x00\x40\x00\x02' >"$out/corpus/n_m"
"$out/fuzz_sparse_formats" -max_total_time="$seconds" -max_len=4096 -rss_limit_mb=2048 -print_final_stats=1 \
  -artifact_prefix="$out/" \
  "$out/corpus"
