"""Single-device attention pieces against float64 references: blocked causal attention, rotary embeddings, and
the unrolled layer stack against the loop."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from meshtrain import config as config_lib, layout as layout_lib, mesh as mesh_lib
from meshtrain.models import attention
from meshtrain.models.llama import ModelConfig
from meshtrain.models.rope import rotary

ROPE = ModelConfig(vocab_size=1, num_layers=1, d_model=8, num_heads=1, num_kv_heads=1, head_dim=8, mlp_dim=8)


def reference_attention(q, k, v):
  """Causal softmax attention in float64 NumPy, grouped-query: head h reads kv head h // (H // K)."""
  q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
  B, L, H, E = q.shape
  G = H // k.shape[2]
  k, v = np.repeat(k, G, axis=2), np.repeat(v, G, axis=2)
  s = np.einsum("blhe,bshe->bhls", q, k) / np.sqrt(E)
  s = np.where(np.tril(np.ones((L, L), bool)), s, -np.inf)
  p = np.exp(s - s.max(-1, keepdims=True))
  p /= p.sum(-1, keepdims=True)
  return np.einsum("bhls,bshe->blhe", p, v)


@pytest.mark.parametrize("blocks", [1, 2, 4, 8])
@pytest.mark.parametrize("kv_heads", [4, 2])
def test_blocked_attention_matches_float64(blocks, kv_heads):
  rng = np.random.default_rng(blocks + kv_heads)
  q = rng.standard_normal((2, 64, 4, 16)).astype(np.float32)
  k, v = (rng.standard_normal((2, 64, kv_heads, 16)).astype(np.float32) for _ in range(2))
  out = attention.blocked_causal_attention(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), blocks)
  np.testing.assert_allclose(out, reference_attention(q, k, v), rtol=2e-5, atol=2e-6)
  # Gradients equal those of XLA's masked [L, L] attention (same float32 math, other order of operations).
  ct = rng.standard_normal(q.shape).astype(np.float32)
  grads = lambda f: jax.grad(lambda q, k, v: jnp.sum(f(q, k, v) * ct), argnums=(0, 1, 2))(q, k, v)
  full = grads(lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="xla"))
  for got, want in zip(grads(lambda q, k, v: attention.blocked_causal_attention(q, k, v, blocks)), full):
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)


def test_blocked_attention_skips_the_masked_work():
  # XLA's own FLOP count of the compiled forward: 4 query blocks do (4+1)/(2*4) of the square's score and value
  # matmuls (the projections are not part of this function).
  x = jnp.zeros((2, 256, 4, 64))
  flops = lambda f: jax.jit(f).lower(x, x, x).compile().cost_analysis()["flops"]
  full = flops(lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="xla"))
  blocked = flops(lambda q, k, v: attention.blocked_causal_attention(q, k, v, 4))
  matmuls = 2 * 2 * 2 * 4 * 256 * 256 * 64  # QK^T and PV: 2 matmuls x 2 FLOPs x B x H x L x S x E
  assert full >= matmuls
  assert blocked / full == pytest.approx(5 / 8, abs=0.05)


def test_block_count():
  # The implementation choice (blocked here, cuDNN or XLA on GPUs) is tested in tests/test_gpu_ready.py.
  assert [attention.query_blocks(n) for n in (64, 100, 128, 256, 4096)] == [1, 1, 2, 4, 8]


def test_rotary_matches_float64():
  rng = np.random.default_rng(0)
  x = rng.standard_normal((2, 16, 3, 8)).astype(np.float32)
  pos = np.array([3, 0, 7, 1, 15, 2, 9, 4, 11, 5, 13, 6, 8, 10, 12, 14])  # any order: positions, not indices
  freq = 10_000.0 ** (-np.arange(4) * 2 / 8)
  angle = pos[:, None] * freq
  x1, x2 = np.split(x.astype(np.float64), 2, axis=-1)
  cos, sin = np.cos(angle)[None, :, None], np.sin(angle)[None, :, None]
  want = np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
  np.testing.assert_allclose(rotary(jnp.asarray(x), jnp.asarray(pos), ROPE), want, rtol=1e-5, atol=1e-6)


def test_unrolled_stack_matches_the_loop():
  # tiny's 4 layers are unrolled by default (model.scan_unroll=0); the loop (1) is the same function.
  def run(unroll):
    cfg = config_lib.load("configs/tiny.py", ["--config.mesh.data=1", "--config.cpu_devices=1",
                                              f"--config.model.scan_unroll={unroll}"])
    layout = layout_lib.build(cfg, mesh_lib.make_mesh(cfg.mesh, devices=jax.devices()[:1]))
    state, step = layout.init(cfg.seed), layout.compile_train_step()
    tokens = np.random.default_rng(0).integers(3, cfg.model.vocab_size, (cfg.batch_size, cfg.seq_len + 1))
    batch = {"inputs": tokens[:, :-1].astype(np.int32), "targets": tokens[:, 1:].astype(np.int32)}
    losses = []
    for _ in range(3):
      state, metrics = step(state, jax.device_put(batch, layout.batch_sharding))
      losses.append(float(metrics["loss"]))
    return np.array(losses), jax.device_get(state.params)
  (loop_losses, loop_params), (unrolled_losses, unrolled_params) = run(1), run(0)
  assert loop_losses[-1] < loop_losses[0]
  np.testing.assert_allclose(unrolled_losses, loop_losses, rtol=1e-5)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6), unrolled_params, loop_params)
