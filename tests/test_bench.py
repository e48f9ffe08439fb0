"""Bench arithmetic: model FLOPs against hand counts, the GPU peak table, and the JSON it prints."""
import json
import subprocess
import sys

import jax
import pytest

from meshtrain import config, layout, mesh
from meshtrain.costs import perf


def hand_flops(L, D, H, K, E, F, V, layers, tied):
  per_layer = D * H * E + 2 * D * K * E + H * E * D + 3 * D * F  # q, k and v, o, gate/up/down
  head = V * D  # the output projection (the tied embedding, or a separate head); lookups are free
  return 6 * (layers * per_layer + head) + 6 * layers * L * H * E  # causal attention at half of 12 L H E


@pytest.mark.parametrize("kv_heads,tied", [(4, False), (2, True)])  # the tiny preset, and a GQA 4:1 tied variant
def test_flops_per_token_match_hand_count(kv_heads, tied):
  cfg = config.base_config()
  cfg.mesh.data = 1
  cfg.model.num_kv_heads, cfg.model.tie_embeddings = kv_heads, tied
  table = layout.build(cfg, mesh.make_mesh(cfg.mesh, devices=jax.devices()[:1])).table
  m = cfg.model
  got = perf.model_flops_per_token(m, cfg.seq_len, perf.matmul_params(table, tied))
  assert got == hand_flops(cfg.seq_len, m.d_model, m.num_heads, kv_heads, m.head_dim, m.mlp_dim, m.vocab_size,
                           m.num_layers, tied)
  if kv_heads == 4 and not tied:
    assert got == 6_586_368  # tiny: 6 x 1,032,192 matmul parameters + 393,216 attention


def test_flops_per_token_moe_counts_routed_experts_only():
  cfg = config.base_config()
  cfg.mesh.data = 1
  cfg.model.num_experts, cfg.model.experts_per_token = 4, 2
  table = layout.build(cfg, mesh.make_mesh(cfg.mesh, devices=jax.devices()[:1])).table
  m = cfg.model
  L, D, H, K, E, F, V, X, k = (cfg.seq_len, m.d_model, m.num_heads, m.num_kv_heads, m.head_dim, m.mlp_dim,
                               m.vocab_size, 4, 2)
  per_layer = D * H * E + 2 * D * K * E + H * E * D + D * X + k * 3 * D * F  # attention, router, k of X experts
  assert perf.model_flops(cfg, table) == 6 * (m.num_layers * per_layer + V * D) + 6 * m.num_layers * L * H * E
  dense = hand_flops(L, D, H, K, E, F, V, m.num_layers, False)
  assert perf.model_flops(cfg, table) == dense + 6 * m.num_layers * (D * X + (k - 1) * 3 * D * F)


def test_gpu_peaks():
  assert perf.gpu_peak("NVIDIA H100 80GB HBM3", "bfloat16") == 989.4e12
  assert perf.gpu_peak("NVIDIA A100-SXM4-80GB", "float32") == 19.5e12
  assert perf.gpu_peak("NVIDIA GeForce RTX 4090", "bfloat16") is None


def test_bench_json(tmp_path):
  proc = subprocess.run([sys.executable, "-m", "meshtrain.bench", "--config", "configs/tiny.py", "--json",
                         "--steps", "2", "--warmup", "1", "--config.seq_len=64"],
                        capture_output=True, text=True, timeout=300)
  assert proc.returncode == 0, proc.stderr[-2000:]
  result = json.loads(proc.stdout.strip().splitlines()[-1])
  for key in ("tokens_per_sec", "step_time_s", "mfu", "peak_flops", "model_flops_per_token", "compile_time_s"):
    assert result[key] > 0, key
  assert result["peak_source"] == "measured matmul" and result["devices"] == 8
  assert result["tokens_per_sec"] == pytest.approx(16 * 64 / result["step_time_s"])
  assert result["mfu"] == pytest.approx(result["model_flops_per_token"] * result["tokens_per_sec"]
                                        / (result["peak_flops"] * 8))
  assert 0 < result["mfu"] < 1
