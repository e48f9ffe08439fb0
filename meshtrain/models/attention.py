"""Causal self-attention on one device's whole sequence (the sequence-split case is meshtrain/parallel/context.py).

Shape suffixes: B batch, L query length, S key length, H query heads, K kv heads, G = H // K query heads per kv
head, E head dim, C query block length. Head h reads kv head h // G, as in `jax.nn.dot_product_attention`.

`model.attention`:
  auto     NVIDIA GPU: `cudnn` when cuDNN's conditions hold for the shapes (`cudnn_unsupported`), else `xla`;
           elsewhere `blocked`. Decided by `resolve`, which layout, bench and plan all call.
  blocked  query blocks that skip the keys after them (below)
  xla      `jax.nn.dot_product_attention(implementation="xla")`: masked [L, L] scores, kept for the backward
  cudnn    `jax.nn.dot_product_attention(implementation="cudnn")`: cuDNN's fused flash attention, no [L, L] scores
`implementation=None` is never passed: in JAX 0.10-0.12 it means XLA, not cuDNN.
"""
import jax
import jax.numpy as jnp
import numpy as np

MIN_BLOCK = 64   # shorter blocks make more, smaller matmuls than they save
MAX_BLOCKS = 8   # each block is its own ops in the HLO: bounded so long sequences do not grow the program


CUDNN_DTYPES = ("bfloat16", "float16")
CUDNN_MAX_HEAD_DIM = 256          # Hopper (compute capability 9.0) and later
CUDNN_MAX_HEAD_DIM_PRE_HOPPER = 128


def cudnn_unsupported(dtype, head_dim: int, num_heads: int, num_kv_heads: int,
                      compute_capability: str | None = None) -> str:
  """Why cuDNN's fused attention cannot run these shapes, or "" when it can.

  The conditions `jax.nn.dot_product_attention(implementation="cudnn")` checks for causal bf16/fp16 attention
  without bias (jax/_src/cudnn/fused_attention_stablehlo.py, check_layout and check_is_flash_attention, JAX
  0.10-0.12): a half-precision dtype; a head dim that is a multiple of 8, at most 256 on Hopper and later and
  128 before; whole groups of query heads per kv head. `compute_capability` ("9.0"; None: unknown, taken as
  Hopper, the GPUs meshtrain is benchmarked on) sets the head-dim limit.
  """
  reasons = []
  if str(jnp.dtype(dtype)) not in CUDNN_DTYPES:
    reasons.append(f"compute dtype {jnp.dtype(dtype)} (cuDNN needs bfloat16 or float16)")
  hopper = compute_capability is None or tuple(map(int, compute_capability.split("."))) >= (9, 0)
  max_e = CUDNN_MAX_HEAD_DIM if hopper else CUDNN_MAX_HEAD_DIM_PRE_HOPPER
  if head_dim > max_e or head_dim % 8:
    reasons.append(f"head_dim={head_dim} (cuDNN needs a multiple of 8, at most {max_e} on compute capability "
                   f"{compute_capability or '9.0'})")
  if num_kv_heads > num_heads or num_heads % num_kv_heads:
    reasons.append(f"num_kv_heads={num_kv_heads} with num_heads={num_heads} (cuDNN needs whole query-head groups)")
  return "; ".join(reasons)


def resolve(impl: str, platform: str, dtype, head_dim: int, num_heads: int, num_kv_heads: int,
            compute_capability: str | None = None) -> str:
  """What `impl` ("auto" included) runs as on `platform` ("cpu", "gpu", "cuda", "tpu"): blocked, xla or cudnn.

  The one place the choice is made: the layout resolves the model's attention with it for the mesh's devices
  (or a named target), bench reports it, and plan's memory model keeps no [L, L] scores only when it says cudnn.
  "gpu" means NVIDIA here: meshtrain installs JAX for CUDA.
  """
  if impl != "auto":
    return impl
  if platform not in ("gpu", "cuda"):
    return "blocked"
  return "xla" if cudnn_unsupported(dtype, head_dim, num_heads, num_kv_heads, compute_capability) else "cudnn"


