#!/bin/bash
# Third sweep: no-language single-task with distractors; a bigger head on the 2-task goal suite.
cd "$(dirname "$0")/../.."
P=".venv/bin/python scripts/sft_probe/probe.py"
G="--head gaussian --cosine --bench-runner-steps 0"
$P gen --task object/touch-red-cube --episodes 200 --out data/sft_probe/object-red-200-32
$P run --data data/sft_probe/object-red-200-32 --tag gauss-objred-3k $G --steps 3000 --exec 4
$P run --data data/sft_probe/goal-touch2-200-32 --tag gauss-goal2-w256d4-3k $G --steps 3000 --width 256 --depth 4 --exec 4
