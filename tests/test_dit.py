"""DiT (meshtrain/models/dit.py) and its rectified-flow task (meshtrain/families/dit.py): the numbers they promise."""
import math

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from meshtrain import config, layout as layout_lib, mesh as mesh_lib, presets
from meshtrain.data import digits
from meshtrain.errors import UserError
from meshtrain.families import dit as task_lib

B = 16  # batch rows in these tests: divisible by every layout's batch axes below


def tiny_cfg(**model):
  cfg = config.base_config()
  cfg.task = "dit"
  cfg.model = presets.dit_model_config("digits")
  cfg.model.update({"d_model": 32, "num_layers": 2, "num_heads": 4, "mlp_dim": 64, **model})
  return cfg


def one_device_mesh():
  return mesh_lib.make_mesh({"data": 1}, devices=jax.devices()[:1])


@pytest.fixture(scope="module")
def task():
  return task_lib.DitTask(tiny_cfg(), one_device_mesh())


@pytest.fixture(scope="module")
def params(task):
  return nn.meta.unbox(jax.jit(task.model.init)(jax.random.key(0), *task.init_args(2))["params"])


@pytest.fixture(scope="module")
def apply(task):
  """The model's forward pass, jitted (eager Flax runs op by op: seconds per call)."""
  return jax.jit(lambda p, x, t, y: task.model.apply({"params": p}, x, t, y))


@pytest.fixture(scope="module")
def trained_like(params):
  """Every parameter random (the zero-initialised ones too): a model whose output depends on x, t and the class."""
  def scramble(params):
    leaves, tree = jax.tree.flatten(params)
    keys = jax.random.split(jax.random.key(1), len(leaves))
    return jax.tree.unflatten(tree, [0.2 * jax.random.normal(k, x.shape, x.dtype) for k, x in zip(keys, leaves)])
  return jax.jit(scramble)(params)


def digit_batch(n=B, offset=0, seed_base=1000):
  images_u8, labels = digits.load_split("train")
  rows = slice(offset, offset + n)
  return {"images": images_u8[rows].astype(np.float32) / 127.5 - 1.0, "labels": labels[rows].astype(np.int32),
          "seeds": np.arange(seed_base, seed_base + n, dtype=np.uint32)}


def test_shapes_and_adaln_zero_init(params, apply):
  """The output has the image's shape, and adaLN-Zero makes it exactly zero at init."""
  batch = digit_batch()
  v = apply(params, batch["images"], jnp.full((B,), 0.5), batch["labels"])
  assert v.shape == (B, 8, 8, 1) and v.dtype == jnp.float32
  assert np.all(np.asarray(v) == 0.0)


def test_blocks_start_as_identity(params, apply):
  """With the modulation (and so the gates) at zero, a block's attention and MLP weights cannot change the output:
  each block is the identity. Seen through a non-zero final layer, so the output is not trivially zero."""
  batch = digit_batch()
  readout = dict(params, out=jax.random.normal(jax.random.key(2), params["out"].shape))
  layers = readout["layers"]
  attn, mlp = jax.tree.map(lambda x: x + 1.0, layers["attn"]), jax.tree.map(lambda x: x - 1.0, layers["mlp"])
  scrambled = dict(readout, layers=dict(layers, attn=attn, mlp=mlp))
  run = lambda p: np.asarray(apply(p, batch["images"], jnp.full((B,), 0.3), batch["labels"]))
  before, after = run(readout), run(scrambled)
  assert np.abs(before).max() > 0.1
  np.testing.assert_array_equal(after, before)


