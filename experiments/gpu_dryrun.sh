#!/usr/bin/env bash
# CI's GPU dry run: the first GPU call (experiments/gpu_bench.py) on this CPU at tiny shapes, in an environment
# holding only the GPU machine's packages (Python 3.12, jax 0.11.2, flax, optax, orbax-checkpoint, chex, absl-py, tqdm,
# tensorstore, numpy, pytest; no grain, tensorflow-datasets, array_record or ml_collections) plus the wheels the
# call carries, so a missing import, a bad flag or a broken step is found here and not on the GPU. Then
# tests/test_gpu_ready.py on that JAX too (the suite runs it on the project's JAX 0.10).
#
#   experiments/gpu_dryrun.sh            # ~1.5 min with the environment in place, +~40 s to build it (.venv-gpu)
#   experiments/gpu_dryrun.sh --prepare  # only (re)build the environment: .ci/run does it in the background early
set -euo pipefail
cd "$(dirname "$0")/.."
# The GPU machine's versions that matter (KINDS.md of the device tool: Python 3.12.3, jax/jaxlib 0.11.2).
JAX_VERSION=0.11.2
# The GPU machine's Orbax (its warning named 0.12.4 on 2026-12-04): older than the registry's newest, and built
# differently where meshtrain adds the checkpoint checksums (meshtrain/checkpoint/integrity.py, BUILDERS).
ORBAX_VERSION=0.12.4
# A Python 3.12 that runs: $PY312, else pyenv's (also when HOME is a temporary one, as in a cold-cache CI run; its
# python3.12 shim fails unless 3.12 is selected, so the interpreters are called directly), else python3.12.
real_home=$(getent passwd "$(id -un)" | cut -d: -f6 || true)
for candidate in ${PY312:-} $(ls -d "${PYENV_ROOT:-$HOME/.pyenv}"/versions/3.12.*/bin/python3.12 \
    "$real_home"/.pyenv/versions/3.12.*/bin/python3.12 2>/dev/null | sort -V -r) $(command -v python3.12 || true); do
  if "$candidate" -c "import sys; assert sys.version_info[:2] == (3, 12)" 2>/dev/null; then PY312=$candidate; break; fi
  PY312=""
done
if [[ -z "${PY312:-}" ]]; then
  echo "error: no working Python 3.12 (pyenv's versions/3.12.*/bin/python3.12, python3.12 on PATH); set PY312" >&2
  exit 2
fi
VENV=.venv-gpu
# The GPU machine's packages that meshtrain imports (KINDS.md of the device tool lists them all); a venv made from
# another list is made again, so a package added here (tqdm, once) is not masked by an older venv that has it.
PACKAGES="jax==$JAX_VERSION jaxlib==$JAX_VERSION flax optax orbax-checkpoint==$ORBAX_VERSION chex absl-py tensorstore numpy pytest tqdm"
if [[ ! -x $VENV/bin/python ]] || [[ "$(cat $VENV/packages.txt 2>/dev/null)" != "$PACKAGES" ]]; then
  rm -rf $VENV
  "$PY312" -m venv $VENV
  # shellcheck disable=SC2086  # one word per package
  $VENV/bin/python -m pip install --quiet $PACKAGES >$VENV/install.log 2>&1 || { cat $VENV/install.log; exit 1; }
  echo "$PACKAGES" >$VENV/packages.txt
fi
if [[ ${1:-} == --prepare ]]; then
  exit 0
fi
# The dry run proves nothing if this environment has what the GPU machine lacks.
for missing in ml_collections grain tensorflow_datasets array_record; do
  if $VENV/bin/python -c "import $missing" 2>/dev/null; then
    echo "error: $VENV has $missing, which the GPU machine lacks; delete $VENV and rerun" >&2
    exit 2
  fi
done
$VENV/bin/python experiments/gpu_bench.py --wheels >$VENV/wheels.log 2>&1 || { cat $VENV/wheels.log; exit 1; }
SITE=$(mktemp -d)
trap 'rm -rf "$SITE"' EXIT
$VENV/bin/python experiments/gpu_bench.py --dry-run --results "$SITE/results" --site "$SITE/site"
PYTHONPATH="$SITE/site" $VENV/bin/python -m pytest -q -p no:cacheprovider tests/test_gpu_ready.py
