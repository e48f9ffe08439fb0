"""Golden PartitionSpecs for the tiny model under every preset, and optimizer state sharded like its parameter."""
import jax
import optax
import pytest
from jax.sharding import PartitionSpec as P

from meshtrain import config, layout as layout_lib, mesh as mesh_lib, sharding

F, T = "fsdp", "tensor"
GOLDEN = {  # preset: (mesh, {parameter: spec})
    "dp": ({"data": 8}, {}),  # everything replicated
    "fsdp": ({"data": 1, "fsdp": 8}, {
        "embedding": P(None, F), "head": P(F, None),
        "layers/attn/q": P(None, F, None, None), "layers/attn/k": P(None, F, None, None),
        "layers/attn/v": P(None, F, None, None), "layers/attn/o": P(None, None, None, F),
        "layers/mlp/gate": P(None, F, None), "layers/mlp/up": P(None, F, None), "layers/mlp/down": P(None, None, F)}),
    "tp": ({"data": 2, "tensor": 4}, {
        "embedding": P(T, None), "head": P(None, T),
        "layers/attn/q": P(None, None, T, None), "layers/attn/k": P(None, None, T, None),
        "layers/attn/v": P(None, None, T, None), "layers/attn/o": P(None, T, None, None),
        "layers/mlp/gate": P(None, None, T), "layers/mlp/up": P(None, None, T), "layers/mlp/down": P(None, T, None)}),
    "fsdp_tp": ({"data": 2, "fsdp": 2, "tensor": 2}, {
        "embedding": P(T, F), "head": P(F, T),
        "layers/attn/q": P(None, F, T, None), "layers/attn/k": P(None, F, T, None),
        "layers/attn/v": P(None, F, T, None), "layers/attn/o": P(None, T, None, F),
        "layers/mlp/gate": P(None, F, T), "layers/mlp/up": P(None, F, T), "layers/mlp/down": P(None, T, F)}),
}
NORMS = ("final_norm/scale", "layers/attn_norm/scale", "layers/mlp_norm/scale")


def normalize(spec: P) -> tuple:
  entries = tuple(spec)
  while entries and entries[-1] is None:
    entries = entries[:-1]
  return entries


def build(preset):
  cfg = config.base_config()
  cfg.mesh.update({"data": 1, "fsdp": 1, "tensor": 1, **GOLDEN[preset][0]})
  cfg.sharding.rules = preset
  return layout_lib.build(cfg, mesh_lib.make_mesh(cfg.mesh))


@pytest.mark.parametrize("preset", GOLDEN)
def test_golden_partition_specs(preset):
  layout = build(preset)
  specs = {row.path: normalize(row.spec) for row in layout.table}
  expected = {path: normalize(GOLDEN[preset][1].get(path, P())) for path in specs}
  assert specs == expected
  assert set(NORMS) <= specs.keys() and all(specs[n] == () for n in NORMS)


@pytest.mark.parametrize("preset", GOLDEN)
def test_state_is_born_sharded_and_moments_follow_params(preset):
  layout = build(preset)
  state = layout.init(0)
  is_adam = lambda x: isinstance(x, optax.ScaleByAdamState)
  (adam,) = [x for x in jax.tree.leaves(state.opt_state, is_leaf=is_adam) if is_adam(x)]
  for moments in (adam.mu, adam.nu):
    jax.tree.map(lambda p, m: (m.sharding.is_equivalent_to(p.sharding, p.ndim) or pytest.fail(str(m.sharding))),
                 state.params, moments)
  for row, leaf in zip(layout.table, jax.tree.leaves(state.params)):
    assert leaf.sharding.spec == row.spec
    assert leaf.addressable_shards[0].data.nbytes == row.bytes_per_device  # the table tells the truth


def test_fsdp_table_splits_bytes_eightfold():
  rows = build("fsdp").table
  total = sum(r.size * 4 for r in rows)
  norms = sum(r.size * 4 for r in rows if r.path in NORMS)
  assert sum(r.bytes_per_device for r in rows) == (total - norms) // 8 + norms
  text = sharding.format_table(rows)
  assert ("layers/mlp/down" in text and "(layers, mlp, embed)" in text
          and f"{sum(r.size for r in rows):,} parameters" in text)


def test_weight_decay_skips_norms():
  from meshtrain.optim import decay_mask
  params = jax.device_get(build("dp").init(0).params)
  mask = decay_mask(params)
  flat = {"/".join(str(k.key) for k in path): v for path, v in jax.tree_util.tree_leaves_with_path(mask)}
  assert {p for p, v in flat.items() if not v} == set(NORMS)
