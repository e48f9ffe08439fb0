#!/usr/bin/env bash
# Creates experiments/peer_maxtext/.venv (Python >= 3.12) with MaxText installed, for compare.py.
#
#   bash experiments/peer_maxtext/setup.sh
#
# Idempotent: does nothing when the venv already has the pinned MaxText. Override the pin with MAXTEXT_VERSION,
# the interpreter with PYTHON=/path/to/python3.12.
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
VENV="$HERE/.venv"
MAXTEXT_VERSION="${MAXTEXT_VERSION:-0.2.5}"

# A candidate works when it runs and is Python >= 3.12 (pyenv shims exist even when the version is not selected).
is_ok() {
  "$1" -c 'import sys; sys.exit(0 if sys.version_info >= (3, 12) else 1)' >/dev/null 2>&1
}

find_python() {
  local candidates=()
  [[ -n "${PYTHON:-}" ]] && candidates+=("$PYTHON")
  candidates+=(python3.12 python3.13 python3)
  local root="${PYENV_ROOT:-$HOME/.pyenv}"
  for p in "$root"/versions/3.12*/bin/python3.12 "$root"/versions/3.13*/bin/python3.13 \
           /usr/bin/python3.12 /usr/local/bin/python3.12 /usr/bin/python3.13 /usr/local/bin/python3.13; do
    [[ -x "$p" ]] && candidates+=("$p")
  done
  for c in "${candidates[@]}"; do
    if is_ok "$c"; then command -v "$c" 2>/dev/null || echo "$c"; return 0; fi
  done
  return 1
}

MARKER="$VENV/.peer_maxtext_installed"  # written last, so a half-finished install is redone
if [[ -x "$VENV/bin/python" ]] && is_ok "$VENV/bin/python" && [[ "$(cat "$MARKER" 2>/dev/null)" == "$MAXTEXT_VERSION" ]] \
   && "$VENV/bin/python" -c 'import jax, maxtext' >/dev/null 2>&1; then
  echo "maxtext==$MAXTEXT_VERSION already installed in $VENV; nothing to do"
  exit 0
fi

if ! PY="$(find_python)"; then
  echo "error: no Python >= 3.12 on this machine (tried \$PYTHON, python3.12, python3.13, python3, pyenv versions); MaxText needs one" >&2
  exit 2
fi
echo "using $PY ($("$PY" --version 2>&1))"

if [[ ! -x "$VENV/bin/python" ]] || ! is_ok "$VENV/bin/python"; then
  rm -rf "$VENV"
  "$PY" -m venv "$VENV"
fi
"$VENV/bin/python" -m pip install --quiet --upgrade pip
"$VENV/bin/python" -m pip install "maxtext==$MAXTEXT_VERSION"
# The wheel declares no plain dependencies, only extras (tpu, cuda12, ...) that pull accelerator runtimes. MaxText
# ships a "decoupled" requirements file for running without Google Cloud (DECOUPLE_GCLOUD=TRUE) on any hardware;
# install it minus its NVIDIA/CUDA wheels, which a CPU run does not need. jax then comes with its CPU backend.
SITE="$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
REQS="$SITE/dependencies/requirements/generated_requirements/decoupled-requirements.txt"
grep -viE '^(nvidia-|cuda-|pynvml)' "$REQS" > "$VENV/decoupled-cpu-requirements.txt"
"$VENV/bin/python" -m pip install -r "$VENV/decoupled-cpu-requirements.txt"
"$VENV/bin/python" -m pip show maxtext | sed -n '1,2p'
"$VENV/bin/python" -c 'import jax; print("jax", jax.__version__)'
echo "$MAXTEXT_VERSION" > "$MARKER"
echo "done: $VENV"
