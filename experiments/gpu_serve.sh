#!/usr/bin/env bash
# The serving engine on one GPU (issue 27): llama1b's shapes with bf16 weights from one synthetic training step,
# then experiments/decode_step_bench.py (a decode step of generate's loop against the engine's programs) and
# experiments/serve_attend_bench.py (the engine alone against static batching through Generator.generate, the
# engine's decode program alone, spans against the whole row). The first run, 2026-12-04, had only the last
# (benchmarks/2026-12-04-gpu-h200.md). With --server, after the training step, experiments/serve_bench.py instead:
# the HTTP server in a subprocess against one at a time, static batching and the engine alone, the issue's three
# targets (32 requests, one round, 64 Poisson requests per rate, a context of 128; the two processes share the GPU).
#
#   experiments/gpu_serve.sh --wheels   # here, beforehand: tensorboardX, protobuf, ml_collections, and the server's
#                                       # starlette, uvicorn, httptools -> experiments/wheels
#   device tool run: carry ["experiments/wheels"], command "experiments/gpu_serve.sh", timeout_s 480
#   (SLOTS=32 ROUNDS=3 experiments/gpu_serve.sh: other settings; ~20 s to train, ~110 s for serve_attend_bench at
#   8 slots with two engines (now three), decode_step_bench not timed on a GPU yet: at most 170 and 240 s;
#   CONFIG=configs/tiny.py with a python3 of the GPU machine's packages first on PATH: the same steps on a CPU)
#   device tool run: carry ["experiments/wheels"], command "experiments/gpu_serve.sh --server", timeout_s 540
#   (not run on a GPU yet: at most 120 s to train and 400 s for serve_bench; 1 min 52 s on this CPU at tiny shapes,
#   CONFIG as above with PYTHONPATH holding what the GPU machine has and .venv-gpu lacks: prometheus-client, uvloop,
#   anyio, h11, click, matplotlib, threadpoolctl; there the server measured 0.56 of static batching: the training
#   step's bfloat16, which the CPU decodes 3.6x slower per step, benchmarks/2026-12-05-serve-10.md)
#
# The GPU machine lacks tensorboardX (the training metrics' writer) and the server's starlette, uvicorn and
# httptools; it has prometheus-client, uvloop, anyio, h11, click, matplotlib and scikit-learn (the device tool's
# KINDS.md). Its training run's loss plot step may fail there, so the checkpoint is checked instead of the exit
# status.
set -uo pipefail
cd "$(dirname "$0")/.."
if [[ ${1:-} == --wheels ]]; then
  exec python3 -m pip download --quiet --only-binary=:all: --no-deps --python-version 3.12 \
    --platform manylinux2014_x86_64 --platform manylinux_2_28_x86_64 -d experiments/wheels tensorboardX protobuf \
    ml_collections==1.1.0 starlette==1.10.0 uvicorn==0.55.0 httptools==0.9.0
fi
out=${OUT:-runs/gpu_serve}
mkdir -p "$out"
site=$(mktemp -d)
python3 -m pip install --quiet --no-index --no-deps --target "$site" experiments/wheels/*.whl
# --server: the server and the benchmark's own references are two processes on the one GPU, each its share.
[[ ${1:-} == --server ]] && fraction=0.45 || fraction=0.9
export PYTHONPATH=$site:.:experiments${PYTHONPATH:+:$PYTHONPATH} XLA_PYTHON_CLIENT_MEM_FRACTION=$fraction
workdir=$(mktemp -d)/run
timeout 120 python3 -m meshtrain.train --config "${CONFIG:-configs/llama1b.py}" --workdir "$workdir" --config.data.name=synthetic \
  --config.steps=1 --config.eval_every=0 --config.batch_size=1 --config.seq_len=256 --config.mesh.data=1 \
  --config.mesh.fsdp=1 --config.mesh.tensor=1 --config.mesh.nodes.data=1 --config.cpu_devices=1 \
  --config.model.param_dtype=bfloat16 --config.model.dtype=bfloat16 >"$out/train.log" 2>&1
if [[ ! -d $workdir/checkpoints/1 ]]; then
  echo "error: no checkpoint from the training step; see $out/train.log" >&2
  tail -20 "$out/train.log" >&2
  exit 1
fi
slots=${SLOTS:-8}
if [[ ${1:-} == --server ]]; then
  timeout 400 python3 experiments/serve_bench.py --workdir "$workdir" --rounds 1 --requests 32 --poisson-requests 64 \
    --max-len 128 --slots "$slots" --out "$out/serve_bench_slots$slots.json" --plot "$out/serve_bench_slots$slots.png" \
    >"$out/serve_bench_slots$slots.log" 2>&1
  rc=$?
  echo "serve_bench: rc $rc"
  grep -A6 '"targets"' "$out/serve_bench_slots$slots.json" 2>/dev/null || tail -20 "$out/serve_bench_slots$slots.log"
  exit $rc
fi
timeout 170 python3 experiments/decode_step_bench.py --workdir "$workdir" --slots "$slots" \
  --out "$out/decode_step_slots$slots.json" >"$out/decode_step_slots$slots.log" 2>&1
echo "decode_step_bench: rc $?"
tail -1 "$out/decode_step_slots$slots.log"
timeout 240 python3 experiments/serve_attend_bench.py --workdir "$workdir" --max-len 1024 --requests 64 \
  --max-tokens 64 --slots "$slots" --rounds "${ROUNDS:-2}" --out "$out/serve_attend_slots$slots.json" \
  >"$out/serve_slots$slots.log" 2>&1
rc=$?
tail -4 "$out/serve_slots$slots.log"
exit $rc
