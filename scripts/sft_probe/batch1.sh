#!/bin/bash
# First sweep of the SFT probe (tiny preset, goal/touch-red-cube, 200 demos, 32 px, agentview+wrist).
cd "$(dirname "$0")/../.."
P=".venv/bin/python scripts/sft_probe/probe.py"
D=data/sft_probe/goal-red-200-32
$P run --data $D --tag l1-tiny-4k-cos --steps 4000 --cosine --exec 1,2,4,8
$P run --data $D --tag gauss-tiny-4k-cos --head gaussian --steps 4000 --cosine --exec 1,2,4 --bench-runner-steps 0
$P run --data $D --tag l1-tiny-4k-cos-fl --steps 4000 --cosine --feature-layers --exec 1,2,4 --bench-runner-steps 0
