#!/usr/bin/env bash
# One torchrun agent on this node. srun starts it once per node (slurm/common.sh); the agents of all nodes meet
# at RDZV_ENDPOINT (c10d rendezvous, id RDZV_ID) and start NPROC_PER_NODE processes each. Usable by hand too:
#   NNODES=2 NPROC_PER_NODE=8 RDZV_ENDPOINT=node01:29500 RDZV_ID=myrun bash slurm/launch.sh train.py -c CONFIG
set -euo pipefail

NNODES=${NNODES:-${SLURM_JOB_NUM_NODES:-1}}
NPROC_PER_NODE=${NPROC_PER_NODE:-1}
RDZV_ID=${RDZV_ID:-${SLURM_JOB_ID:-collab-vit}}
: "${RDZV_ENDPOINT:?set RDZV_ENDPOINT=host:port of the first node}"

exec "${PYTHON:-python}" -m torch.distributed.run --nnodes="$NNODES" --nproc-per-node="$NPROC_PER_NODE" \
    --rdzv-backend=c10d --rdzv-endpoint="$RDZV_ENDPOINT" --rdzv-id="$RDZV_ID" --max-restarts=0 "$@"
