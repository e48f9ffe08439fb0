"""Causal self-attention on one device's whole sequence (the sequence-split case is meshtrain/parallel/context.py).

Shape suffixes: B batch, L query length, S key length, H query heads, K kv heads, G = H // K query heads per kv
head, E head dim, C query block length. Head h reads kv head h // G, as in `jax.nn.dot_product_attention`.

`model.attention`:
  auto     GPU: `jax.nn.dot_product_attention` (cuDNN's fused kernel with bf16); elsewhere `blocked`
  blocked  query blocks that skip the keys after them (below)
  xla, cudnn  `jax.nn.dot_product_attention` with that implementation
"""
import jax
import jax.numpy as jnp
import numpy as np

MIN_BLOCK = 64   # shorter blocks make more, smaller matmuls than they save
MAX_BLOCKS = 8   # each block is its own ops in the HLO: bounded so long sequences do not grow the program


def resolve(impl: str, platform: str) -> str:
  """The implementation `impl` ("auto" included) runs as on `platform` ("cpu", "gpu", ...)."""
  if impl != "auto":
    return impl
  return "fused" if platform == "gpu" else "blocked"


def query_blocks(length: int) -> int:
  """How many query blocks `blocked` splits a sequence of `length` into: the most (up to MAX_BLOCKS, each at
  least MIN_BLOCK long) that divide it."""
  return max(n for n in range(1, MAX_BLOCKS + 1) if length % n == 0 and (n == 1 or length // n >= MIN_BLOCK))


def causal_attention(q_BLHE, k_BSKE, v_BSKE, impl: str = "auto"):
  """softmax(q k^T / sqrt(E) + causal mask) v, [B, L, H, E] out, in q's dtype."""
  impl = resolve(impl, jax.default_backend())
  if impl != "blocked":
    return jax.nn.dot_product_attention(q_BLHE, k_BSKE, v_BSKE, is_causal=True,
                                        implementation=None if impl == "fused" else impl)
  return blocked_causal_attention(q_BLHE, k_BSKE, v_BSKE, query_blocks(q_BLHE.shape[1]))


def blocked_causal_attention(q_BLHE, k_BSKE, v_BSKE, blocks: int):
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
  diagonal_CC = np.tril(np.ones((C, C), bool))
  outs = []
  for i in range(blocks):
    q_BCHE = q_BLHE[:, i * C:(i + 1) * C]
    k_BSHE_i, v_BSHE_i = k_BSHE[:, :(i + 1) * C], v_BSHE[:, :(i + 1) * C]
    s_BHCS = jnp.einsum("BCHE,BSHE->BHCS", q_BCHE, k_BSHE_i, preferred_element_type=jnp.float32)
    visible_CS = np.concatenate([np.ones((C, i * C), bool), diagonal_CC], axis=1)
    p_BHCS = jax.nn.softmax(jnp.where(visible_CS, s_BHCS, -jnp.inf), axis=-1)
    outs.append(jnp.einsum("BHCS,BSHE->BCHE", p_BHCS.astype(v_BSHE.dtype), v_BSHE_i))
  return jnp.concatenate(outs, axis=1)
