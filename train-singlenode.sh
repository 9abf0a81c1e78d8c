#!/usr/bin/env bash
# DeepSpeed training on one node.
#
#   ./train-singlenode.sh [TRAINER FLAGS...]       on this machine: one process per GPU (CPU_PROCS
#                                                  processes without GPU), exit status the trainer's; inside
#                                                  an salloc allocation: srun, one task per GPU
#   ./train-singlenode.sh NODE [TRAINER FLAGS...]  on SLURM node NODE (salloc, then srun there)
#
# Settings come from the environment: scripts/launch_common.sh, docs/LAUNCHERS.md.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")"
source scripts/launch_common.sh

single_node_main 0 "$@"
