"""What checkpoint checksums cost: save and restore of the configs/base125m.py train state (124M parameters and
both Adam moments, ~1.5 GB float32) with and without them, side by side in one process, rounds interleaved.

  python experiments/checkpoint_checksum_overhead.py [--rounds 5] [--dir /tmp/ckpt_overhead] [--label disk]
  python experiments/checkpoint_checksum_overhead.py --dir /dev/shm/ckpt_overhead --label tmpfs  # no disk noise

Variants (each through meshtrain.checkpoint.Checkpointer, the code train.py uses):
  before     checksums=False: the format before checksums (Zarr v2 arrays, meta without a digest)
  zarr3      checksums=True, ARRAY_CHECKSUM=None: meshtrain's Zarr v3 arrays without a chunk checksum
  crc32c     checksums=True, ARRAY_CHECKSUM="crc32c": + the Zarr v3 crc32c codec on every chunk
  zstd       checksums=True, ARRAY_CHECKSUM="zstd": + zstd's content checksum on every chunk
(all three checksums=True variants also write the meta item's sha256).
Per round and variant: `save` (the call train.py blocks on: device-to-host copy, async start), `commit` (until
the checkpoint is committed on disk), `restore` (read back into the same shardings, verified when checksummed),
and the CPU seconds of the process (all threads) for commit and restore: on a busy machine the wall times of
disk writes vary by 2x between rounds; the CPU time is what the checksum itself adds.
The Adam moments are filled with random values first: at init they are zeros, which compress to nothing and
would make every variant look free. On a CPU-only machine, 8 simulated devices.
"""
import argparse
import json
import os
import pathlib
import shutil
import statistics
import sys
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")
import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)
import jax.numpy as jnp  # noqa: E402

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
import tensorstore as ts  # noqa: E402
from orbax.checkpoint._src.serialization import tensorstore_utils as ts_utils  # noqa: E402

from meshtrain import checkpoint, config as config_lib, layout as layout_lib, mesh as mesh_lib  # noqa: E402
from meshtrain.checkpoint import integrity  # noqa: E402

VARIANTS = ("before", "zarr3", "crc32c", "zstd")
CHECKSUM = {"before": None, "zarr3": None, "crc32c": "crc32c", "zstd": "zstd"}  # integrity.ARRAY_CHECKSUM


