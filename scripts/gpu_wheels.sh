#!/usr/bin/env bash
# Fills .cache/gpu-carry, the one folder benchmarks/gpu_check.sh needs carried to the GPU machine:
#   wheels/                            the wheels of scripts/gpu_wheels.txt, for CPython 3.12 on x86-64 Linux
#   SmolLM2-135M-Instruct/config.json  the real model's shape (its weights, 98 MB as GGUF, exceed the carry limit)
# Lists each file's size and the total, and fails past 20 MiB. Needs pip and the package index (run it here,
# not on the GPU machine); the model's config comes from `make run`'s import (.cache/models).
set -euo pipefail
cd "$(dirname "$0")/.."
py="${1:-.venv/bin/python}"
out=.cache/gpu-carry
rm -rf "$out"
mkdir -p "$out/wheels"
mapfile -t wanted < <(grep -v '^\s*#' scripts/gpu_wheels.txt | grep -v '^\s*$')
"$py" -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_31_x86_64 --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    --dest "$out/wheels" "${wanted[@]}"
model=.cache/models/SmolLM2-135M-Instruct
if [ ! -f "$model/config.json" ]; then
    echo "no $model/config.json: run 'make run' once (it imports the model) and try again" >&2
    exit 1
fi
mkdir -p "$out/SmolLM2-135M-Instruct"
cp "$model/config.json" "$out/SmolLM2-135M-Instruct/"
found=$(ls "$out/wheels" | wc -l)
if [ "$found" -ne "${#wanted[@]}" ]; then
    echo "expected ${#wanted[@]} wheels, got $found" >&2
    exit 1
fi
(cd "$out" && find . -type f -printf '%s\t%p\n' | sort -k2)
total=$(find "$out" -type f -printf '%s\n' | awk '{ n += $1 } END { print n }')
echo "total: $total bytes ($((total / 1048576)) MiB) in $out"
if [ "$total" -gt $((20 * 1048576)) ]; then
    echo "over the 20 MiB the GPU check may carry" >&2
    exit 1
fi
