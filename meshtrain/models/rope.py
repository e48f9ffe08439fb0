"""Rotary position embedding and its context-extension scalings, as Hugging Face transformers computes them.

`model.rope_type`:
  default  frequencies theta^(-2i/E), i = 0..E/2-1
  linear   every frequency divided by rope_factor (position interpolation)
  llama3   Llama 3.1+: wavelengths longer than rope_original_max_len / rope_low_freq_factor divided by rope_factor,
           shorter than rope_original_max_len / rope_high_freq_factor kept, a smooth blend between
  yarn     YaRN: a per-frequency ramp between the interpolated (/ rope_factor) and the original frequency, from
           rope_beta_fast to rope_beta_slow rotations over rope_original_max_len (the correction range floored and
           ceiled, transformers' `truncate: true`), and cos/sin multiplied by the attention factor
           (rope_attention_factor; 0: transformers' default 0.1 ln(rope_factor) + 1)
The formulas are transformers' (modeling_rope_utils.py: _compute_linear_scaling_rope_parameters,
_compute_llama3_parameters, _compute_yarn_parameters, 5.x), computed once on the host in float64 and rounded to
float32; tests/test_convert.py checks converted models' logits against transformers itself.
"""
import math

import jax
import jax.numpy as jnp
import numpy as np

ROPE_TYPES = ("default", "linear", "llama3", "yarn")  # also in meshtrain/tasks/lm_config.py (JAX-free)


def scaled_frequencies(c, E: int) -> tuple[np.ndarray | None, float]:
  """(the E/2 rotary frequencies as a float32 constant, or None for the default ones, which `rotary` computes
  on the device as it always has; the factor cos and sin are multiplied by) for ModelConfig `c`."""
  if c.rope_type == "default":
    return None, 1.0
  inv_freq = 1.0 / c.rope_theta ** (np.arange(0, E, 2, dtype=np.float64) / E)
  factor = c.rope_factor
  if c.rope_type == "linear":
    return (inv_freq / factor).astype(np.float32), 1.0
  if c.rope_type == "llama3":
    old_len, low, high = c.rope_original_max_len, c.rope_low_freq_factor, c.rope_high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = np.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < old_len / high) & ~(wavelen > old_len / low)
    return np.where(medium, smoothed, scaled).astype(np.float32), 1.0
  if c.rope_type == "yarn":
    def correction_dim(rotations):
      return E * math.log(c.rope_original_max_len / (rotations * 2 * math.pi)) / (2 * math.log(c.rope_theta))
    lo = max(math.floor(correction_dim(c.rope_beta_fast)), 0)
    hi = min(math.ceil(correction_dim(c.rope_beta_slow)), E - 1)
    ramp = np.clip((np.arange(E // 2, dtype=np.float64) - lo) / ((hi + 0.001 if lo == hi else hi) - lo), 0, 1)
    extrapolate = 1 - ramp
    inv_freq = inv_freq / factor * (1 - extrapolate) + inv_freq * extrapolate
    attention = c.rope_attention_factor or (0.1 * math.log(factor) + 1.0 if factor > 1 else 1.0)
    return inv_freq.astype(np.float32), float(attention)
  raise ValueError(f"model.rope_type must be one of {ROPE_TYPES}, not {c.rope_type!r}")


def frequencies(c, E: int):
  """The E/2 rotary frequencies [F] (float32) and the cos/sin factor."""
  scaled, attention = scaled_frequencies(c, E)
  if scaled is None:
    return c.rope_theta ** (-jnp.arange(0, E // 2, dtype=jnp.float32) * 2 / E), attention
  return jnp.asarray(scaled), attention


def rotary(x_BLHE, pos_L, c):
  """Rotary position embedding on the two halves of each head, at each token's position in its sequence:
  (x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin), frequencies and factor from ModelConfig `c`. Positions [L] (one
  for all rows, training) or [B, L] (each row its own, generation from left-padded prompts)."""
  if pos_L.ndim == 2:
    return _rotary_per_row(x_BLHE, pos_L, c)
  B, L, H, E = x_BLHE.shape
  freq_F, attention = frequencies(c, E)  # F = E / 2 frequencies
  angle_LF = pos_L.astype(jnp.float32)[:, None] * freq_F[None, :]
  # The barrier makes XLA keep the [L, F] tables in memory: without it the CPU backend fuses sine and cosine
  # into every [B, L, H, F] consumer, forward and backward, computing each B*H times.
  sin_LF, cos_LF = jax.lax.optimization_barrier(_tables(angle_LF, attention))
  cos_L12F = jnp.stack([cos_LF, cos_LF], axis=1)[:, None]
  sin_L12F = jnp.stack([-sin_LF, sin_LF], axis=1)[:, None]
  # The halves as an axis of 2, swapped by reversing it: one elementwise fusion forward and backward, where
  # split + concatenate made XLA's CPU backend copy both halves (slower forward and backward).
  x_BLH2F = x_BLHE.astype(jnp.float32).reshape(B, L, H, 2, E // 2)
  out_BLH2F = x_BLH2F * cos_L12F + x_BLH2F[..., ::-1, :] * sin_L12F
  return out_BLH2F.reshape(B, L, H, E).astype(x_BLHE.dtype)


def _tables(angle, attention: float):
  """sin and cos of `angle`, times the attention factor (YaRN) when it is not 1."""
  if attention == 1.0:
    return jnp.sin(angle), jnp.cos(angle)
  return jnp.sin(angle) * attention, jnp.cos(angle) * attention


def _rotary_per_row(x_BLHE, pos_BL, c):
  """`rotary` with a position per row and column: the same arithmetic (halves as an axis of 2) on [B, L] tables.
  A separate function so the training path's program is exactly what it was."""
  B, L, H, E = x_BLHE.shape
  freq_F, attention = frequencies(c, E)
  angle_BLF = pos_BL.astype(jnp.float32)[:, :, None] * freq_F
  sin_BLF, cos_BLF = _tables(angle_BLF, attention)
  cos_BL12F = jnp.stack([cos_BLF, cos_BLF], axis=2)[:, :, None]
  sin_BL12F = jnp.stack([-sin_BLF, sin_BLF], axis=2)[:, :, None]
  x_BLH2F = x_BLHE.astype(jnp.float32).reshape(B, L, H, 2, E // 2)
  out_BLH2F = x_BLH2F * cos_BL12F + x_BLH2F[..., ::-1, :] * sin_BL12F
  return out_BLH2F.reshape(B, L, H, E).astype(x_BLHE.dtype)
