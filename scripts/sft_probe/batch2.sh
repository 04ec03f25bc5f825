#!/bin/bash
# Second sweep: the gaussian head on other suites, more demos, and a cheaper budget.
cd "$(dirname "$0")/../.."
P=".venv/bin/python scripts/sft_probe/probe.py"
$P gen --task goal/touch-red-cube --task goal/touch-blue-ball --episodes 200 --out data/sft_probe/goal-touch2-200-32
$P gen --task object/touch-red-cube --task object/touch-blue-ball --task object/touch-yellow-block --task object/touch-green-cube --episodes 150 --out data/sft_probe/object-touch4-150-32
$P gen --task spatial/touch-left-cube --task spatial/touch-right-cube --episodes 200 --out data/sft_probe/spatial-touch2-200-32
$P gen --task goal/touch-red-cube --episodes 600 --out data/sft_probe/goal-red-600-32
G="--head gaussian --cosine --bench-runner-steps 0"
$P run --data data/sft_probe/goal-touch2-200-32 --tag gauss-goal2-4k $G --steps 4000 --exec 2,4
$P run --data data/sft_probe/object-touch4-150-32 --tag gauss-object4-4k $G --steps 4000 --exec 4
$P run --data data/sft_probe/spatial-touch2-200-32 --tag gauss-spatial2-4k $G --steps 4000 --exec 4
$P run --data data/sft_probe/goal-red-200-32 --tag gauss-red-2k $G --steps 2000 --exec 2,4
$P run --data data/sft_probe/goal-red-600-32 --tag gauss-red600-4k $G --steps 4000 --exec 2,4
