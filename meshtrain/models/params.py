"""Parameters that name their logical axes; meshtrain/sharding.py's rules map those names onto the mesh.

Every parameter of the models is created by `param` below, so `model.init` is decided here:
  normal  normal(init_std) for every matrix; the model files pass a smaller std for output projections.
  fan_in  each weight's own variance-scaling initialiser, described by a `FanIn` its model file passes: what
          MaxText 0.2.5 does for its llama2 decoder (see llama.py for the per-weight mapping), so the peer
          benchmark (experiments/peer_maxtext) starts both systems from the same distribution. llama.py then
          also takes the attention's 1/sqrt(head_dim) out of the softmax, because MaxText puts it in the
          query kernel's init instead.
Norm scales (std None) are ones under both.
"""
import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp

INITS = ("normal", "fan_in")  # also in meshtrain/tasks/lm_config.py, which validates model.init without importing JAX
DISTRIBUTIONS = ("normal", "truncated_normal")


@dataclasses.dataclass(frozen=True)
class FanIn:
  """variance = scale / fan_in, fan_in = the product of the sizes of `in_axes`, drawn from `distribution`.

  Sampled by jax.nn.initializers.variance_scaling, the function MaxText's initialisers call
  (maxtext/layers/initializers.py:46-71), so the distribution is the same by construction, including
  "truncated_normal": a standard normal cut at +-2 and divided by 0.87962566 (its std), which makes the std of
  the samples exactly sqrt(scale / fan_in), with |w| <= 2.27 x that std.
  Axes are those of one layer's kernel (under nn.scan the initialiser never sees the stacked layer axis, as in
  MaxText's per-layer init, maxtext/layers/nnx_scan.py:37-50). `batch_axes` (experts) count neither as input
  nor as output. `in_axes=()` is fan-in 1: std sqrt(scale) whatever the shape (MaxText's token embedding).
  """
  in_axes: tuple[int, ...] = (0,)
  distribution: str = "truncated_normal"
  scale: float = 1.0
  batch_axes: tuple[int, ...] = ()

  def initializer(self):
    if self.distribution not in DISTRIBUTIONS:
      raise ValueError(f"FanIn distribution must be one of {DISTRIBUTIONS}, not {self.distribution!r}")

    def init(key, shape, dtype=jnp.float32):
      # Every axis that is neither input nor batch is an output axis: jax would otherwise count the leftover
      # axes as a convolution's receptive field and multiply them into fan_in.
      out_axes = tuple(a for a in range(len(shape)) if a not in self.in_axes and a not in self.batch_axes)
      return jax.nn.initializers.variance_scaling(self.scale, "fan_in", self.distribution, in_axis=self.in_axes,
                                                  out_axis=out_axes, batch_axis=self.batch_axes)(key, shape, dtype)
    return init


def zeros(module: nn.Module, name: str, shape: tuple[int, ...], logical: tuple, dtype: str):
  """A zero-initialised parameter tagged with `logical` axes (DiT's adaLN-Zero: exact zeros; `param`'s std=None
  is ones, for norm scales)."""
  return module.param(name, nn.with_logical_partitioning(nn.initializers.zeros, logical), shape, jnp.dtype(dtype))


def initializer(init: str, std: float | None, fan_in: FanIn | None):
  """The initialiser of one parameter under `init` (see the module docstring)."""
  if init not in INITS:
    raise ValueError(f"model.init must be one of {INITS}, not {init!r}")
  if init == "normal" or std is None:
    # Exactly the initialiser meshtrain always had, so "normal" reproduces earlier runs bit for bit.
    return nn.initializers.normal(std) if std else nn.initializers.ones
  if fan_in is None:
    raise ValueError("model.init='fan_in' needs a FanIn for every matrix; this parameter passed none")
  return fan_in.initializer()


def param(module: nn.Module, name: str, shape: tuple[int, ...], logical: tuple, std: float | None, dtype: str,
          init: str = "normal", fan_in: FanIn | None = None, perm: tuple[int, ...] | None = None):
  """A parameter initialised by `init` (normal(std), or `fan_in`'s variance scaling; ones when std is None, for
  norm scales), stored in `dtype`, tagged with `logical` axes. `perm`: stored with its axes in this order
  (`shape` and `logical` name them unpermuted); drawn unpermuted and then transposed, so the values are the same."""
  fn = initializer(init, std, fan_in)
  if perm is not None:
    drawn_shape, draw = shape, fn
    fn = lambda key, shape, dtype=jnp.float32: jnp.transpose(draw(key, drawn_shape, dtype), perm)
    shape, logical = tuple(shape[i] for i in perm), tuple(logical[i] for i in perm)
  return module.param(name, nn.with_logical_partitioning(fn, logical), shape, jnp.dtype(dtype))
