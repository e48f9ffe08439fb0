"""The text-to-image family (meshtrain/models/flux.py, meshtrain/families/t2i.py): the numbers it promises."""
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from meshtrain import config, layout as layout_lib, mesh as mesh_lib, presets
from meshtrain.data import images, shapes
from meshtrain.errors import UserError
from meshtrain.families import t2i
from meshtrain.models import flux

B = 16  # divisible by every layout's batch axes below


def tiny_cfg(**model):
  cfg = config.base_config()
  cfg.task = "t2i"
  cfg.model = presets.t2i_model_config("tiny")
  cfg.model.update({"image_size": 16, "patch_size": 4, "d_model": 32, "num_heads": 2, "mlp_dim": 64,
                    "axes_dim": (4, 6, 6), "text_len": 12, "text_width": 16, "text_heads": 2, "text_mlp_dim": 32,
                    "double_layers": 1, "single_layers": 1, **model})
  return cfg


def one_device_mesh():
  return mesh_lib.make_mesh({"data": 1}, devices=jax.devices()[:1])


@pytest.fixture(scope="module")
def task():
  return t2i.T2iTask(tiny_cfg(), one_device_mesh())


@pytest.fixture(scope="module")
def params(task):
  return nn.meta.unbox(jax.jit(task.model.init)(jax.random.key(0), *task.init_args(2))["params"])


@pytest.fixture(scope="module")
def trained_like(params):
  """Every parameter random (the zero-initialised ones too): an output that depends on x, t and the caption."""
  leaves, tree = jax.tree.flatten(params)
  keys = jax.random.split(jax.random.key(1), len(leaves))
  return jax.tree.unflatten(tree, [0.3 * jax.random.normal(k, x.shape, x.dtype) for k, x in zip(keys, leaves)])


def shape_batch(n=B, offset=0, seed_base=1000, text_len=12, size=16):
  """n pictures of `shapes` (drawn, then shrunk to `size`), their captions as ids, and row seeds."""
  rows = list(shapes.examples("train"))[offset * 7 % 2900:][:n * 7:7]
  pictures = np.stack([np.asarray(jax.image.resize(x, (size, size, 3), "linear")) for x, _, _ in rows])
  return {"images": pictures.astype(np.float32) / 127.5 - 1.0,
          "captions": np.stack([images.caption_ids(c, text_len) for _, c, _ in rows]),
          "seeds": np.arange(seed_base, seed_base + n, dtype=np.uint32)}


def test_output_is_zero_at_init_and_loss_is_the_noise_to_image_distance(task, params):
  batch = shape_batch(4)
  v = task.model.apply({"params": params}, jnp.asarray(batch["images"]), jnp.full((4,), 0.5), batch["captions"])
  assert v.shape == (4, 16, 16, 3) and float(jnp.max(jnp.abs(v))) == 0.0
  sums = jax.jit(task.eval_sums)(params, batch)
  eps = jax.vmap(lambda s: jax.random.normal(jax.random.key(s), (16, 16, 3)))(batch["seeds"])
  expected = float(jnp.sum(jnp.mean(jnp.square(eps - batch["images"]), axis=(1, 2, 3))))
  for k in range(t2i.EVAL_TIMES):  # v = 0 everywhere: the loss is |eps - x0|^2 whatever t
    np.testing.assert_allclose(float(sums[f"loss_t{k}"]), expected, rtol=1e-5)


def test_the_caption_and_only_the_caption_of_a_row_steer_it(task, trained_like):
  apply = jax.jit(lambda p, x, t, ids: task.model.apply({"params": p}, x, t, ids))
  batch = shape_batch(4)
  x, t = jnp.asarray(batch["images"]), jnp.linspace(0.2, 0.8, 4)
  base = apply(trained_like, x, t, batch["captions"])
  other = batch["captions"].copy()
  other[1] = images.caption_ids("a white triangle", 12)
  changed = apply(trained_like, x, t, other)
  assert float(jnp.max(jnp.abs(changed[1] - base[1]))) > 1e-3      # the caption steers its own row
  np.testing.assert_array_equal(np.delete(np.asarray(changed), 1, 0), np.delete(np.asarray(base), 1, 0))
  # Padding is masked: ids after the caption's end change nothing, an empty caption is its own condition.
  assert float(jnp.max(jnp.abs(apply(trained_like, x, t, np.zeros_like(other))[0] - base[0]))) > 1e-3


def test_rope_is_fluxs(task):
  """rotate() against Flux's own formula (flux/math.py rope + apply_rope: a 2x2 rotation matrix per pair), in
  float64 numpy."""
  pos = np.array([[0, 0, 0], [0, 1, 2], [0, 3, 1]])
  axes, theta = (4, 6, 6), 10_000
  mats = []
  for n, d in enumerate(axes):
    omega = 1.0 / theta ** (np.arange(0, d, 2) / d)
    angle = pos[:, n, None] * omega[None]
    mats.append(np.stack([np.cos(angle), -np.sin(angle), np.sin(angle), np.cos(angle)], -1).reshape(3, -1, 2, 2))
  freqs = np.concatenate(mats, axis=1)  # [L, E/2, 2, 2]
  x = np.random.default_rng(0).normal(size=(1, 3, 2, 16))  # [B, L, H, E]
  xr = x.reshape(1, 3, 2, 8, 1, 2)
  theirs = (freqs[None, :, None, :, :, 0] * xr[..., 0] + freqs[None, :, None, :, :, 1] * xr[..., 1]).reshape(x.shape)
  ours = flux.rotate(jnp.asarray(x, jnp.float32), flux.rope_angles(jnp.asarray(pos), axes))
  np.testing.assert_allclose(np.asarray(ours), theirs, atol=1e-5)


