#!/bin/bash
# picotron on SLURM: one torchrun agent per node, c10d rendezvous on the first node, automatic restarts.
#   sbatch scripts/slurm.sh
# Resubmit the same script to continue a run: --init_from=auto resumes from the newest complete checkpoint.
# A run stopped by the SIGTERM before the time limit, saved on every rank, requeues its job by itself (the
# end of this script), which continues from that checkpoint.
# Lines marked CHANGE are the ones to edit for your cluster and run.

#SBATCH --job-name=picotron
#SBATCH --nodes=2                      # CHANGE: the number of nodes
#SBATCH --ntasks-per-node=1            # one torchrun agent per node; it starts the node's workers
#SBATCH --gpus-per-node=8              # CHANGE: GPUs per node (the same number goes in GPUS_PER_NODE below)
#SBATCH --cpus-per-task=64             # CHANGE: the node's cores for the data loading and the host side
#SBATCH --time=24:00:00                # CHANGE: the job's time limit
#SBATCH --signal=TERM@300              # SIGTERM 300 s before the time limit: every rank finishes its step,
                                       # they save one checkpoint together and exit (see the README). Leave
                                       # the time of a step plus a save; torchrun, which gets the signal too,
                                       # kills its workers 30 s after it, so a save must take less than that
#SBATCH --output=%x-%j.out
#SBATCH --requeue                      # the job may be requeued (by this script, after a SIGTERM's save)

set -euo pipefail

GPUS_PER_NODE=8                                                   # CHANGE: as --gpus-per-node
CONFIG=config/tiny_fineweb.py                                     # CHANGE: your config
OUT_DIR=out/${SLURM_JOB_NAME}                                     # CHANGE: where checkpoints go (shared storage)
ARGS="--tp=8"                                                     # CHANGE: the layout and any other setting;
                                                                  # keep tp dividing GPUS_PER_NODE (tp inside a node)
MAX_RESTARTS=3                                                    # CHANGE: how many times a failure restarts the job

# the first node of the allocation hosts the rendezvous
HEAD=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
PORT=29500

# NCCL: uncomment and set for your network if it does not find the right interface
# export NCCL_SOCKET_IFNAME=ib0
export OMP_NUM_THREADS=8

# A SIGTERM that every rank saved on ends each rank with status 75 (faults.SAVED_ON_SIGTERM). torchrun reports
# any worker's status but 0 as its own 1, so rank 0 also leaves this file in out_dir (faults.SIGTERM_MARK)
MARK="$OUT_DIR/stopped_by_sigterm"
rm -f "$MARK"  # an earlier job's: only this job's own stop requeues it

status=0
srun --kill-on-bad-exit=0 python -m torch.distributed.run \
    --nnodes="$SLURM_JOB_NUM_NODES" --nproc_per_node="$GPUS_PER_NODE" \
    --rdzv-id="$SLURM_JOB_ID" --rdzv-backend=c10d --rdzv-endpoint="$HEAD:$PORT" \
    --max-restarts="$MAX_RESTARTS" \
    train.py "$CONFIG" --out_dir="$OUT_DIR" --init_from=auto $ARGS || status=$?

if [ "$status" -eq 75 ] || [ -f "$MARK" ]; then
    echo "stopped by SIGTERM, every rank saved: requeueing job $SLURM_JOB_ID to continue (--init_from=auto)"
    scontrol requeue "$SLURM_JOB_ID"
fi
exit "$status"
