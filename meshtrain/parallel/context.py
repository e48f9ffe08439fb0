"""Context parallelism: attention over a sequence whose length dimension is sharded over one mesh axis.

Shape suffixes: B batch, L query length, S key length, H query heads, K kv heads, G = H // K query heads per
kv head, E head dim. Head h reads kv head h // G, as in `jax.nn.dot_product_attention`.

Masking is by token positions, never by array index: a query sees a key when `q_pos >= k_pos` (causal) or
always (not causal). So any assignment of tokens to devices is correct, and a load-balanced one (zigzag) is
only a permutation the model applies once, before the embedding:

  perm, inv = zigzag_permutation(L, shards)
  tokens_BL, targets_BL = tokens_BL[:, perm], targets_BL[:, perm]   # the same permutation for both
  pos_BL = broadcast(perm, (B, L))          # each token keeps its original position, for RoPE and masks

The mean token loss is invariant to a joint permutation of tokens and targets, so nothing is un-permuted in
training; per-token outputs in the original order are `out[:, inv]`.
"""
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P


def zigzag_permutation(seq_len: int, shards: int):
  """(perm, inv): token order that gives device i chunks i and 2n-1-i of the sequence split into 2n chunks.

  `x[:, perm]` is the zigzag order and `y[:, inv]` undoes it. Under causal masking an early chunk has little
  to attend to and a late one much, so pairing them gives every device the same work.
  """
  if seq_len % (2 * shards):
    raise ValueError(f"zigzag needs the sequence length {seq_len} to be a multiple of 2 * {shards} shards")
  chunks_CS = np.arange(seq_len).reshape(2 * shards, -1)
  perm = chunks_CS[[c for i in range(shards) for c in (i, 2 * shards - 1 - i)]].reshape(-1)
  return perm, np.argsort(perm)


def _tile_needed(q_pos_BL, k_pos_BS):
  """Whether any query of the tile sees any key of the tile under causal masking (else its compute is skipped)."""
  return jnp.any(q_pos_BL.max(-1) >= k_pos_BS.min(-1))


def causal_block_counts(pos_L, shards: int, tiles: int = 2):
  """Tile computations each device does in causal `ring_attention` for a token order (positions in order).

  Uses the same tiling and skip test as the ring, so it shows load balance without running it.
  """
  pos_NTL = np.asarray(pos_L).reshape(shards, tiles, -1)
  needed = [[bool(_tile_needed(pos_NTL[i, a][None], pos_NTL[j, b][None]))
             for j in range(shards) for a in range(tiles) for b in range(tiles)] for i in range(shards)]
  return np.array([sum(row) for row in needed])


def _init(q_BLKGE):
  """Online-softmax accumulators: output sum, normaliser and running max, float32 whatever the input dtype."""
  B, L, K, G, E = q_BLKGE.shape
  zero_BKGL = jnp.zeros((B, K, G, L), jnp.float32)
  return jnp.zeros((B, K, G, L, E), jnp.float32), zero_BKGL, zero_BKGL - jnp.inf


def _update(acc, q_BLKGE, k_BSKE, v_BSKE, mask_BLS):
  """Folds one key block into the accumulators, rescaling what is there to the new running max."""
  o_BKGLE, l_BKGL, m_BKGL = acc
  scale = 1 / math.sqrt(q_BLKGE.shape[-1])
  s_BKGLS = jnp.einsum("BLKGE,BSKE->BKGLS", q_BLKGE, k_BSKE, preferred_element_type=jnp.float32) * scale
  if mask_BLS is not None:
    s_BKGLS = jnp.where(mask_BLS[:, None, None], s_BKGLS, -jnp.inf)
  # The max only keeps exp() in range; the result does not depend on it, so it carries no gradient.
  m_BKGL = jnp.maximum(m_BKGL, jax.lax.stop_gradient(s_BKGLS).max(-1))
  m_safe_BKGL = jnp.where(jnp.isfinite(m_BKGL), m_BKGL, 0.)  # rows with nothing visible yet: exp(-inf) = 0
  p_BKGLS = jnp.exp(s_BKGLS - m_safe_BKGL[..., None])
  alpha_BKGL = jnp.exp(acc[2] - m_safe_BKGL)
  l_BKGL = alpha_BKGL * l_BKGL + p_BKGLS.sum(-1)
  pv_BKGLE = jnp.einsum("BKGLS,BSKE->BKGLE", p_BKGLS.astype(v_BSKE.dtype), v_BSKE,
                        preferred_element_type=jnp.float32)
  return alpha_BKGL[..., None] * o_BKGLE + pv_BKGLE, l_BKGL, m_BKGL


