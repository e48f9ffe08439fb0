#!/usr/bin/env bash
# The serving engine on one GPU (issue 27): llama1b's shapes with bf16 weights from one synthetic training step,
# then experiments/decode_step_bench.py (a decode step of generate's loop against the engine's programs) and
# experiments/serve_attend_bench.py (the engine alone against static batching through Generator.generate, the
# engine's decode program alone, spans against the whole row). The first run, 2026-12-04, had only the last
# (benchmarks/2026-12-04-gpu-h200.md).
#
#   experiments/gpu_serve.sh --wheels   # here, beforehand: tensorboardX, protobuf, ml_collections -> experiments/wheels
#   device tool run: carry ["experiments/wheels"], command "experiments/gpu_serve.sh", timeout_s 480
#   (SLOTS=32 ROUNDS=3 experiments/gpu_serve.sh: other settings; ~20 s to train, ~110 s for serve_attend_bench at
#   8 slots with two engines (now three), decode_step_bench not timed on a GPU yet: at most 170 and 240 s;
#   CONFIG=configs/tiny.py with a python3 of the GPU machine's packages first on PATH: the same steps on a CPU)
#
# The GPU machine lacks tensorboardX (the training metrics' writer) and matplotlib (the loss plot, drawn after the
# last checkpoint: that step fails there, so the checkpoint is checked instead of the exit status).
set -uo pipefail
cd "$(dirname "$0")/.."
if [[ ${1:-} == --wheels ]]; then
  exec python3 -m pip download --quiet --only-binary=:all: --no-deps --python-version 3.12 \
    --platform manylinux2014_x86_64 -d experiments/wheels tensorboardX protobuf ml_collections==1.1.0
fi
out=${OUT:-runs/gpu_serve}
mkdir -p "$out"
site=$(mktemp -d)
python3 -m pip install --quiet --no-index --no-deps --target "$site" experiments/wheels/*.whl
export PYTHONPATH=$site:.:experiments XLA_PYTHON_CLIENT_MEM_FRACTION=0.9
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
