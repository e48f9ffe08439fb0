"""Tuning study for configs/dit_digits.py: a standalone one-device DiT trainer on digits, scored by a classifier.

  python experiments/dit_tune.py --d_model 128 --layers 4 --heads 4 --mlp 512 --patch 2 --batch 128 \
      --lr 1e-3 --steps 1200 --out benchmarks/results/dit_tune_results.jsonl

Plain jax.jit + optax AdamW with meshtrain.optim's schedule shape (linear warmup, cosine decay to
lr x min_lr_ratio, global-norm clipping) on `meshtrain.data.digits.load_split("train")` scaled to [-1, 1], with
meshtrain's DiT and its rectified-flow loss (meshtrain.families.dit.loss_per_image, labels dropped with
class_dropout). Then `per_class` samples of each class (meshtrain.families.dit.sample) for every (sampling steps,
guidance) pair asked for, labelled by an MLPClassifier fitted on the digits train split (pixels in [0, 1]; it scores
>= 0.95 on the test split, printed): sample accuracy = fraction labelled as their class.

Times: wall and CPU (process_time) of the training steps only (compile excluded, reported apart). The machine's 2
cores are shared with other jobs while this runs, so wall time is inflated; the CPU time is what the training used
(one-device XLA uses ~1 core, so CPU ~ wall on an idle machine).
"""
import argparse
import contextlib
import json
import pathlib
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import linen as nn
from jax.sharding import NamedSharding, PartitionSpec as P

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))  # this checkout's meshtrain
from meshtrain import mesh as mesh_lib, sharding  # pylint: disable=g-import-not-at-top
from meshtrain.data import digits
from meshtrain.families import dit as dit_task
from meshtrain.models import dit


def classifier():
  from sklearn.neural_network import MLPClassifier  # pylint: disable=g-import-not-at-top
  images, labels = digits.load_split("train")
  clf = MLPClassifier(hidden_layer_sizes=(64,), max_iter=2000, random_state=0)
  clf.fit(images.reshape(len(images), -1) / 255.0, labels)
  test_images, test_labels = digits.load_split("test")
  test_acc = clf.score(test_images.reshape(len(test_images), -1) / 255.0, test_labels)
  return clf, test_acc