def _finish(accs, dtype):
  """Output = sum / normaliser, back in (B, L, H, E); a row that saw no key gives 0, not NaN."""
  o_BKGLE = jnp.concatenate([o / jnp.where(l == 0, 1., l)[..., None] for o, l, _ in accs], axis=3)
  B, K, G, L, E = o_BKGLE.shape
  return o_BKGLE.transpose(0, 3, 1, 2, 4).reshape(B, L, K * G, E).astype(dtype)


def _grouped(q_BLHE, K):
  B, L, H, E = q_BLHE.shape
  if H % K:
    raise ValueError(f"{H} query heads are not a multiple of {K} kv heads")
  return q_BLHE.reshape(B, L, K, H // K, E)


def _ring(q_BLHE, k_BLKE, v_BLKE, q_pos_BL, k_pos_BL, *, axis_name, causal, tiles):
  """The ring; also returns how many (query tile, key tile) blocks this device computed, shape (1,)."""
  n = jax.lax.axis_size(axis_name)
  tiles = tiles if causal else 1  # without a mask nothing can be skipped, so one tile per side
  L = q_BLHE.shape[1]
  if L % tiles:
    raise ValueError(f"local sequence chunk {L} is not a multiple of {tiles} tiles")
  t = L // tiles
  q_BLKGE = _grouped(q_BLHE, k_BLKE.shape[2])
  q_tiles = [(q_BLKGE[:, a * t:(a + 1) * t], q_pos_BL[:, a * t:(a + 1) * t]) for a in range(tiles)]

  # Recomputed in the backward pass instead of stored: residuals stay O(L) per device, not O(L * L / n).
  update = jax.checkpoint(_update)

  def fold(kv, accs, work):
    """Folds the key block `kv` into every query tile, tile pair by tile pair, skipping invisible pairs."""
    accs = list(accs)
    for a, (q_tile, q_pos) in enumerate(q_tiles):
      for b in range(tiles):
        k_tile, v_tile, k_pos = (x[:, b * t:(b + 1) * t] for x in kv)
        if causal:
          compute = lambda acc, w: (update(acc, q_tile, k_tile, v_tile, q_pos[:, :, None] >= k_pos[:, None, :]),
                                    w + 1)
          accs[a], work = jax.lax.cond(_tile_needed(q_pos, k_pos), compute, lambda acc, w: (acc, w), accs[a], work)
        else:
          accs[a], work = update(accs[a], q_tile, k_tile, v_tile, None), work + 1
    return tuple(accs), work

  def step(_, carry):
    kv, accs, work = carry
    # Send this block on while computing with it: the two are independent, so the transfer can overlap.
    nxt = jax.lax.ppermute(kv, axis_name, [(i, (i + 1) % n) for i in range(n)])
    return (nxt,) + fold(kv, accs, work)

  # Fresh accumulators are device-invariant, but lax.cond and fori_loop (under check_vma) need them to vary
  # over the same mesh axes as what the inputs make of them. A sum over an empty slice of every input is an
  # exact zero that does, in any shard_map (partial or full manual), without naming the axes.
  zero = sum(x[:, :0].sum().astype(jnp.float32) for x in (q_BLHE, k_BLKE, v_BLKE, q_pos_BL, k_pos_BL))
  accs = tuple(tuple(a + zero for a in _init(q)) for q, _ in q_tiles)
  work = jnp.zeros((1,), jnp.int32) + zero.astype(jnp.int32)
  kv, accs, work = jax.lax.fori_loop(0, n - 1, step, ((k_BLKE, v_BLKE, k_pos_BL), accs, work))
  accs, work = fold(kv, accs, work)  # the last block arrives; no need to send it on
  return _finish(accs, q_BLHE.dtype), work


def ring_attention(q_BLHE, k_BLKE, v_BLKE, q_pos_BL, k_pos_BL, *, axis_name, causal, tiles=2):
  """Attention of the local queries over the whole sharded sequence, passing K/V blocks round a ring.

  Call inside shard_map, on this device's chunk. Each of n steps folds one K/V block (with its positions) into
  a float32 online softmax (running max, normaliser, output sum), then the block moves on with ppermute;
  after n steps every query has seen every key, and the result equals full softmax attention. Under causal
  masking each local chunk and each arriving block are split into `tiles` tiles, and a tile pair in which
  no query sees any key is skipped with lax.cond: with zigzag order (2 chunks per device) and tiles=2 every
  device then computes 2n + 1 of its 4n tile pairs; contiguous order gives device i 4i + 3 (see
  `causal_block_counts`).
  """
  return _ring(q_BLHE, k_BLKE, v_BLKE, q_pos_BL, k_pos_BL, axis_name=axis_name, causal=causal, tiles=tiles)[0]


def _ring_gather(x, axis_name, axis):
  """Every device's block of `x` concatenated along `axis`, in ring arrival order (own block first).

  Not lax.all_gather: in a shard_map manual over only `axis_name` (jax 0.10.2), XLA first all-gathers an
  all-gather's operand over the automatic axes too, so each device would hold every batch row and kv head.
  ppermute keeps their sharding. Block order is irrelevant to attention, as masks come from positions.
  """
  n = jax.lax.axis_size(axis_name)
  blocks = [x]
  for _ in range(n - 1):
    blocks.append(jax.lax.ppermute(blocks[-1], axis_name, [(i, (i + 1) % n) for i in range(n)]))
  return jnp.concatenate(blocks, axis=axis)


def allgather_attention(q_BLHE, k_BLKE, v_BLKE, q_pos_BL, k_pos_BL, *, axis_name, causal):
  """Attention of the local queries over the whole sequence, from a gathered copy of K/V and their positions.

  Call inside shard_map. Simpler than the ring, but every device holds the full K/V and does all its masked
  work (nothing skipped); fine when K/V are small (few kv heads) next to the activations.
  """
  k_BSKE, v_BSKE, k_pos_BS = (_ring_gather(x, axis_name, 1) for x in (k_BLKE, v_BLKE, k_pos_BL))
  q_BLKGE = _grouped(q_BLHE, k_BSKE.shape[2])
  mask_BLS = q_pos_BL[:, :, None] >= k_pos_BS[:, None, :] if causal else None
  return _finish([_update(_init(q_BLKGE), q_BLKGE, k_BSKE, v_BSKE, mask_BLS)], q_BLHE.dtype)


def sequence_sharded_attention(q_BLHE, k_BLKE, v_BLKE, pos_BL, *, mesh, axis_name="sequence", impl="ring",
                               causal=True):
  """Attention on global arrays whose L dimension is sharded over `axis_name`; call from jitted model code.

  shard_map is manual over `axis_name` only: the other mesh axes stay automatic, so batch or head sharding
  over them passes through untouched. `pos_BL` are the tokens' original positions (see the module docstring).
  """
  if impl not in ("ring", "allgather"):
    raise ValueError(f"context-parallel attention impl must be 'ring' or 'allgather', not {impl!r}")
  attend = ring_attention if impl == "ring" else allgather_attention
  spec = P(None, axis_name)
  fn = lambda q, k, v, pos: attend(q, k, v, pos, pos, axis_name=axis_name, causal=causal)
  return jax.shard_map(fn, mesh=mesh, in_specs=(spec,) * 4, out_specs=spec, axis_names={axis_name})(
      q_BLHE, k_BLKE, v_BLKE, pos_BL)