def build_state():
  cfg = config_lib.load(str(pathlib.Path(__file__).resolve().parents[1] / "configs" / "base125m.py"), [])
  layout = layout_lib.build(cfg, mesh_lib.make_mesh(cfg.mesh))
  state = layout.init(0)

  def randomise(state, key):  # dense, high-entropy moments like those of a trained model
    leaves, tree = jax.tree.flatten(state.opt_state)
    keys = jax.random.split(key, len(leaves))
    leaves = [jax.random.normal(k, x.shape, x.dtype) * 1e-3 if jnp.issubdtype(x.dtype, jnp.floating) else x
              for k, x in zip(keys, leaves)]
    return state.replace(opt_state=jax.tree.unflatten(tree, leaves))

  with layout.context():
    state = jax.jit(randomise, out_shardings=layout.state_sharding)(state, jax.random.key(1))
  jax.block_until_ready(state)
  return cfg, layout, state


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--rounds", type=int, default=5)
  parser.add_argument("--dir", default="/tmp/ckpt_overhead", help="where to write (/dev/shm: no disk noise)")
  parser.add_argument("--label", default="disk", help="names the JSON written to benchmarks/results/")
  args = parser.parse_args()
  root = pathlib.Path(args.dir)
  shutil.rmtree(root, ignore_errors=True)

  t0 = time.perf_counter()
  cfg, layout, state = build_state()
  nbytes = sum(x.nbytes for x in jax.tree.leaves(state))
  print(f"state: {nbytes / 1e9:.3f} GB on {jax.device_count()} devices ({time.perf_counter() - t0:.0f} s to build)",
        flush=True)
  meta = {"config": cfg.to_dict(), "layer_order": layout.layer_order, "data": {"next_step": 1}}

  ckpts = {v: checkpoint.Checkpointer(root / v, keep=1, checksums=(v != "before")) for v in VARIANTS}
  assert getattr(ts_utils._build_zarr3_metadata, "meshtrain_checksum", False), "the checksum hook is not installed"
  times = {v: {k: [] for k in ("save", "commit", "restore", "commit_cpu", "restore_cpu")} for v in VARIANTS}
  sizes = {}
  for r in range(args.rounds + 1):  # round 0 warms up (first-use compiles of Orbax's slicing programs)
    order = VARIANTS if r % 2 == 0 else VARIANTS[::-1]
    for v in order:
      integrity.ARRAY_CHECKSUM = CHECKSUM[v]  # read by the hook whenever Orbax builds an array's metadata
      ckpt, step = ckpts[v], r + 1
      t, c = time.perf_counter(), time.process_time()  # process_time: CPU seconds of all the process's threads
      ckpt.save(step, state, meta)
      saved = time.perf_counter()
      ckpt.wait()
      committed, c_committed = time.perf_counter(), time.process_time()
      restored = ckpt.restore_state(step, layout.state_abstract)
      jax.block_until_ready(restored)
      done, c_done = time.perf_counter(), time.process_time()
      del restored
      step_dir = root / v / "checkpoints" / str(step)
      if v != "before":  # the variant wrote what it claims
        store = ts.KvStore.open({"driver": "ocdbt", "base": f"file://{step_dir / 'state'}/"}).result()
        zarr = json.loads(store.read(b"params.embedding/zarr.json").result().value)
        assert integrity.checksum_of(integrity.chunk_codecs(zarr)) == CHECKSUM[v], (v, zarr["codecs"])
      sizes[v] = sum(p.stat().st_size for p in step_dir.rglob("*") if p.is_file())
      shutil.rmtree(step_dir)  # one checkpoint on disk per variant at a time
      ckpt._manager.reload()
      if r:
        for key, value in (("save", saved - t), ("commit", committed - t), ("restore", done - committed),
                           ("commit_cpu", c_committed - c), ("restore_cpu", c_done - c_committed)):
          times[v][key].append(value)
      print(f"round {r}{' (warm-up)' if not r else ''} {v:9s}: save {saved - t:6.2f} s, commit {committed - t:6.2f} s "
            f"(CPU {c_committed - c:6.2f} s), restore {done - committed:6.2f} s (CPU {c_done - c_committed:6.2f} s), "
            f"{sizes[v] / 1e9:.3f} GB on disk", flush=True)
  for ckpt in ckpts.values():
    ckpt.close()

  print(f"\nmedian (min) over {args.rounds} rounds, seconds; checkpoint of {nbytes / 1e9:.3f} GB of state")
  print(f"{'variant':10s} " + " ".join(f"{k:>14s}" for k in times["before"]) + f" {'on disk':>9s}")
  summary = {}
  for v in VARIANTS:
    row = {k: (statistics.median(x), min(x)) for k, x in times[v].items()}
    summary[v] = {k: {"median": m, "min": lo} for k, (m, lo) in row.items()} | {"bytes_on_disk": sizes[v]}
    print(f"{v:10s} " + " ".join(f"{m:7.2f} ({lo:5.2f})" for m, lo in row.values()) + f" {sizes[v] / 1e9:7.3f}GB")
  # Paired within each round (the variants of a round ran back to back), then the median over rounds: the load of
  # a shared machine drifts between rounds more than within one.
  print("\nmedian over rounds of the per-round ratio: checksum vs before (Zarr v2) | vs zarr3 (the checksum alone)")
  for k in times["before"]:
    cells = []
    for v in ("crc32c", "zstd"):
      paired = {base: statistics.median(c / b - 1 for c, b in zip(times[v][k], times[base][k]))
                for base in ("before", "zarr3")}
      summary[v][k] |= {f"paired_vs_{base}": x for base, x in paired.items()}
      cells.append(f"{v} {100 * paired['before']:+6.1f}% | {100 * paired['zarr3']:+6.1f}%")
    print(f"  {k:12s} " + "    ".join(cells))
  results = pathlib.Path(__file__).resolve().parents[1] / "benchmarks" / "results"
  out = results / f"checkpoint_checksum_overhead_{args.label}.json"
  out.parent.mkdir(parents=True, exist_ok=True)
  out.write_text(json.dumps({"rounds": args.rounds, "dir": str(root), "state_bytes": nbytes,
                             "devices": jax.device_count(), "variants": summary}, indent=2))
  shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
  main()
