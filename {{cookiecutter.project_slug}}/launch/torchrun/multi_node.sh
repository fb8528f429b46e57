#!/usr/bin/env bash
# Train on several machines with one process per GPU. Run the same command on every machine:
#   MASTER_ADDR=<first machine> bash launch/torchrun/multi_node.sh [more train.py arguments]
# torchrun's c10d rendezvous, hosted on MASTER_ADDR, waits until NNODES machines have joined,
# numbers them and starts the processes; Lightning reads torchrun's variables.
set -euo pipefail

# ---- Parameters (set them in the environment to override) ----------------------------------
# Machines in the job, and processes on each ("gpu" = one per visible GPU).
NNODES="${NNODES:-{{ cookiecutter.num_nodes }}}"
NPROC_PER_NODE="${NPROC_PER_NODE:-gpu}"
# Host name or address of the first machine, and a free port there; the same on every machine.
MASTER_ADDR="${MASTER_ADDR:?set MASTER_ADDR to the host name or address of the first machine}"
MASTER_PORT="${MASTER_PORT:-{{ cookiecutter.main_port }}}"
# Names the job in the rendezvous: the same on every machine, a new one for each job.
RDZV_ID="${RDZV_ID:-{{ cookiecutter.job_name }}}"
# How often torchrun restarts every process after a failure; they resume from the last checkpoint.
MAX_RESTARTS="${MAX_RESTARTS:-0}"
# ---------------------------------------------------------------------------------------------

cd "$(dirname "${BASH_SOURCE[0]}")/../.."  # the project root, where train.py is
# trainer.devices: auto takes torchrun's processes per node (LOCAL_WORLD_SIZE). torchrun alone exits 1
# whenever training fails; through the kit's trainkit.cluster.torchrun it exits with the training's own status.
exec python -m trainkit.cluster.torchrun --nnodes="${NNODES}" --nproc-per-node="${NPROC_PER_NODE}" \
    --rdzv-backend=c10d --rdzv-endpoint="${MASTER_ADDR}:${MASTER_PORT}" --rdzv-id="${RDZV_ID}" \
    --max-restarts="${MAX_RESTARTS}" \
    train.py fit --config configs/experiment.yaml "$@"
