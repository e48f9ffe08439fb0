#!/usr/bin/env bash
# One GPU: meshtrain's benchmark on LLaMA-1B- and 8B-shaped models in bf16, synthetic data; prints MFU.
#
#   experiments/gpu_bench.sh              # on the GPU machine, from the repository root
#   experiments/gpu_bench.sh --wheels     # beforehand, on a machine with internet: the pure-Python packages
#                                         # a bare JAX machine may lack, into experiments/wheels (gitignored)
#
# Each model is tried with the fastest rematerialization first (save_dots keeps every matmul output) and falls
# back to full rematerialization when that does not fit; the batch is 4 x 4096 tokens for the 1B shape and
# 2 x 4096 for 8B. The 8B shape keeps its parameters and Adam moments in bf16 (8.0B x 8 bytes = 64 GB), so it fits one
# 80-141 GB GPU; the 1B shape trains with float32 parameters as in configs/llama1b.py. Results: one JSON line
# per run in experiments/gpu_bench.jsonl (appended) and a summary table on stdout.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}

if [[ "${1:-}" == "--wheels" ]]; then
  exec "$PY" -m pip download --only-binary=:all: --python-version 3.12 --no-deps -d experiments/wheels \
    ml_collections PyYAML absl-py tqdm tensorboardX
fi
if ! "$PY" -c "import ml_collections, yaml" 2>/dev/null; then
  if [[ -d experiments/wheels ]]; then
    "$PY" -m pip install --quiet --no-index --find-links experiments/wheels ml_collections PyYAML || exit 2
  else
    echo "error: ml_collections is not installed; run 'experiments/gpu_bench.sh --wheels' where there is internet" >&2
    exit 2
  fi
fi
"$PY" -c "import jax; assert jax.default_backend() == 'gpu', jax.devices()" || {
  echo "error: JAX sees no GPU here; this script benchmarks one GPU" >&2; exit 2; }

common=(--json --steps 10 --warmup 3 --config.data.name=synthetic --config.model.dtype=bfloat16
        --config.mesh.data=1 --config.mesh.fsdp=1 --config.mesh.tensor=1 --config.mesh.nodes.data=1 --config.seq_len=4096)
run() {  # name, then overrides; tries save_dots, then full remat
  local name=$1; shift
  for remat in save_dots full; do
    if out=$("$PY" -m meshtrain.bench "${common[@]}" "$@" --config.model.remat=$remat 2>experiments/gpu_bench.$name.err); then
      echo "{\"name\": \"$name\", \"remat\": \"$remat\", \"result\": $(tail -1 <<<"$out")}" | tee -a experiments/gpu_bench.jsonl
      return 0
    fi
    echo "$name with remat=$remat failed (see experiments/gpu_bench.$name.err); trying the next policy" >&2
  done
}
run llama1b --config configs/llama1b.py --config.batch_size=4
run llama8b --config configs/llama8b.py --config.batch_size=2 --config.model.param_dtype=bfloat16
"$PY" - <<'PY'
import json
rows = [json.loads(line) for line in open("experiments/gpu_bench.jsonl")][-2:]
for r in rows:
  x = r["result"]
  print(f"{r['name']:8} remat={r['remat']:9} {x['device_kind']}: {x['tokens_per_sec']:,.0f} tokens/s, "
        f"step {x['step_time_s'] * 1e3:.1f} ms, MFU {100 * x['mfu']:.1f}% of {x['peak_flops'] / 1e12:.0f} TFLOP/s")
PY
