"""A training run's newest checkpoint, for serving it while it trains (meshtrain/inference/engine.py swaps it in).

The run's directory is listed at most every `poll_s` seconds (no JAX, no Orbax: a few stat calls). A newer complete
step is loaded onto the generator's mesh with the shardings and layout of the parameters it serves
(Generator.place_params), so every compiled prefill and decode program runs on it unchanged: nothing is compiled
again. A step the trainer's retention deletes while it is read is skipped (the next newer one is taken when it
appears); a checkpoint that cannot be read, or whose parameters differ in shape from the served ones, is reported
once and never tried again, and the served one stays.
"""
import pathlib
import sys
import time

import jax

from meshtrain import checkpoint
from meshtrain.errors import UserError


class LiveCheckpoints:
  """The checkpoints of `workdir` newer than the served `step`."""

  def __init__(self, workdir, step: int, poll_s: float = 10.0):
    self.workdir = pathlib.Path(workdir)
    self.step = step
    self.poll_s = poll_s
    self.refused: set[int] = set()
    self._polled = time.monotonic()

  def newer(self) -> int | None:
    """The newest complete step past the served one, when a poll is due and there is one; else None."""
    now = time.monotonic()
    if now - self._polled < self.poll_s:
      return None
    self._polled = now
    steps = [s for s in checkpoint.checkpoint_steps(self.workdir) if s > self.step and s not in self.refused]
    return steps[-1] if steps else None

  def load(self, generator, step: int):
    """The parameters of `step` placed as `generator` (a Generator, or an image engine's ServedParams) holds its
    own (its `load_step`), or None when they cannot be served (said once on stderr; the caller keeps serving what
    it has)."""
    try:
      placed = generator.load_step(self.workdir, step)
    except checkpoint.StepVanished:
      return None  # deleted by the run's retention while read: a newer one is on its way
    except (UserError, ValueError, TypeError) as e:
      self.refused.add(step)
      print(f"warning: not serving the checkpoint at step {step} of {self.workdir}: {e}; still serving step "
            f"{self.step}", file=sys.stderr, flush=True)
      return None
    shapes = lambda tree: jax.tree.map(lambda x: (x.shape, x.dtype), tree)
    if shapes(placed) != shapes(generator.params):
      self.refused.add(step)
      print(f"warning: not serving the checkpoint at step {step} of {self.workdir}: its parameters differ in shape "
            f"from step {self.step}'s (another model in the same directory); still serving step {self.step}",
            file=sys.stderr, flush=True)
      return None
    self.step = step
    return placed
