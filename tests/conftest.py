"""Every test runs on 8 simulated CPU devices, so meshes, collectives and sharded checkpoints are real."""
import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
import xla_fast  # noqa: E402

# In-process tests compile many small programs and run each a few times (see xla_fast; the flags are read once,
# when the backend starts below). Subprocesses get the environment back unchanged, with optimised code, unless
# they ask for xla_fast.env().
_saved = os.environ.get("XLA_FLAGS")
os.environ["XLA_FLAGS"] = xla_fast.env()["XLA_FLAGS"]
import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)
jax.devices()  # start the CPU backend now, with the flags above
if _saved is None:
  del os.environ["XLA_FLAGS"]
else:
  os.environ["XLA_FLAGS"] = _saved


import pytest  # noqa: E402


@pytest.fixture(scope="session", autouse=True)
def local_datasets():
  """The datasets meshtrain builds from local files, built once in the default TFDS data_dir before any test (under
  the build's lock: both xdist workers reach this). Otherwise whichever test's run comes first on a cold data_dir
  builds them and prints TFDS's progress bars before its own output: on CI's fresh HOME a test of a one-line error
  once failed so (`test_bad_data_and_sizes[empty split]`: 21 lines, the error last)."""
  try:
    import tensorflow_datasets  # noqa: F401
  except ImportError:  # the GPU dry run's environment (experiments/gpu_dryrun.sh): no TFDS, no dataset to build
    return
  from meshtrain.data import digits, sft, stdlib_corpus
  for module in (stdlib_corpus, sft, digits):
    module.build("")


# The longest test files first: xdist's loadfile hands whole files to the workers in order (with the reorder off,
# below), so a file of one long training run handed out last (tests/test_t2i_run.py, about 9 minutes) ran alone at
# the end of the suite while the other worker idled. Longest first lets the other files fill the other worker.
LONGEST_FIRST = ("test_t2i_run.py", "test_docs_commands.py", "test_slurm.py", "test_serve.py", "test_recovery.py",
                 "test_multiprocess.py", "test_logprobs.py")


def pytest_configure(config):
  # xdist sorts the files by their number of tests before handing them out (its loadscope reorder), which put
  # tests/test_t2i_run.py (two tests) last again; keep the collection order instead.
  if hasattr(config.option, "loadscopereorder"):
    config.option.loadscopereorder = False


def pytest_collection_modifyitems(session, config, items):
  rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
  items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: each file keeps its own order