def test_sampler_follows_the_shifted_schedule_with_guidance(task, trained_like):
  """Two Euler steps by hand (shifted times, v_empty + g (v_caption - v_empty)) against `sample`."""
  ids = shape_batch(2)["captions"]
  noise = jax.random.normal(jax.random.key(3), (2, 16, 16, 3))
  got = jax.jit(lambda p: task.sample(p, {"captions": ids}, noise, 2, 2.5))(trained_like)
  v = lambda x, t, c: task.model.apply({"params": trained_like}, x, jnp.full((2,), t), c)
  x = noise
  times = [t2i.shifted(t, task.shift) for t in (1.0, 0.5, 0.0)]
  for a, b in zip(times, times[1:]):
    empty = v(x, a, np.zeros_like(ids))
    x = x + (b - a) * (empty + 2.5 * (v(x, a, ids) - empty))
  np.testing.assert_allclose(np.asarray(got), np.clip(np.asarray(x), -1, 1), atol=2e-5)


def test_flux_resolution_shift():
  c = flux.FluxConfig.from_config(tiny_cfg(image_size=64, patch_size=1).model)  # 4,096 tokens: Flux's mu = 1.15
  assert t2i.time_shift(c, 0.0) == pytest.approx(np.exp(1.15))
  assert t2i.time_shift(c, 3.0) == 3.0 and t2i.shifted(0.5, 3.0) == pytest.approx(0.75)


def test_refuses_stage_splits_and_sequence_splits_that_do_not_divide():
  with pytest.raises(UserError, match="mesh.stage=2"):
    t2i.check_parallelism({"stage": 2})
  c = flux.FluxConfig.from_config(tiny_cfg().model)  # 16 image tokens, 12 caption bytes
  t2i.check_parallelism({"sequence": 4}, c)
  with pytest.raises(UserError, match="mesh.sequence=8 must divide"):
    t2i.check_parallelism({"sequence": 8}, c)


STEPS = 3
LAYOUTS = {
    "data=8": ({"data": 8}, "dp"),
    "fsdp=8": ({"data": 1, "fsdp": 8}, "fsdp"),
    "data=4 x tensor=2": ({"data": 4, "tensor": 2}, "tp"),
    "fsdp=2 x tensor=2 x data=2": ({"data": 2, "fsdp": 2, "tensor": 2}, "fsdp_tp"),
    # The caption's and the image's tokens split over `sequence`: the joint attention gathers keys and values.
    "sequence=4 x data=2": ({"data": 2, "sequence": 4}, "dp"),
    "sequence=2 x fsdp=2 x tensor=2": ({"data": 1, "fsdp": 2, "sequence": 2, "tensor": 2}, "fsdp_tp"),
}


def train_losses(mesh_sizes, preset, devices):
  cfg = tiny_cfg()
  cfg.steps, cfg.batch_size = STEPS, B
  cfg.optimizer.warmup_steps = 1
  cfg.mesh.update({"data": 1, "fsdp": 1, "tensor": 1, **mesh_sizes})
  cfg.sharding.rules = preset
  layout = layout_lib.build(cfg, mesh_lib.make_mesh(cfg.mesh, devices=devices))
  state, step = layout.init(cfg.seed), layout.compile_train_step()
  losses = []
  for i in range(STEPS):
    batch = jax.device_put(shape_batch(offset=i * B, seed_base=100 * i), layout.batch_shardings)
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
  assert abs(losses[-1] - losses[0]) > 1e-3
  np.testing.assert_allclose(losses, one_device_losses, rtol=2e-5)


def test_the_shapes_judge_names_held_out_pictures_and_nothing_in_noise():
  """The judge (meshtrain/inference/shapes_judge.py) reads colour and shape off the dataset's own held-out and
  validation pictures (drawn with other seeds than its calibration), and finds nothing right in noise or a blank."""
  from meshtrain.inference import shapes_judge
  judge = shapes_judge.judge()
  rng = np.random.default_rng(123)
  pairs = [shapes.PAIRS[i] for i in rng.integers(0, len(shapes.PAIRS), 90)]
  pictures = np.stack([shapes.draw(c, s, rng) for c, s in pairs])
  captions = [shapes.caption(c, s) for c, s in pairs]
  assert judge.score(pictures, captions) == {"colour_accuracy": 1.0, "shape_accuracy": 1.0, "accuracy": 1.0}
  noise = rng.integers(0, 256, (18, 32, 32, 3)).astype(np.uint8)
  blank = np.full((18, 32, 32, 3), shapes.BACKGROUND, np.uint8)
  for wrong in (noise, blank):
    assert judge.score(wrong, captions[:18])["accuracy"] <= 1 / 18
  # A picture of one pair judged against another pair's caption is wrong on what differs.
  swapped = judge.score(pictures[:1], [shapes.caption("red" if pairs[0][0] != "red" else "blue", pairs[0][1])])
  assert swapped == {"colour_accuracy": 0.0, "shape_accuracy": 1.0, "accuracy": 0.0}
  report = judge.report(pictures[:2], ["a green square", "a red circle"])
  assert set(report) == {f"sample_{g}_{k}" for g in ("heldout", "seen")
                         for k in ("colour_accuracy", "shape_accuracy", "accuracy")}
  assert shapes_judge.judge_for("shapes", (32, 32, 3), ["a cat"]) is None
  assert shapes_judge.judge_for("mine", (32, 32, 3), ["a red circle"]) is None
