#!/usr/bin/env bash
# The first GPU call (docs/development.md, "The first GPU call"): experiments/gpu_bench.py does the work; this keeps the old entry point.
#   experiments/gpu_bench.sh --wheels | --dry-run | (nothing: on the GPU machine)
cd "$(dirname "$0")/.." && exec "${PYTHON:-python3}" experiments/gpu_bench.py "$@"
