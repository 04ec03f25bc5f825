#!/usr/bin/env bash
# System libraries the simulators need: OSMesa (software OpenGL) for headless MuJoCo rendering, and the
# Vulkan loader + Mesa drivers that SAPIEN (ManiSkill3) looks for; Chromium and its WebDriver, in which
# tests/test_dashboard.py drives the web dashboard headless; Debian's PostgreSQL server, which the tests
# start on loopback to run the store against it (tests/postgres.py).
set -euo pipefail
# The venv with every extra and LIBERO is about 4.5 GB; say so up front rather than in a pip traceback.
free_gb="$(df -P -BG . 2>/dev/null | awk 'NR == 2 { sub("G", "", $4); print $4 }' || true)"
if [ -n "$free_gb" ] && [ "$free_gb" -lt 6 ]; then
  echo "vlamux set-up: warning: ${free_gb} GB free on $(pwd)'s disk; the set-up needs about 5 GB (the venv, LIBERO's assets)" >&2
fi
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
apt-get clean  # the downloaded .debs (a few hundred MB with Chromium) are not needed once installed