def query_blocks(length: int) -> int:
  """How many query blocks `blocked` splits a sequence of `length` into: the most (up to MAX_BLOCKS, each at
  least MIN_BLOCK long) that divide it."""
  return max(n for n in range(1, MAX_BLOCKS + 1) if length % n == 0 and (n == 1 or length // n >= MIN_BLOCK))


def causal_attention(q_BLHE, k_BSKE, v_BSKE, impl: str = "auto", window: int = 0):
  """softmax(q k^T / sqrt(E) + causal mask) v, [B, L, H, E] out, in q's dtype. `window` > 0: query i sees keys
  i - window + 1 .. i only (Mistral's sliding window, as transformers masks it); a window >= L changes nothing.

  `impl` is normally resolved already (meshtrain.layout, for its target platform); "auto" is resolved here for
  the platform this process computes on.
  """
  if impl == "auto":
    device = jax.devices()[0]
    impl = resolve(impl, device.platform, q_BLHE.dtype, q_BLHE.shape[-1], q_BLHE.shape[2], k_BSKE.shape[2],
                   getattr(device, "compute_capability", None))
  window = window if 0 < window < q_BLHE.shape[1] else 0
  if impl in ("xla", "cudnn"):
    return jax.nn.dot_product_attention(q_BLHE, k_BSKE, v_BSKE, is_causal=True, implementation=impl,
                                        local_window_size=(window - 1, 0) if window else None)
  return blocked_causal_attention(q_BLHE, k_BSKE, v_BSKE, query_blocks(q_BLHE.shape[1]), window)


def blocked_causal_attention(q_BLHE, k_BSKE, v_BSKE, blocks: int, window: int = 0):
  """Causal attention with the queries in `blocks` blocks, block i reading only keys [0, (i+1) C).

  XLA computes the full [L, L] scores of a causal mask and throws the upper half away; here block i computes
  only what it can see, (n+1)/2n of the work for n blocks (62.5% for 4), forward and backward. Only the diagonal
  block of each row is masked. Scores and softmax in float32 whatever the input dtype.
  """
  B, L, H, E = q_BLHE.shape
  C = L // blocks
  if (G := H // k_BSKE.shape[2]) > 1:
    # Each kv head read by its G query heads as [B, S, H, E]: XLA's CPU matmuls on the grouped 5-d form
    # [B, C, K, G, E] x [B, S, K, E] ran 1.5x slower than on 4-d heads here.
    k_BSHE, v_BSHE = jnp.repeat(k_BSKE, G, axis=2), jnp.repeat(v_BSKE, G, axis=2)
  else:
    k_BSHE, v_BSHE = k_BSKE, v_BSKE
  q_BLHE = q_BLHE * jnp.asarray(1 / np.sqrt(E), q_BLHE.dtype)  # on q: L*E multiplies per head, not L*S
  outs = []
  for i in range(blocks):
    q_BCHE = q_BLHE[:, i * C:(i + 1) * C]
    k_BSHE_i, v_BSHE_i = k_BSHE[:, :(i + 1) * C], v_BSHE[:, :(i + 1) * C]
    s_BHCS = jnp.einsum("BCHE,BSHE->BHCS", q_BCHE, k_BSHE_i, preferred_element_type=jnp.float32)
    # The mask from iotas, computed where it is used: a numpy mask over 1 KiB would be a constant that JAX 0.12
    # hoists into an argument, copied to every device at every call.
    q_CS = i * C + jax.lax.broadcasted_iota(jnp.int32, (C, (i + 1) * C), 0)
    k_CS = jax.lax.broadcasted_iota(jnp.int32, (C, (i + 1) * C), 1)
    visible_CS = k_CS <= q_CS
    if window:  # query i * C + c sees keys from i * C + c - window + 1 on
      visible_CS &= k_CS > q_CS - window
    p_BHCS = jax.nn.softmax(jnp.where(visible_CS, s_BHCS, -jnp.inf), axis=-1)
    outs.append(jnp.einsum("BHCS,BSHE->BCHE", p_BHCS.astype(v_BSHE.dtype), v_BSHE_i))
  return jnp.concatenate(outs, axis=1)


def cached_attention(q_BLHE, k_BKSE, v_BKSE, start_B, end, window: int = 0):
  """Attention of L new tokens over a key/value cache of S slots, for generation (no gradient is taken).

  The new tokens sit at slots end..end+L-1 (`end` a scalar, or [B]: each row's own) and their keys are already written
  there. Row b's own tokens start at slot start_B[b] (left padding before it): query i sees slots start_B[b]..end+i.
  It always sees its own slot, so a padding query (in a prefill of left-padded prompts) has one key instead of none
  (no 0/0); what it computes is never read. Grouped heads without repeating the cache G times: head h reads kv head
  h // G, as in `causal_attention`. The cache is [B, K, S, E] and the queries are moved to [B, K, G*L, E], so both
  matmuls batch over the leading (B, K) and no cache-sized array is transposed. Scores and softmax in float32.
  `window` > 0: query i also sees no slot before end + i - window + 1 (slots and positions differ by start_B, the same
  for a row).
  """
  B, L, H, E = q_BLHE.shape
  K, S = k_BKSE.shape[1], k_BKSE.shape[2]
  G = H // K
  q_BLHE = q_BLHE * jnp.asarray(1 / np.sqrt(E), q_BLHE.dtype)
  q_BKGLE = q_BLHE.reshape(B, L, K, G, E).transpose(0, 2, 3, 1, 4)
  s_BKGLS = jnp.einsum("BKGLE,BKSE->BKGLS", q_BKGLE, k_BKSE.astype(q_BLHE.dtype), preferred_element_type=jnp.float32)
  slot_BL1 = (jnp.reshape(end, (-1, 1)) + jnp.arange(L))[:, :, None]  # end: one slot for all rows, or [B]: each its own
  key_S = jnp.arange(S)
  visible_BLS = ((key_S[None, None, :] >= start_B[:, None, None]) & (key_S[None, None, :] <= slot_BL1)
                 | (key_S[None, None, :] == slot_BL1))
  if window:
    visible_BLS &= key_S[None, None, :] > slot_BL1 - window
  p_BKGLS = jax.nn.softmax(jnp.where(visible_BLS[:, None, None], s_BKGLS, -jnp.inf), axis=-1)
  o_BKGLE = jnp.einsum("BKGLS,BKSE->BKGLE", p_BKGLS.astype(v_BKSE.dtype), v_BKSE)
  return o_BKGLE.transpose(0, 3, 1, 2, 4).reshape(B, L, H, E).astype(q_BLHE.dtype)
