"""Parameters that name their logical axes; meshtrain/sharding.py's rules map those names onto the mesh."""
import flax.linen as nn
import jax.numpy as jnp


def param(module: nn.Module, name: str, shape: tuple[int, ...], logical: tuple, std: float | None, dtype: str):
  """normal(std) init (ones when std is None, for norm scales), stored in `dtype`, tagged with `logical` axes."""
  init = nn.initializers.normal(std) if std else nn.initializers.ones
  return module.param(name, nn.with_logical_partitioning(init, logical), shape, jnp.dtype(dtype))
