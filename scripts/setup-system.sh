#!/usr/bin/env bash
# System libraries the simulators need: OSMesa (software OpenGL) for headless MuJoCo rendering, and the
# Vulkan loader + Mesa drivers that SAPIEN (ManiSkill3) looks for; Chromium and its WebDriver, in which
# tests/test_dashboard.py drives the web dashboard headless; Debian's PostgreSQL server, which the tests
# start on loopback to run the store against it (tests/postgres.py).
set -euo pipefail
missing=()
for pkg in libosmesa6 libgl1 libegl1 libvulkan1 mesa-vulkan-drivers chromium chromium-driver postgresql; do
  dpkg -s "$pkg" >/dev/null 2>&1 || missing+=("$pkg")
done
[ ${#missing[@]} -eq 0 ] && exit 0
if [ "$(id -u)" -ne 0 ]; then
  echo "vlamux set-up needs these system packages: ${missing[*]} (run as root: apt-get install ${missing[*]})" >&2
  exit 1
fi
apt-get update -qq
DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >/dev/null
