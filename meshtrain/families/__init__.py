"""The model families, each implementing the task contract of meshtrain/tasks/__init__.py (which holds their
JAX-free config fields):

  lm.py   a causal language model (Llama, optionally mixture-of-experts)
  dit.py  a class-conditional diffusion transformer on images (rectified flow)
  t2i.py  a text-to-image transformer on Flux's architecture (rectified flow)
"""
from meshtrain.families import dit, lm, t2i


def build(cfg, mesh, platform: str | None = None):
  """The task of `cfg.task` for `mesh`: model-specific layout checks happen here (a UserError before compiling)."""
  if cfg.task == "dit":
    return dit.DitTask(cfg, mesh, platform)
  if cfg.task == "t2i":
    return t2i.T2iTask(cfg, mesh, platform)
  return lm.LmTask(cfg, mesh, platform)


def cost_model(cfg):
  """The analytic side of `cfg.task` for meshtrain/analysis/estimate.py (see the contract in meshtrain/tasks): no
  mesh or devices."""
  if cfg.task == "dit":
    return dit.CostModel(cfg)
  if cfg.task == "t2i":
    return t2i.CostModel(cfg)
  return lm.CostModel(cfg)
