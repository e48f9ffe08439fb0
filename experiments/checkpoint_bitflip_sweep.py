"""Flip one random bit in each file of a checkpoint, many times, and classify what restoring it then does.

  python experiments/checkpoint_bitflip_sweep.py [--flips 10] [--metadata-flips 40] [--data-flips 50] [--before]
      [--array-checksum zstd|crc32c] [--seed 0]

A checkpoint of the tiny model's train state (Adam moments filled with random values) is written with
meshtrain.checkpoint.Checkpointer; for every file of it (commit markers aside) and every flip, a copy is restored
with `restore_latest` as train.py does. Outcomes:
  damaged     refused, with the reason `restore_latest` gives (exit code 2 in train.py)
  identical   restored, every array and the meta item equal to what was saved (the bit was not used)
  WRONG       restored, something differs: the failure checksums exist to prevent
The table is printed and written to benchmarks/results/checkpoint_bitflip_sweep_<crc32c|zstd>.json (with --before,
a checkpoint in the format before checksums: checkpoint_bitflip_sweep_before.json). On a CPU-only machine, 1 device.
"""
import argparse
import collections
import contextlib
import io
import json
import os
import pathlib
import random
import re
import shutil
import sys
import tempfile

os.environ.setdefault("JAX_PLATFORMS", "cpu")
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
from meshtrain import checkpoint, config as config_lib, layout as layout_lib, mesh as mesh_lib  # noqa: E402
from meshtrain.checkpoint import integrity  # noqa: E402
from meshtrain.errors import UserError  # noqa: E402

STEP = 8


def kind(rel: str, size: int) -> str:
  """Files of one role share a row: data files (random names) by size, array chunks being the large ones."""
  if re.search(r"/d/[0-9a-f]+$", rel):
    return re.sub(r"/d/[0-9a-f]+$", "/d/*", rel) + (" (>= 64 KiB)" if size >= 64 << 10 else " (< 64 KiB)")
  return rel


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--flips", type=int, default=10, help="random flips per file")
  parser.add_argument("--metadata-flips", type=int, default=40, help="random flips in state/_METADATA")
  parser.add_argument("--data-flips", type=int, default=50, help="random flips per data file of 64 KiB or more")
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument("--before", action="store_true", help="write the checkpoint as before checksums (Zarr v2)")
  parser.add_argument("--array-checksum", default=integrity.ARRAY_CHECKSUM, choices=("crc32c", "zstd"))
  args = parser.parse_args()
  root = pathlib.Path(tempfile.mkdtemp(prefix="bitflip_sweep_"))
  integrity.ARRAY_CHECKSUM = args.array_checksum

  cfg = config_lib.load(str(pathlib.Path(__file__).resolve().parents[1] / "configs" / "tiny.py"), [])
  cfg.seq_len = 64
  cfg.mesh.data = 1
  layout = layout_lib.build(cfg, mesh_lib.make_mesh(cfg.mesh, devices=jax.devices()[:1]))
  state = layout.init(0)
  leaves, tree = jax.tree.flatten(state.opt_state)
  keys = jax.random.split(jax.random.key(1), len(leaves))
  state = state.replace(opt_state=jax.tree.unflatten(tree, [
      jax.random.normal(k, x.shape, x.dtype) * 1e-3 if jnp.issubdtype(x.dtype, jnp.floating) else x
      for k, x in zip(keys, leaves)]))
  saved = jax.device_get(state)
  meta = {"config": cfg.to_dict(), "layer_order": layout.layer_order, "data": {"next_step": STEP}}
  ckpt = checkpoint.Checkpointer(root / "src", keep=1, checksums=not args.before)
  ckpt.save(STEP, state, meta)
  ckpt.wait()
  ckpt.close()

  step_dir = root / "src" / "checkpoints" / str(STEP)
  files = sorted(str(p.relative_to(step_dir)) for p in step_dir.rglob("*")
                 if p.is_file() and p.name != "commit_success.txt")
  rng = random.Random(args.seed)
  outcomes = collections.defaultdict(collections.Counter)
  reasons = collections.defaultdict(collections.Counter)
  for rel in files:
    row = kind(rel, (step_dir / rel).stat().st_size)
    mine = collections.Counter()
    flips = args.metadata_flips if rel == "state/_METADATA" else args.data_flips if "64 KiB)" in row and ">=" in row \
        else args.flips
    for _ in range(flips):
      work = root / "work"
      shutil.rmtree(work, ignore_errors=True)
      shutil.copytree(root / "src", work)
      path = work / "checkpoints" / str(STEP) / rel
      data = bytearray(path.read_bytes())
      data[rng.randrange(len(data))] ^= 1 << rng.randrange(8)
      path.write_bytes(bytes(data))
      ckpt = checkpoint.Checkpointer(work, keep=100)
      try:
        with contextlib.redirect_stdout(io.StringIO()):
          _, restored, restored_meta = ckpt.restore_latest(layout.state_abstract, False, lambda s, m: None)
        same = restored_meta == meta and all(jax.tree.leaves(jax.tree.map(
            lambda a, b: bool(np.array_equal(np.asarray(a), b)), jax.device_get(restored), saved)))
        outcome = "identical" if same else "WRONG"
      except UserError as e:
        outcome = "damaged"
        reason = str(e).split("is damaged: ", 1)[-1]
        reasons[row][re.sub(r"[0-9a-f]{6,}|\d+", "#", reason.split(" (")[0])[:80]] += 1
      finally:
        ckpt.close()
      outcomes[row][outcome] += 1
      mine[outcome] += 1
    print(f"{rel:60s} {(step_dir / rel).stat().st_size:9,d} bytes {dict(mine)}", flush=True)

  print(f"\n{'file':52s} {'flips':>6s} {'damaged':>8s} {'identical':>10s} {'WRONG':>6s}")
  for name, counts in outcomes.items():
    print(f"{name:52s} {sum(counts.values()):6d} {counts['damaged']:8d} {counts['identical']:10d} {counts['WRONG']:6d}")
  print("\nreasons given:")
  for name, counter in reasons.items():
    for reason, n in counter.most_common(3):
      print(f"  {name}: {n} x {reason}")
  label = "_before" if args.before else f"_{args.array_checksum}"
  out = pathlib.Path(__file__).resolve().parents[1] / "benchmarks" / "results" / f"checkpoint_bitflip_sweep{label}.json"
  out.parent.mkdir(parents=True, exist_ok=True)
  out.write_text(json.dumps({"seed": args.seed, "before_checksums": args.before,
                             "array_checksum": None if args.before else args.array_checksum, "outcomes": outcomes,
                             "reasons": reasons}, indent=2))
  shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
  main()
