"""Context-parallel attention against plain attention on the full, unsharded sequence."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

from meshtrain.parallel.context import _ring, causal_block_counts, sequence_sharded_attention, zigzag_permutation

B, L, H, K, E = 4, 32, 4, 2, 8
TOL = dict(rtol=1e-5, atol=1e-5)  # float32; the observed worst error is about 2e-6
# Test-only compile settings: unoptimised CPU code compiles ~3x faster, and these shapes run in microseconds.
FAST = {"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True}


def _mesh(n):
  """8 devices: `sequence` = n, the rest over data (batch) and tensor (heads), which stay automatic."""
  data = min(2, 8 // n)
  return jax.make_mesh((data, 8 // n // data, n), ("data", "tensor", "sequence"),
                       axis_types=(AxisType.Auto,) * 3)


def _order(name, n):
  """Token order per batch row, (B, L): row b holds original tokens perm[b] (and they keep those positions)."""
  zigzag = zigzag_permutation(L, n)[0]
  if name == "mixed":  # a different order in every row, so rows on one device skip different tiles
    return np.stack([np.arange(L), zigzag, np.arange(L)[::-1], np.random.default_rng(0).permutation(L)])
  return np.broadcast_to(zigzag if name == "zigzag" else np.arange(L), (B, L))


@pytest.fixture(scope="module")
def inputs():
  rng = np.random.default_rng(0)
  return tuple(jnp.asarray(rng.standard_normal(shape), jnp.float32)
               for shape in ((B, L, H, E), (B, L, K, E), (B, L, K, E), (B, L, H, E)))


def _out_and_grads(attend, q, k, v, ct):
  out, vjp = jax.vjp(attend, q, k, v)
  return (out,) + vjp(ct)


@pytest.fixture(scope="module")
def reference(inputs):
  """Outputs and gradients of plain attention on the full sequence, per causal flag."""
  full = lambda causal: jax.jit(lambda q, k, v, ct: _out_and_grads(
      lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=causal), q, k, v, ct))(*inputs)
  return {causal: full(causal) for causal in (True, False)}


@functools.lru_cache
def _compiled(n, causal):
  """Both implementations' outputs and q/k/v gradients, in original token order, for a token order passed in.

  The order is an argument, not a constant, so one compile serves every order for a shard count.
  """
  mesh = _mesh(n)
  act, pos_sharding = NamedSharding(mesh, P("data", "sequence", "tensor")), NamedSharding(mesh, P("data", "sequence"))
  take = lambda x, idx_BL: jnp.take_along_axis(x, idx_BL[:, :, None, None], axis=1)

  def run(q, k, v, ct, perm_BL, inv_BL):
    def attend(impl, q, k, v):  # permute, shard the sequence, attend, un-permute: comparable to the reference
      q, k, v = (jax.lax.with_sharding_constraint(take(x, perm_BL), act) for x in (q, k, v))
      pos_BL = jax.lax.with_sharding_constraint(perm_BL, pos_sharding)
      return take(sequence_sharded_attention(q, k, v, pos_BL, mesh=mesh, impl=impl, causal=causal), inv_BL)
    return [_out_and_grads(functools.partial(attend, impl), q, k, v, ct) for impl in ("ring", "allgather")]

  args = [jax.ShapeDtypeStruct(s, jnp.float32) for s in ((B, L, H, E), (B, L, K, E), (B, L, K, E), (B, L, H, E))]
  return jax.jit(run).lower(*args, *[jax.ShapeDtypeStruct((B, L), jnp.int32)] * 2).compile(FAST)


# Without a mask the ring never looks at positions, so token order only matters (and is varied) when causal.
@pytest.mark.parametrize("n,causal,order", [(n, True, o) for n in (2, 4, 8) for o in ("contiguous", "zigzag")]
                         + [(4, True, "mixed")] + [(n, False, "contiguous") for n in (2, 4, 8)])
def test_matches_full_attention(inputs, reference, n, causal, order):
  """Outputs and q/k/v gradients of ring and all-gather attention equal attention on the full sequence."""
  perm = _order(order, n)
  got = _compiled(n, causal)(*inputs, jnp.asarray(perm, jnp.int32), jnp.asarray(np.argsort(perm, axis=1), jnp.int32))
  for impl, result in zip(("ring", "allgather"), got):
    for name, g, w in zip(("out", "dq", "dk", "dv"), result, reference[causal]):
      np.testing.assert_allclose(g, w, **TOL, err_msg=f"{impl} {name}")


@pytest.mark.parametrize("n", [2, 4, 8])
def test_zigzag_balances_causal_work(n):
  """Zigzag: every device computes 2n + 1 tile pairs; contiguous: 4i + 3, the last device almost twice as many."""
  assert causal_block_counts(zigzag_permutation(L, n)[0], n).tolist() == [2 * n + 1] * n
  assert causal_block_counts(np.arange(L), n).tolist() == [4 * i + 3 for i in range(n)]


def test_ring_skips_what_the_count_says():
  """The ring's own count of computed tile pairs matches `causal_block_counts`.

  Also the ring inside a shard_map manual over every axis: batch row 0 (contiguous) on data shard 0, row 1
  (zigzag) on data shard 1, so the two halves of the mesh skip different tiles.
  """
  n, mesh = 4, _mesh(4)  # data 2, tensor 1, sequence 4
  act, pos = P("data", "sequence", "tensor"), P("data", "sequence")
  ring = jax.shard_map(lambda q, k, v, p: _ring(q, k, v, p, p, axis_name="sequence", causal=True, tiles=2),
                       mesh=mesh, in_specs=(act, act, act, pos), out_specs=(act, P(("data", "tensor", "sequence"))))
  perm_BL = np.stack([_order("contiguous", n)[0], _order("zigzag", n)[0]])
  args = jnp.ones((2, L, H, E)), jnp.ones((2, L, K, E)), jnp.ones((2, L, K, E)), jnp.asarray(perm_BL, jnp.int32)
  _, work = jax.jit(ring).lower(*args).compile(FAST)(*args)
  assert work.reshape(2, n).tolist() == [causal_block_counts(p, n).tolist() for p in perm_BL]


@pytest.mark.parametrize("n", [1, 2, 4, 8])
def test_zigzag_permutation_round_trips(n):
  perm, inv = zigzag_permutation(L, n)
  assert sorted(perm.tolist()) == list(range(L))
  assert (perm[inv] == np.arange(L)).all() and (inv[perm] == np.arange(L)).all()
  c = L // (2 * n)
  for i, device_PC in enumerate(perm.reshape(n, 2, c)):  # device i holds chunks i and 2n-1-i, in that order
    assert device_PC.tolist() == [list(range(i * c, (i + 1) * c)), list(range((2 * n - 1 - i) * c, (2 * n - i) * c))]
  with pytest.raises(ValueError):
    zigzag_permutation(L + 2, 4)
