#!/usr/bin/env bash
# Train on one machine with one process per GPU:
#   bash launch/torchrun/single_node.sh [more train.py arguments, e.g. --trainer.max_epochs 10]
set -euo pipefail

# ---- Parameters (set them in the environment to override) ----------------------------------
NPROC_PER_NODE="${NPROC_PER_NODE:-gpu}"  # processes on this machine; "gpu" = one per visible GPU
# ---------------------------------------------------------------------------------------------

cd "$(dirname "${BASH_SOURCE[0]}")/../.."  # the project root, where train.py is
# trainer.devices: auto takes torchrun's processes per node (LOCAL_WORLD_SIZE). torchrun alone exits 1
# whenever training fails; through the kit's trainkit.cluster.torchrun it exits with the training's own status.
exec python -m trainkit.cluster.torchrun --standalone --nproc-per-node="${NPROC_PER_NODE}" \
    train.py fit --config configs/experiment.yaml "$@"
