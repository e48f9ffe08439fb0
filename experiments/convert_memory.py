"""Peak memory of `python -m meshtrain.convert` from-hf and to-hf on a preset's shapes, against the weight bytes.

  python experiments/convert_memory.py --preset 1b --dir /tmp/convert_memory
  python experiments/convert_memory.py --preset 8b --dir /tmp/convert_memory   # 16 GB of bf16 weights, 3x on disk

Writes random bfloat16 weights of the preset's shapes as a Hugging Face LlamaForCausalLM directory (5 GB shards
with an index, as save_pretrained writes large models; the bits are random, so nothing compresses), then runs
from-hf and to-hf as subprocesses, sampling /proc/PID/status every 50 ms: VmHWM (peak resident set, what
`/usr/bin/time -v` reports as maximum resident set size) and the peaks of RssAnon (the process's own memory) and
RssFile (pages of mapped files: safetensors reads through mmap; those pages are page cache the kernel can drop).
A conversion holding two copies of the model would peak at >= 2x the weight bytes. Finally the round trip is
checked exact on a sample of tensors.
"""
import argparse
import json
import pathlib
import shutil
import subprocess
import sys
import time

import ml_dtypes
import numpy as np
from safetensors import safe_open
from safetensors.numpy import save_file

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
from meshtrain import presets  # noqa: E402

SHARD_BYTES = 5 << 30


def hf_shapes(m) -> dict:
  D, H, K, E, F, V = m.d_model, m.num_heads, m.num_kv_heads, m.head_dim, m.mlp_dim, m.vocab_size
  shapes = {"model.embed_tokens.weight": (V, D)}
  for i in range(m.num_layers):
    p = f"model.layers.{i}."
    shapes.update({p + "input_layernorm.weight": (D,), p + "self_attn.q_proj.weight": (H * E, D),
                   p + "self_attn.k_proj.weight": (K * E, D), p + "self_attn.v_proj.weight": (K * E, D),
                   p + "self_attn.o_proj.weight": (D, H * E), p + "post_attention_layernorm.weight": (D,),
                   p + "mlp.gate_proj.weight": (F, D), p + "mlp.up_proj.weight": (F, D),
                   p + "mlp.down_proj.weight": (D, F)})
  shapes["model.norm.weight"] = (D,)
  if not m.tie_embeddings:
    shapes["lm_head.weight"] = (V, D)
  return shapes


def random_bf16(shape, rng) -> np.ndarray:
  """Random finite bfloat16 values of magnitude 2^-7..2^-6, from random bits (fast: no normal draws)."""
  bits = np.frombuffer(rng.bytes(2 * int(np.prod(shape))), np.uint16).reshape(shape)
  return ((bits & np.uint16(0x807F)) | np.uint16(0x3C00)).view(ml_dtypes.bfloat16)


def write_hf(directory: pathlib.Path, m) -> int:
  directory.mkdir(parents=True)
  rng = np.random.default_rng(0)
  shapes = hf_shapes(m)
  groups, current, size = [], [], 0
  for name, shape in shapes.items():
    nbytes = 2 * int(np.prod(shape))
    if current and size + nbytes > SHARD_BYTES:
      groups.append(current)
      current, size = [], 0
    current.append(name)
    size += nbytes
  groups.append(current)
  weight_map = {}
  for i, names in enumerate(groups):
    file = f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors"
    save_file({n: random_bf16(shapes[n], rng) for n in names}, str(directory / file), metadata={"format": "pt"})
    weight_map.update({n: file for n in names})
  total = sum(2 * int(np.prod(s)) for s in shapes.values())
  (directory / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": total},
                                                                      "weight_map": weight_map}))
  (directory / "config.json").write_text(json.dumps({
      "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": m.vocab_size,
      "hidden_size": m.d_model, "intermediate_size": m.mlp_dim, "num_hidden_layers": m.num_layers,
      "num_attention_heads": m.num_heads, "num_key_value_heads": m.num_kv_heads, "head_dim": m.head_dim,
      "hidden_act": "silu", "max_position_embeddings": 8192, "rms_norm_eps": 1e-5,
      "rope_parameters": {"rope_type": "default", "rope_theta": m.rope_theta},
      "tie_word_embeddings": m.tie_embeddings, "attention_bias": False, "mlp_bias": False, "dtype": "bfloat16"}))
  return total


def measure(cmd: list[str]) -> dict:
  """Runs `cmd`, sampling its memory; returns peaks in bytes and the wall time."""
  start = time.perf_counter()
  proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
  peaks = {"VmHWM": 0, "RssAnon": 0, "RssFile": 0}
  status = pathlib.Path(f"/proc/{proc.pid}/status")
  while proc.poll() is None:
    try:
      for line in status.read_text().splitlines():
        key, _, value = line.partition(":")
        if key in peaks:
          peaks[key] = max(peaks[key], int(value.split()[0]) * 1024)
    except (FileNotFoundError, ProcessLookupError):
      break
    time.sleep(0.05)
  output = proc.communicate()[0]
  if proc.returncode:
    raise SystemExit(f"{' '.join(cmd)} failed ({proc.returncode}):\n{output[-3000:]}")
  return {**peaks, "wall_s": time.perf_counter() - start}


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--preset", default="1b", choices=presets.PRESETS)
  parser.add_argument("--dir", default="/tmp/convert_memory")
  parser.add_argument("--keep", action="store_true", help="keep the directories written")
  args = parser.parse_args()
  root = pathlib.Path(args.dir)
  shutil.rmtree(root, ignore_errors=True)
  m = presets.model_config(args.preset)
  t = time.perf_counter()
  weight_bytes = write_hf(root / "hf", m)
  print(f"preset {args.preset}: {weight_bytes / 1e9:.2f} GB of bfloat16 weights written in "
        f"{time.perf_counter() - t:.0f}s", flush=True)
  rows = []
  for name, cmd in (("from-hf", ["from-hf", str(root / "hf"), "--workdir", str(root / "w")]),
                    ("to-hf", ["to-hf", "--workdir", str(root / "w"), "--out", str(root / "back")])):
    r = measure([sys.executable, "-m", "meshtrain.convert", *cmd])
    rows.append((name, r))
    print(f"{name:8s} wall {r['wall_s']:6.1f}s  peak RSS (VmHWM) {r['VmHWM'] / 1e9:6.2f} GB = "
          f"{r['VmHWM'] / weight_bytes:.2f}x weights;  peak RssAnon {r['RssAnon'] / 1e9:6.2f} GB = "
          f"{r['RssAnon'] / weight_bytes:.2f}x;  peak RssFile {r['RssFile'] / 1e9:5.2f} GB", flush=True)
  index = json.loads((root / "back" / "model.safetensors.index.json").read_text())["weight_map"] if (
      root / "back" / "model.safetensors.index.json").exists() else None
  src_map = json.loads((root / "hf" / "model.safetensors.index.json").read_text())["weight_map"]
  for name in ["model.embed_tokens.weight", "model.layers.0.self_attn.q_proj.weight",
               f"model.layers.{m.num_layers - 1}.mlp.down_proj.weight", "model.norm.weight"]:
    back = root / "back" / (index[name] if index else "model.safetensors")
    with safe_open(str(root / "hf" / src_map[name]), "np") as a, safe_open(str(back), "np") as b:
      assert np.array_equal(a.get_tensor(name), b.get_tensor(name)), name
  print("round trip exact on the sampled tensors")
  if not args.keep:
    shutil.rmtree(root)


if __name__ == "__main__":
  main()