def use_uniform_t():
  """Swaps the task's per-row draw for one with t ~ U(0, 1) (everything else as meshtrain draws it): the comparison
  behind meshtrain's logit-normal choice. The experiment's own switch; meshtrain itself has one distribution."""
  logit_normal = dit_task.noise_and_time

  def uniform(seed, image_HWC, label, class_dropout, num_classes, drop_labels):
    _, eps_HWC, label = logit_normal(seed, image_HWC, label, class_dropout, num_classes, drop_labels)
    k_t = jax.random.split(jax.random.key(seed), 3)[0]
    return jax.random.uniform(k_t, (), jnp.float32), eps_HWC, label
  dit_task.noise_and_time = uniform


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--d_model", type=int, default=128)
  ap.add_argument("--layers", type=int, default=4)
  ap.add_argument("--heads", type=int, default=4)
  ap.add_argument("--mlp", type=int, default=512)
  ap.add_argument("--patch", type=int, default=2)
  ap.add_argument("--batch", type=int, default=128)
  ap.add_argument("--lr", type=float, default=1e-3)
  ap.add_argument("--warmup", type=int, default=50)
  ap.add_argument("--min_lr_ratio", type=float, default=0.1)
  ap.add_argument("--b2", type=float, default=0.99)
  ap.add_argument("--weight_decay", type=float, default=0.0)
  ap.add_argument("--class_dropout", type=float, default=0.1)
  ap.add_argument("--steps", type=int, default=1000)
  ap.add_argument("--score_every", type=int, default=0, help="also score (at steps 20, g 1) every N steps")
  ap.add_argument("--sample_steps", default="10,20,50")
  ap.add_argument("--guidance", default="1,2,3")
  ap.add_argument("--per_class", type=int, default=50)
  ap.add_argument("--seed", type=int, default=0)
  ap.add_argument("--t_dist", default="logit_normal", choices=("logit_normal", "uniform"),
                  help="the timestep distribution: meshtrain's (logit-normal) or, for comparison, uniform on [0, 1]")
  ap.add_argument("--devices", type=int, default=1,
                  help="> 1: train data-parallel over this many simulated CPU devices (the DiT config's layout, "
                       "rules dp, as the real loop runs it) to measure what the mesh costs on this machine")
  ap.add_argument("--out", default="")
  a = ap.parse_args()
  if a.devices > 1:
    jax.config.update("jax_num_cpu_devices", a.devices)  # before any JAX op

  if a.t_dist == "uniform":
    use_uniform_t()
  clf, clf_test_acc = classifier()
  print(f"classifier test accuracy {clf_test_acc:.3f}", flush=True)

  cfg = dit.DiTConfig(image_size=8, channels=1, patch_size=a.patch, num_classes=10, d_model=a.d_model,
                      num_layers=a.layers, num_heads=a.heads, mlp_dim=a.mlp, class_dropout=a.class_dropout)
  model = dit.DiT(cfg)
  images_u8, labels_np = digits.load_split("train")
  images_np = images_u8.astype(np.float32) / 127.5 - 1.0
  n = len(images_np)

  schedule = optax.warmup_cosine_decay_schedule(0.0, a.lr, a.warmup, max(a.steps, a.warmup + 1), a.lr * a.min_lr_ratio)
  tx = optax.chain(optax.clip_by_global_norm(1.0),
                   optax.adamw(schedule, b1=0.9, b2=a.b2, weight_decay=a.weight_decay))
  params = model.init(jax.random.key(a.seed), jnp.zeros((2, 8, 8, 1)), jnp.zeros((2,)), jnp.zeros((2,), jnp.int32))
  params = nn.meta.unbox(params["params"])
  opt_state = tx.init(params)
  count = sum(x.size for x in jax.tree.leaves(params))

  def train_step(params, opt_state, images, labels, seeds):
    def mean_loss(p):
      return jnp.mean(dit_task.loss_per_image(model.apply, p, images, labels, seeds, cfg.class_dropout, cfg.num_classes,
                                         drop_labels=True))
    loss, grads = jax.value_and_grad(mean_loss)(params)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss

  step = jax.jit(train_step)
  context = contextlib.ExitStack()
  if a.devices > 1:
    mesh = mesh_lib.make_mesh({"data": a.devices})
    rules = sharding.for_mesh(sharding.rules_for("dp"), mesh)
    rows, whole = NamedSharding(mesh, P("data")), NamedSharding(mesh, P())
    params, opt_state = jax.device_put((params, opt_state), whole)
    step = jax.jit(train_step, in_shardings=(whole, whole, rows, rows, rows), out_shardings=(whole, whole, whole))
    context.enter_context(jax.set_mesh(mesh))
    context.enter_context(nn.logical_axis_rules(rules))

  @jax.jit(static_argnames="steps")
  def draw(params, labels, noise, steps, guidance):
    return dit_task.sample(model, params, labels, noise, steps, guidance)

  def score(params, steps, guidance):
    labels = np.repeat(np.arange(10), a.per_class).astype(np.int32)
    noise = jax.random.normal(jax.random.key(1234), (len(labels), 8, 8, 1))
    x = np.asarray(draw(params, labels, noise, steps, guidance))
    pixels01 = (x.reshape(len(x), -1) + 1) / 2
    return float(np.mean(clf.predict(pixels01) == labels))

  rng = np.random.default_rng(a.seed)
  order = rng.permutation(n)
  cursor = 0

  def batch():
    nonlocal order, cursor
    if cursor + a.batch > n:
      order, cursor = rng.permutation(n), 0
    idx = order[cursor:cursor + a.batch]
    cursor += a.batch
    return images_np[idx], labels_np[idx].astype(np.int32), rng.integers(0, 2**32, a.batch, dtype=np.uint32)

  t0 = time.perf_counter()
  params, opt_state, loss = step(params, opt_state, *batch())
  loss.block_until_ready()
  compile_s = time.perf_counter() - t0
  wall, cpu, losses, curve = 0.0, 0.0, [], []
  for i in range(2, a.steps + 1):
    w0, c0 = time.perf_counter(), time.process_time()
    params, opt_state, loss = step(params, opt_state, *batch())
    if i % 50 == 0 or i == a.steps:
      losses.append((i, float(loss)))  # the fetch blocks: timed as training
    wall += time.perf_counter() - w0
    cpu += time.process_time() - c0
    if i % 200 == 0:
      print(f"step {i} loss {float(loss):.4f} wall {wall:.1f}s cpu {cpu:.1f}s", flush=True)
    if a.score_every and i % a.score_every == 0 and i != a.steps:
      acc = score(params, 20, 1.0)
      curve.append({"step": i, "wall_s": round(wall, 1), "cpu_s": round(cpu, 1), "accuracy_s20_g1": acc})
      print(f"  step {i}: accuracy (20 steps, g 1) {acc:.3f}", flush=True)
  context.close()
  results = {}
  for s in map(int, a.sample_steps.split(",")):
    for g in map(float, a.guidance.split(",")):
      results[f"steps{s}_g{g:g}"] = score(params, s, g)
  record = {"args": vars(a), "params": count, "compile_s": round(compile_s, 1), "train_wall_s": round(wall, 1),
            "train_cpu_s": round(cpu, 1), "ms_per_step_wall": round(1000 * wall / (a.steps - 1), 1),
            "final_loss": losses[-1][1], "loss_curve": losses[::4], "curve": curve, "accuracy": results,
            "classifier_test_accuracy": clf_test_acc}
  print(json.dumps({k: v for k, v in record.items() if k not in ("loss_curve",)}), flush=True)
  if a.out:
    with open(a.out, "a") as f:
      f.write(json.dumps(record) + "\n")


if __name__ == "__main__":
  main()
