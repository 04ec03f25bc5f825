#!/bin/bash
# Re-run everything: SmolVLA in venv (transformers 4.57.6), pi0/pi05 in venv_pi (transformers 4.53.2 + openpi
# transformers_replace files copied into venv_pi's transformers package, from openpi_replace/, see SOURCE.txt).
cd /tmp/lrcheck
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
{ ./venv/bin/python check.py smolvla; ./venv_pi/bin/python check.py pi0 pi05; } 2>&1 | grep -v "Location 'file:"