def test_loss_at_init_is_the_noise_to_image_distance(task, params):
  """At init v = 0, so each image's loss is mean((eps - x0)^2) over its pixels: the objective the docstring
  states. eps is redrawn here from the row's seed as documented (key -> split 3 -> the second key); the sum and
  the statistics are numpy's."""
  batch = digit_batch(64)
  loss_sum, aux = jax.jit(task.loss)(params, batch)
  eps_of_seed = lambda s: jax.random.normal(jax.random.split(jax.random.key(s), 3)[1], (8, 8, 1))
  eps = np.asarray(jax.jit(jax.vmap(eps_of_seed))(batch["seeds"]))
  per_image = np.mean((eps.astype(np.float64) - batch["images"]) ** 2, axis=(1, 2, 3))
  np.testing.assert_allclose(float(loss_sum), per_image.sum(), rtol=1e-5)
  assert float(aux["count"]) == 64 and float(aux["loss_sum"]) == float(loss_sum)
  # E(eps - x0)^2 = 1 + x0^2 per pixel (eps independent, mean 0, variance 1): the draw really is N(0, 1).
  expected = 1.0 + np.mean(batch["images"].astype(np.float64) ** 2)
  stderr = np.std(per_image - 1.0 - np.mean(batch["images"] ** 2, axis=(1, 2, 3))) / math.sqrt(64)
  assert abs(per_image.mean() - expected) < 4 * stderr
  # Eval sums the same quantity (labels do not matter at init).
  sums = jax.jit(task.eval_sums)(params, batch, None)
  np.testing.assert_allclose(float(sums["loss_sum"]), per_image.sum(), rtol=1e-5)
  record = task.eval_record({k: float(v) for k, v in sums.items()})
  assert record["eval_loss"] == pytest.approx(per_image.mean(), rel=1e-5)


def test_a_rows_loss_depends_only_on_its_own_row(task, trained_like):
  """Permuting the rows permutes the per-row losses; changing one row's seed changes that row's loss only."""
  c = task.model_cfg
  per_row = jax.jit(lambda b: task_lib.loss_per_image(task.model.apply, trained_like, b["images"], b["labels"],
                                                      b["seeds"], c.class_dropout, c.num_classes, True))
  batch = digit_batch()
  base = np.asarray(per_row(batch))
  order = np.random.default_rng(0).permutation(B)
  permuted = np.asarray(per_row({k: v[order] for k, v in batch.items()}))
  np.testing.assert_allclose(permuted, base[order], rtol=1e-6)
  reseeded = dict(batch, seeds=batch["seeds"].copy())
  reseeded["seeds"][3] += 12345
  changed = np.asarray(per_row(reseeded))
  assert abs(changed[3] - base[3]) > 1e-3
  np.testing.assert_allclose(np.delete(changed, 3), np.delete(base, 3), rtol=1e-6)


def test_label_dropout_rate_and_eval_keeps_labels():
  """class_dropout of the rows see the null class in training; none in eval. 4,000 rows: 0.1 +- 0.019 (4 sigma)."""
  seeds = jnp.arange(4000, dtype=jnp.uint32)
  draw = lambda drop: jax.vmap(lambda s: task_lib.noise_and_time(s, jnp.zeros((8, 8, 1)), 3, 0.1, 10, drop)[2])(seeds)
  dropped = np.asarray(draw(True))
  assert set(np.unique(dropped)) == {3, 10}
  assert abs(np.mean(dropped == 10) - 0.1) < 4 * math.sqrt(0.1 * 0.9 / 4000)
  assert np.all(np.asarray(draw(False)) == 3)
  # t is logit-normal: the logit of t is N(0, 1).
  t = np.asarray(jax.vmap(lambda s: task_lib.noise_and_time(s, jnp.zeros((8, 8, 1)), 3, 0.1, 10, True)[0])(seeds))
  logit = np.log(t / (1 - t))
  assert abs(logit.mean()) < 0.07 and abs(logit.std() - 1.0) < 0.05


