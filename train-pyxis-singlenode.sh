#!/usr/bin/env bash
# DeepSpeed training on one SLURM node in a container (Pyxis + Enroot): salloc
# one node, then srun one task per GPU with --container-image, the repository
# and CHECKPOINT_DIR mounted at their own paths. Build the image with ./setup-pyxis.sh.
#
#   ./train-pyxis-singlenode.sh [NODE] [TRAINER FLAGS...]   NODE: any node of PARTITION when omitted
#
# Settings come from the environment: scripts/launch_common.sh, docs/LAUNCHERS.md.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")"
source scripts/launch_common.sh

single_node_main 1 "$@"
