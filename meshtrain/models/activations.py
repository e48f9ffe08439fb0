"""SwiGLU with a hand-written backward, shared by the dense MLP and the experts (elementwise, any shape)."""
import jax


@jax.custom_vjp
def swiglu(gate, up):
  """silu(gate) * up. Its backward keeps only the two inputs (the matmul outputs): autodiff of silu would keep
  sigmoid(gate) and two intermediate products as well, two more [B, L, F] arrays per layer for the whole backward
  pass (compiled memory 11-17% lower for the tiny model without remat)."""
  return jax.nn.silu(gate) * up


def _swiglu_forward(gate, up):
  return swiglu(gate, up), (gate, up)


def _swiglu_backward(residuals, dh):
  gate, up = residuals
  sig = jax.nn.sigmoid(gate)
  # d silu(g) / dg = s + g s (1 - s), with s = sigmoid(g)
  return dh * up * sig * (1 + gate * (1 - sig)), dh * gate * sig


swiglu.defvjp(_swiglu_forward, _swiglu_backward)
