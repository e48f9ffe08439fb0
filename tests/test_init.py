"""model.init: "fan_in" gives each weight MaxText's distribution (its std and its shape, per layer), "normal" is
bit for bit the initialisation meshtrain always had."""
import dataclasses
import math
import pathlib

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from meshtrain import config as config_lib
from meshtrain.errors import UserError
from meshtrain.kernels.cpu_matmul import OutInProducts
from meshtrain.models import llama, moe, params as params_lib
from meshtrain.models.llama import ModelConfig, Transformer

# Big enough that a std is estimated to <= 1.1% (>= 4k samples per matrix, 16k but for the router), small
# enough to init in a second.
D, H, K, E, F, V, N, X = 128, 4, 2, 32, 384, 256, 2, 32
CFG = ModelConfig(vocab_size=V, num_layers=N, d_model=D, num_heads=H, num_kv_heads=K, head_dim=E, mlp_dim=F)
CFG_MOE = dataclasses.replace(CFG, num_experts=X, mlp_dim=F // X)  # a layer's MoE MLP alone
CONFIGS = pathlib.Path(__file__).parents[1] / "configs"
TRUNC_MAX = 2 / 0.87962566103423978  # truncated at 2 sigma of the underlying normal, in units of the final std


def flat(tree):
  return {"/".join(p.key for p in path): np.asarray(leaf) for path, leaf in jax.tree_util.tree_leaves_with_path(tree)}


def old_param(module, name, shape, logical, std, dtype, *_, **__):
  """params.param as it was before model.init existed: nn.initializers.normal, called directly."""
  init_fn = nn.initializers.normal(std) if std else nn.initializers.ones
  return module.param(name, nn.with_logical_partitioning(init_fn, logical), shape, jnp.dtype(dtype))


@pytest.fixture(scope="module")
def inits():
  """{(model, init): flat parameters} for model dense (the Transformer) or moe (one MoE MLP alone), init fan_in,
  normal, or old (normal with old_param in place of params.param). One jitted program: compiling is most of the
  cost, and one program compiles faster than six."""
  tokens_BL, x_BLD = jnp.zeros((1, 8), jnp.int32), jnp.zeros((1, 8, D))

  def all_inits(key):
    out = {}
    for init in ("fan_in", "normal", "old"):
      with pytest.MonkeyPatch.context() as mp:  # in effect while tracing, which is when param() runs
        if init == "old":
          mp.setattr(llama, "param", old_param)
          mp.setattr(moe, "param", old_param)
        cfg = dict(fan_in=dict(init="fan_in")).get(init, {})
        out["dense", init] = Transformer(dataclasses.replace(CFG, **cfg)).init(key, tokens_BL)
        moe_cfg = dataclasses.replace(CFG_MOE, **cfg)
        out["moe", init] = moe.MoEMLP(moe_cfg, llama.moe_config(moe_cfg)).init(key, x_BLD)
    return out

  return {k: flat(nn.unbox(v)["params"]) for k, v in jax.jit(all_inits)(jax.random.key(0)).items()}


def check_fan_in(p, expected, truncated):
  for name, std in expected.items():
    w = p[name]
    # 4 standard errors: never fails by chance, and tight enough (<= 4.4% here) to catch a truncated normal
    # without its 0.8796 correction (12% off), or any fan-in off by a factor of 2 (41%).
    assert abs(w.mean()) < 4 * std / math.sqrt(w.size), name
    assert w.std() == pytest.approx(std, rel=max(0.02, 4 / math.sqrt(2 * w.size))), name
    peak = np.abs(w).max() / std
    if name in truncated:
      assert peak <= TRUNC_MAX * 1.0001, name  # cut at +-2 sigma of the normal before rescaling to `std`
    else:
      assert peak > 3.0, name  # a plain normal of >= 16k samples reaches 3.5-4.5 sigma (P(<3) ~ 1e-19)


def test_fan_in_matches_maxtext_per_parameter(inits):
  p = inits["dense", "fan_in"]
  # Written out, not derived from params.FanIn: the table in meshtrain/models/llama.py, MaxText's numbers.
  expected = {
      "embedding": 1.0,                       # normal(1.0)
      "layers/attn/q": 1 / math.sqrt(D * E),  # normal, fan_in D, then / sqrt(head_dim)
      "layers/attn/k": 1 / math.sqrt(D),      # normal
      "layers/attn/v": 1 / math.sqrt(D),
      "layers/attn/o": 1 / math.sqrt(H * E),  # both input axes; no depth scaling
      "layers/mlp/gate": 1 / math.sqrt(D),    # truncated normal
      "layers/mlp/up": 1 / math.sqrt(D),
      "layers/mlp/down": 1 / math.sqrt(F),
      "head": 1 / math.sqrt(D),
  }
  check_fan_in(p, expected, truncated={"layers/mlp/gate", "layers/mlp/up", "layers/mlp/down", "head"})
  for name in ("layers/attn_norm/scale", "layers/mlp_norm/scale", "final_norm/scale"):
    np.testing.assert_array_equal(p[name], 1.0)
  # Under nn.scan the layer axis is not part of fan_in, and each layer is drawn independently.
  assert p["layers/attn/q"].shape == (N, D, H, E)
  assert p["layers/attn/q"][1].std() == pytest.approx(1 / math.sqrt(D * E), rel=0.05)
  assert not np.allclose(p["layers/attn/q"][0], p["layers/attn/q"][1])


def test_fan_in_experts_use_one_experts_fan_in(inits):
  p = inits["moe", "fan_in"]
  expected = {"router": 1 / math.sqrt(D), "gate": 1 / math.sqrt(D), "up": 1 / math.sqrt(D),
              "down": 1 / math.sqrt(F // X)}
  check_fan_in(p, expected, truncated=set(expected))


@pytest.mark.parametrize("model", ["dense", "moe"])
def test_normal_is_bit_for_bit_the_old_init(inits, model):
  assert CFG.init == CFG_MOE.init == "normal"  # the default
  new, old = inits[model, "normal"], inits[model, "old"]
  assert new.keys() == old.keys()
  for name in new:
    np.testing.assert_array_equal(new[name], old[name], err_msg=name)
  assert new["layers/attn/q" if model == "dense" else "gate"].std() == pytest.approx(0.02, rel=0.03)  # init_std


def test_normal_param_is_nn_initializers_normal():
  class One(nn.Module):
    fn: object

    @nn.compact
    def __call__(self):
      return self.fn(self)

  key = jax.random.key(3)
  new = One(lambda m: params_lib.param(m, "w", (64, 32), ("embed", "mlp"), 0.07, "float32")).init(key)
  ref = One(lambda m: m.param("w", nn.initializers.normal(0.07), (64, 32), jnp.float32)).init(key)
  np.testing.assert_array_equal(nn.unbox(new)["params"]["w"], ref["params"]["w"])


def test_fan_in_attention_logits_are_unscaled(inits):
  """Under fan_in the stored query kernel is MaxText's (1/sqrt(E) smaller) and the logits are q.k, unscaled: the
  function of normal-mode attention (q.k / sqrt(E)) with a query kernel sqrt(E) larger."""
  p = {name.split("/")[-1]: w[0] for name, w in inits["dense", "fan_in"].items() if name.startswith("layers/attn/")}
  x_BLD = jax.random.normal(jax.random.key(1), (2, 8, D))
  pos_L = jnp.arange(8)

  @jax.jit
  def three(p):
    fan_in = llama.Attention(dataclasses.replace(CFG, init="fan_in")).apply({"params": p}, x_BLD, pos_L)
    normal = llama.Attention(CFG)
    return (fan_in, normal.apply({"params": dict(p, q=p["q"] * math.sqrt(E))}, x_BLD, pos_L),
            normal.apply({"params": p}, x_BLD, pos_L))

  y_fan_in, y_normal_q_larger, y_normal = three(p)
  np.testing.assert_allclose(y_fan_in, y_normal_q_larger, rtol=1e-5, atol=1e-6)
  assert not np.allclose(y_fan_in, y_normal, atol=1e-3)


def test_config_checks_init():
  assert config_lib.load(str(CONFIGS / "maxtext_tiny.py"), []).model.init == "fan_in"
  assert config_lib.load(str(CONFIGS / "tiny.py"), []).model.init == "normal"
  with pytest.raises(UserError, match="model.init"):
    config_lib.load(str(CONFIGS / "tiny.py"), ["--config.model.init=xavier"])


@pytest.mark.parametrize("init", ["normal", "fan_in"])
def test_kernels_out_in_hold_the_same_numbers_transposed(init):
  """Generation's layout on the CPU (OutInProducts: dense weights [out, in], meshtrain/kernels/cpu_matmul.py) draws
  every weight in the model's layout and transposes it: the same numbers, the logical axes permuted with them,
  every dense kernel turned (untied head included) and nothing else."""
  cfg = dataclasses.replace(CFG, init=init, tie_embeddings=False, scan_layers=False)
  tokens = jnp.zeros((1, 4), jnp.int32)
  given = Transformer(cfg).init(jax.random.key(3), tokens)["params"]
  held = Transformer(dataclasses.replace(cfg, products=OutInProducts())).init(jax.random.key(3), tokens)["params"]
  is_leaf = lambda x: isinstance(x, nn.LogicallyPartitioned)
  turned = []
  for (path, g), h in zip(jax.tree_util.tree_leaves_with_path(given, is_leaf=is_leaf),
                          jax.tree.leaves(held, is_leaf=is_leaf)):
    perm = tuple(g.names.index(n) for n in h.names)
    np.testing.assert_array_equal(np.transpose(np.asarray(g.value), perm), np.asarray(h.value))
    if perm != tuple(range(len(perm))):
      turned.append("/".join(p.key for p in path))
  expected = {f"layer_{i}/{m}/{w}" for i in range(N) for m, ws in (("attn", "qkvo"), ("mlp", ("gate", "up", "down")))
              for w in ws} | {"head"}
  assert set(turned) == expected
