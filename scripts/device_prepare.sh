#!/usr/bin/env bash
# Prepares what a call of the device tool needs beside the working tree (see docs/GPU.md), in ignored
# folders that the call carries: .whl (cp312 wheels of the packages the GPU machine's image lacks, at
# the versions this project's environment uses) and .gl (the EGL/OpenGL loader packages, unpacked
# there before rendering). Run it here, once per session, before the device check:
#   bash scripts/device_prepare.sh
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >> .git/info/exclude
grep -qx '/.gl/' .git/info/exclude 2>/dev/null || echo '/.gl/' >> .git/info/exclude

# The image has torch, numpy, safetensors, pyarrow, pandas, pillow, h5py, imageio, pyyaml, httpx,
# click, msgpack, prometheus-client, tqdm, pytest. It lacks these (PyAV too: the check's datasets
# store frames as PNG, so it is not needed there).
WHEELS=(mujoco==3.3.0 glfw==2.11.0 pyopengl==3.1.10 gymnasium==1.4.0 farama-notifications==0.0.6
        fastapi==0.165.0 starlette==1.10.0 pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0
        typing-inspection==0.4.5 uvicorn==0.54.0 sqlalchemy==2.1.9 greenlet==3.5.6 num2words==0.5.14
        cachetools==5.5.2)
mkdir -p .whl
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux1_x86_64 \
    -d .whl "${WHEELS[@]}"

mkdir -p .gl /tmp/amd64/partial
o='-oAPT::Architecture=amd64 -oAPT::Architectures=amd64 -oDir::State::Lists=/tmp/amd64'
apt-get $o update -qq
(cd .gl && apt-get $o download libvulkan1 libegl1 libglvnd0 libopengl0 libgl1 libglx0 libgles2 >/dev/null)
du -sh .whl .gl
cat <<'MSG'
ready. The device call (one command; carry .whl and .gl; timeout_s 440: the check's 400 s budget plus the
installs and its own start, so that a machine start, the run and a rerun of what failed fit the 15-minute
lease; see `python scripts/device_check.py --plan`):
  for f in .gl/*.deb; do dpkg -x $f /; done; ldconfig; v=/usr/local/nvidia/share/glvnd/egl_vendor.d/10_nvidia.json; [ -f $v ] && export __EGL_VENDOR_LIBRARY_FILENAMES=$v; python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD && PYTHONUNBUFFERED=1 python3 scripts/device_check.py --out-dir $OUT
MSG