def _matmul_flops(jaxpr) -> float:
  """2 x multiply-adds of every dot_general in a jaxpr, inside scans (x length) and nested calls."""
  total = 0.0
  for eqn in jaxpr.eqns:
    if eqn.primitive.name == "dot_general":
      (lhs_contract, _), _ = eqn.params["dimension_numbers"]
      lhs = eqn.invars[0].aval.shape
      total += 2 * math.prod(eqn.outvars[0].aval.shape) * math.prod(lhs[d] for d in lhs_contract)
    for sub in eqn.params.values():
      inner = getattr(sub, "jaxpr", sub)
      if hasattr(inner, "eqns"):
        total += _matmul_flops(inner) * (eqn.params["length"] if eqn.primitive.name == "scan" else 1)
  return total


def test_flops_formula_by_hand_and_by_the_programs_matmuls(task, params):
  """d_model 32, 2 layers, 4 heads, mlp 64, 8x8x1 images, patch 2 -> T = 16 tokens of X = 4 pixels, Q = 256:
    patch embedding   2 x 16 x 4 x 32                                =   4,096
    timestep MLP      2 x (256 x 32 + 32 x 32)                       =  18,432
    per block         adaLN 2 x 32 x 192                             =  12,288
                      q, k, v, o 2 x 16 x 4 x 32 x 32                = 131,072
                      attention 4 x 16 x 16 x 32                     =  32,768
                      MLP 2 x 16 x 2 x 32 x 64                       = 131,072
                      block total                                    = 307,200, x 2 layers = 614,400
    final layer       adaLN 2 x 32 x 64 + linear 2 x 16 x 32 x 4     =   8,192
    forward                                                          = 645,120; training x 3 = 1,935,360
  and the forward's matmuls as traced (one image) count the same."""
  assert task.flops_per_example(None) == 1_935_360
  x, t, y = task.init_args(1)
  jaxpr = jax.make_jaxpr(lambda p: task.model.apply({"params": p}, x, t, y))(params).jaxpr
  assert _matmul_flops(jaxpr) == 645_120


def test_sampler_is_the_guided_euler_step(task, trained_like, apply):
  """One Euler step from t = 1 equals noise - (v_null + g (v_cond - v_null)) with both velocities from separate
  forward passes; g = 1 is the conditional model, g = 0 the unconditional one. Fixed noise: bitwise repeatable."""
  model, n = task.model, 4
  # A smaller read-out than trained_like's: one step of size 1 then stays mostly inside the clip range.
  trained_like = dict(trained_like, out=0.1 * trained_like["out"], out_bias=0.1 * trained_like["out_bias"])
  labels = jnp.array([0, 3, 7, 9], jnp.int32)
  noise = 0.3 * jax.random.normal(jax.random.key(5), (n, 8, 8, 1))  # small: one step stays inside the clip range
  velocity = lambda y: apply(trained_like, noise, jnp.ones((n,)), y)
  v_cond, v_null = velocity(labels), velocity(jnp.full((n,), 10, jnp.int32))
  assert float(jnp.abs(v_cond - v_null).max()) > 1e-2  # the class matters, so the checks below can fail
  sample = jax.jit(task_lib.sample, static_argnums=(0, 4))
  guided = jax.jit(task_lib.guided_velocity, static_argnums=0)
  for g in (0.0, 1.0, 3.0):
    got = np.asarray(sample(model, trained_like, labels, noise, 1, g))
    v = v_null + g * (v_cond - v_null)
    np.testing.assert_allclose(guided(model, trained_like, noise, 1.0, labels, g), v,
                               rtol=1e-5, atol=1e-6)
    expected = np.clip(noise - v, -1, 1)
    assert np.mean(np.abs(expected) < 1) > 0.5
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6)
  many = [np.asarray(sample(model, trained_like, labels, noise, 8, 2.0)) for _ in range(2)]
  np.testing.assert_array_equal(many[0], many[1])
  assert many[0].min() >= -1 and many[0].max() <= 1


