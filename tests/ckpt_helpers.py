"""Reading a checkpoint's parameters in a test, whatever mesh or process count wrote it."""
import jax

from meshtrain import checkpoint, config, layout, mesh


def one_device_layout(**config_overrides):
  """The tiny model's layout (seq_len 64, `config_overrides` applied) on one device: a restore target for any
  checkpoint of it."""
  cfg = config.base_config()
  cfg.seq_len = 64
  for key, value in config_overrides.items():
    cfg[key] = value
  cfg.mesh.data = 1
  return layout.build(cfg, mesh.make_mesh(cfg.mesh, devices=jax.devices()[:1]))


def restore_params(workdir, step, **config_overrides):
  """The parameters saved at `step` under `workdir`, restored onto one device as host arrays."""
  one = one_device_layout(**config_overrides)
  ckpt = checkpoint.Checkpointer(workdir, keep=100)
  try:
    return jax.device_get(ckpt.restore_state(step, one.state_abstract).params)
  finally:
    ckpt.close()


def rewrite_without_checksums(src_workdir, dst_workdir, step, **config_overrides):
  """Copies checkpoint `step` of `src_workdir` to `dst_workdir` in the format meshtrain wrote before checksums
  (Zarr v2 arrays without digests, a meta item without its integrity record): an 'old' checkpoint."""
  one = one_device_layout(**config_overrides)
  src = checkpoint.Checkpointer(src_workdir, keep=100)
  try:
    state, meta = src.restore_state(step, one.state_abstract), src.read_meta(step)
  finally:
    src.close()
  dst = checkpoint.Checkpointer(dst_workdir, keep=100, checksums=False)
  try:
    dst.save(step, state, meta)
    dst.wait()
  finally:
    dst.close()
