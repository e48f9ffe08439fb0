"""`matmul_nt(x_TK, w_NK)` = x . w^T: in float32 on the CPU backend by meshtrain/kernels/cpu_matmul.cc (why: see
there), otherwise (GPU, bfloat16) by XLA's own dot. `OutInProducts` hands it to the model (ModelConfig.products):
dense weights held [out, in], every product through matmul_nt. The generator (meshtrain/inference/generator.py)
chooses it on the CPU backend; the model never imports this module.

The kernel is compiled with the machine's C++ compiler (`$CXX`, else `c++`) on first use and cached under
`$XDG_CACHE_HOME/meshtrain` (default `~/.cache/meshtrain`), keyed by the source, the compiler flags, jaxlib's version
(the FFI headers it ships) and this CPU's instruction sets. Without a compiler, CPU decoding falls back to XLA's dot
(slower, same numbers up to float32 summation order) and says so once.

Sharding: a `custom_partitioning` rule "t k, n k -> t n" runs the kernel on each device's rows of x and of w, so it
keeps the split of the batch (data, fsdp) and of the output features (tensor); a split contraction dimension, or
output features split over the batch's own axis (fsdp), is gathered first, which is what decoding's weights under
fsdp need anyway.
"""
import ctypes
import dataclasses
import functools
import hashlib
import logging
import math
import os
import pathlib
import platform
import subprocess
import tempfile

import jax
import jax.numpy as jnp
import jaxlib
from jax.experimental.custom_partitioning import custom_partitioning
from jax.sharding import NamedSharding, PartitionSpec as P

from meshtrain.models import llama

SOURCE = pathlib.Path(__file__).with_suffix(".cc")
FLAGS = ("-O3", "-march=native", "-std=c++17", "-shared", "-fPIC")
_TARGET = "meshtrain_matmul_nt"
log = logging.getLogger(__name__)


def _cpu_features() -> str:
  """What -march=native compiles for, so a cache shared by different machines (a cluster's home) keeps one build
  per kind of CPU."""
  try:
    for line in pathlib.Path("/proc/cpuinfo").read_text().splitlines():
      if line.startswith(("flags", "Features")):
        return line
  except OSError:
    pass
  return platform.processor()


def library_path() -> pathlib.Path:
  cache = pathlib.Path(os.environ.get("XDG_CACHE_HOME") or pathlib.Path.home() / ".cache") / "meshtrain"
  key = hashlib.sha256("\n".join([SOURCE.read_text(), " ".join(FLAGS), jaxlib.__version__, platform.machine(),
                                  _cpu_features()]).encode()).hexdigest()[:16]
  return cache / f"cpu_matmul-{key}.so"


def _build(path: pathlib.Path):
  """Compiles into a temporary file and renames it into place: processes that build at once (pytest workers, the
  processes of one job) each get a whole library, never a half-written one."""
  path.parent.mkdir(parents=True, exist_ok=True)
  fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".so.tmp")
  os.close(fd)
  try:
    cmd = [os.environ.get("CXX", "c++"), *FLAGS, f"-I{jax.ffi.include_dir()}", str(SOURCE), "-o", tmp]
    subprocess.run(cmd, check=True, capture_output=True, text=True)
    os.replace(tmp, path)
  finally:
    if os.path.exists(tmp):
      os.unlink(tmp)


@functools.cache
def available() -> bool:
  """Builds (once per machine) and registers the kernel with XLA; False, with one warning, where it cannot."""
  path = library_path()
  try:
    if not path.exists():
      _build(path)
    library = ctypes.cdll.LoadLibrary(str(path))
  except (OSError, subprocess.CalledProcessError) as e:
    detail = getattr(e, "stderr", "") or str(e)
    log.warning("meshtrain.kernels.cpu_matmul: could not build %s (%s); CPU decoding uses XLA's dot instead (slower)",
                SOURCE.name, detail.strip().splitlines()[-1] if detail.strip() else type(e).__name__)
    return False
  jax.ffi.register_ffi_target(_TARGET, jax.ffi.pycapsule(library.MeshtrainMatmulNT), platform="cpu")
  return True


def _xla(x_TK, w_NK):
  return jax.lax.dot_general(x_TK, w_NK, (((1,), (1,)), ((), ())))


def _kernel(x_TK, w_NK):
  out = jax.ShapeDtypeStruct((x_TK.shape[0], w_NK.shape[0]), x_TK.dtype)
  return jax.ffi.ffi_call(_TARGET, out)(x_TK, w_NK)


@custom_partitioning
def _partitioned(x_TK, w_NK):
  return _kernel(x_TK, w_NK)


def _axes(entry) -> tuple:
  return () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)


def _partition(mesh, arg_shapes, result_shape):
  del result_shape
  t = (tuple(arg_shapes[0].sharding.spec) + (None,))[0]
  n = (tuple(arg_shapes[1].sharding.spec) + (None,))[0]
  if set(_axes(t)) & set(_axes(n)):
    # fsdp: the rows of x and the weight's out features split over the same axis; keep the batch split, gather w.
    n = None
  args = (NamedSharding(mesh, P(t, None)), NamedSharding(mesh, P(n, None)))
  return mesh, _kernel, NamedSharding(mesh, P(t, n)), args


_partitioned.def_partition(_partition, sharding_rule="t k, n k -> t n", need_replication_factors=("k",))


def matmul_nt(x_TK, w_NK):
  """[T, K] x [N, K] -> [T, N], contracting both operands' minor dimension. Inference only: the kernel has no
  gradient."""
  if jax.default_backend() == "cpu" and x_TK.dtype == w_NK.dtype == jnp.float32 and available():
    return _partitioned(x_TK, w_NK)
  return _xla(x_TK, w_NK)


@dataclasses.dataclass(frozen=True)
class OutInProducts(llama.DenseProducts):
  """Dense weights stored [out..., in...] (torch's nn.Linear layout; drawn in the model's [in..., out...] and
  transposed, so the same numbers), every product by `matmul_nt`: generation's choice on the CPU. Inference only
  (the kernel has no gradient).

  Why: XLA's CPU matmul of a few rows against a weight streamed from memory is faster when both operands contract
  over their minor dimension, and this module's kernel more so (measured: see benchmarks/). Only a weight that is
  stored that way gets the fast matmul: turning a [in, out] weight around inside the program is a copy of it per
  token, and a column-major layout of it (jax's Format API) XLA copies back to row-major for the dot. The tied
  embedding [V, D] is [out, in] already."""

  def permutation(self, ndim: int, n_in: int) -> tuple[int, ...]:
    return tuple(range(n_in, ndim)) + tuple(range(n_in))

  def __call__(self, x, w, features: str):
    """As llama.dense, with `w` [out..., in...]; `features` still names the model's layout ("D,DF->F")."""
    inputs, out = features.split("->")
    x_in = inputs.split(",")[0]
    if llama.context_axis():  # the sequence is split over devices: merging it with the batch would reshard
      return jnp.einsum(f"BL{x_in},{out + x_in}->BL{out}", x, w)
    k = math.prod(x.shape[2:])
    y = matmul_nt(x.reshape(-1, k), w.reshape(-1, k))
    return y.reshape(*x.shape[:2], *w.shape[:len(out)])