def test_full_remat_computes_the_same_loss_and_gradients(trained_like):
  """model.remat=full recomputes each block in the backward pass: the same numbers, another schedule. (With every
  parameter random: at init the blocks' gradients are zero, so they would agree trivially.)"""
  batch = digit_batch()
  results = []
  for remat in ("none", "full"):
    task = task_lib.DitTask(tiny_cfg(remat=remat), one_device_mesh())
    results.append(jax.jit(jax.value_and_grad(lambda p, b: task.loss(p, b)[0]))(trained_like, batch))
  (loss_a, grads_a), (loss_b, grads_b) = results
  assert float(jnp.abs(grads_a["layers"]["attn"]["q"]).max()) > 1e-4
  np.testing.assert_allclose(float(loss_b), float(loss_a), rtol=1e-6)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-7), grads_a, grads_b)


def test_refuses_sequence_and_stage_splits():
  for axis in ("sequence", "stage"):
    mesh = mesh_lib.make_mesh({"data": 4, axis: 2}, devices=jax.devices())
    with pytest.raises(UserError, match=f"mesh.{axis}=2"):
      task_lib.DitTask(tiny_cfg(), mesh)
  with pytest.raises(UserError, match="divisible by 4"):  # config.validate, before any mesh or compile
    config.validate(tiny_cfg(d_model=30, num_heads=3))


def test_task_contract_members(task):
  spec = task.batch_spec(B)
  assert {k: (v.shape, v.dtype) for k, v in spec.items()} == {
      "images": ((B, 8, 8, 1), jnp.float32), "labels": ((B,), jnp.int32), "seeds": ((B,), jnp.uint32)}
  assert set(task.batch_axes()) == set(spec) and all(a[0] == "act_batch" for a in task.batch_axes().values())
  assert task.kind == "dit" and task.throughput_key == "images_per_sec" and task.units_per_example == 1
  assert task.eval_extra(None) is None
  assert set(task.shape_fields) <= set(presets.dit_model_config("digits"))


# Layouts against one device through layout.build's compiled train step (the program the train loop runs), as
# tests/test_numerics.py does for the language model: the same 3 optimizer steps' losses.
STEPS = 3
LAYOUTS = {
    "data=8": ({"data": 8}, "dp"),
    "fsdp=8": ({"data": 1, "fsdp": 8}, "fsdp"),
    "data=2 x tensor=4": ({"data": 2, "tensor": 4}, "tp"),
    "fsdp=2 x tensor=2 x data=2": ({"data": 2, "fsdp": 2, "tensor": 2}, "fsdp_tp"),
}


def train_losses(mesh_sizes, preset, devices):
  """Losses of STEPS optimizer steps of layout.build's compiled train step on `devices`."""
  cfg = tiny_cfg()
  cfg.steps, cfg.batch_size = STEPS, B
  cfg.optimizer.warmup_steps = 1
  cfg.mesh.update({"data": 1, "fsdp": 1, "tensor": 1, **mesh_sizes})
  cfg.sharding.rules = preset
  layout = layout_lib.build(cfg, mesh_lib.make_mesh(cfg.mesh, devices=devices))
  state, step = layout.init(cfg.seed), layout.compile_train_step()
  losses = []
  for i in range(STEPS):
    batch = jax.device_put(digit_batch(offset=i * B, seed_base=100 * i), layout.batch_shardings)
    state, metrics = step(state, batch)
    losses.append(float(metrics["loss"]))
  return np.array(losses)


@pytest.fixture(scope="module")
def one_device_losses():
  return train_losses({}, "dp", jax.devices()[:1])


@pytest.mark.parametrize("name", LAYOUTS)
def test_layouts_equal_one_device(name, one_device_losses):
  sizes, preset = LAYOUTS[name]
  losses = train_losses(sizes, preset, jax.devices())
  assert abs(losses[-1] - losses[0]) > 1e-3  # the steps move the loss, so agreement is not agreement at init
  np.testing.assert_allclose(losses, one_device_losses, rtol=2e-5)
