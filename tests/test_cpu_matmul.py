"""meshtrain.kernels.cpu_matmul: the decoding products' CPU kernel against a float64 reference, the same bits under any
split of its rows (devices, threads), the split kept (no gather), and XLA's dot where it cannot be built."""
import logging

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from meshtrain.kernels import cpu_matmul
from meshtrain.mesh import make_mesh

# Every tail of the kernel: rows of x by 4 with AVX2, by 8 with AVX-512 (1-7 left), rows of w by 3 (1-2 left), k by
# 8 or 16 (1-15 left), and the split over threads (the 50304-row output projection of the 125m model at decoding's
# batch 8).
SHAPES = [(1, 1, 1), (2, 2, 7), (3, 4, 8), (4, 5, 9), (5, 7, 15), (7, 3, 16), (8, 100, 64), (9, 4, 17), (13, 31, 200),
          (15, 5, 33), (16, 6, 31), (8, 50304, 768)]


def uses_kernel(f, *args) -> bool:
  return "meshtrain_matmul_nt" in jax.jit(f).lower(*args).compile().as_text()


@pytest.mark.parametrize("T,N,K", SHAPES)
def test_equals_float64_reference(T, N, K):
  rng = np.random.default_rng(T * 1000 + N + K)
  x = rng.standard_normal((T, K), np.float32)
  w = rng.standard_normal((N, K), np.float32)
  assert cpu_matmul.available(), "the kernel did not build here (see the warning above)"
  assert uses_kernel(cpu_matmul.matmul_nt, x, w)
  y = np.asarray(jax.jit(cpu_matmul.matmul_nt)(x, w))
  ref = x.astype(np.float64) @ w.astype(np.float64).T
  # float32 sums of K products of unit normals: error ~ eps * sqrt(K) * |x||w|, far below this bound.
  bound = 1e-6 * K * np.sqrt(K) + 1e-6
  assert y.shape == (T, N) and np.abs(y - ref).max() <= bound, np.abs(y - ref).max()


@pytest.mark.parametrize("x_spec,w_spec,y_spec", [
    (P("data", None), P("tensor", None), P("data", "tensor")),   # batch and output features split: kept
    (P(None, None), P("tensor", "data"), P(None, "tensor")),     # contraction split (fsdp's weights): gathered
    (P(None, "tensor"), P(None, None), P(None, None)),
    (P("data", None), P("data", "tensor"), None),  # batch and weight's rows on one axis (fsdp): no crash, same bits
    (P(("data", "tensor"), None), P(None, None), P(("data", "tensor"), None)),
])
def test_split_rows_give_the_same_bits(x_spec, w_spec, y_spec):
  """Each output is one dot product summed in the same order whichever device or thread computes it."""
  mesh = make_mesh({"data": 2, "tensor": 4})
  rng = np.random.default_rng(0)
  x = rng.standard_normal((8, 768), np.float32)
  w = rng.standard_normal((1200, 768), np.float32)
  one = np.asarray(jax.jit(cpu_matmul.matmul_nt)(x, w))
  xs, ws = jax.device_put(x, NamedSharding(mesh, x_spec)), jax.device_put(w, NamedSharding(mesh, w_spec))
  compiled = jax.jit(cpu_matmul.matmul_nt).lower(xs, ws).compile()
  hlo = compiled.as_text()
  assert "meshtrain_matmul_nt" in hlo
  y = compiled(xs, ws)
  assert y_spec is None or y.sharding.is_equivalent_to(NamedSharding(mesh, y_spec), 2), y.sharding
  np.testing.assert_array_equal(np.asarray(y), one)
  # Each device computed its own block only: the kernel ran on [8/2, 768] x [1200/4, 768] where both are split.
  if (x_spec, w_spec) == (P("data", None), P("tensor", None)):
    assert "f32[4,300]{1,0} custom-call(" in hlo, hlo


def test_without_a_compiler_falls_back_to_xla(monkeypatch, tmp_path, caplog):
  monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))
  monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
  cpu_matmul.available.cache_clear()
  try:
    with caplog.at_level(logging.WARNING, logger="meshtrain.kernels.cpu_matmul"):
      assert not cpu_matmul.available()
    assert "uses XLA's dot instead" in caplog.text
    x = np.ones((2, 16), np.float32)
    w = np.full((3, 16), 0.5, np.float32)
    assert not uses_kernel(cpu_matmul.matmul_nt, x, w)
    np.testing.assert_array_equal(np.asarray(jax.jit(cpu_matmul.matmul_nt)(x, w)), np.full((2, 3), 8.0))
  finally:
    cpu_matmul.available.cache_clear()
