#!/usr/bin/env bash
# Run SCRIPT [ARGS...] on this node's GPUs with Composer's launcher (python -m diffusion.launch: one process per GPU), from the
# current environment, a virtualenv, or a Docker image. ARGS go to SCRIPT unchanged.
#
#   single-node/run.sh benchmark.py --use_synth_data --use_ema --device_train_microbatch_size 4
#   single-node/run.sh --gpus 4 --venv .venv train.py yamls/sd2-base-256.yaml
#   single-node/run.sh --image diffusion:latest benchmark.py --use_synth_data --results results.jsonl
#
# Options (before SCRIPT): --gpus N (ranks; default: GPUS_PER_NODE, else the GPUs CUDA_VISIBLE_DEVICES names
# (under Slurm: the step's own; set but empty = none), else every GPU nvidia-smi lists; none: 1 CPU rank),
# --venv DIR (default: VENV; activate DIR/bin/activate first), --image IMAGE (run inside this Docker image,
# with this checkout mounted at the same path).
#
# It is also the per-node launcher of multi-node/launch.sbatch: when NNODES is set it joins a job of
# NNODES nodes as node NODE_RANK (default SLURM_NODEID), meeting the others at MASTER_ADDR:MASTER_PORT,
# and with LOG_DIR set every rank's output is kept in LOG_DIR/rank<N>.{stdout,stderr}.
set -euo pipefail

die() { echo "run.sh: error: $*" >&2; exit 2; }
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
gpus=${GPUS_PER_NODE:-}
venv=${VENV:-}
image=""
while [ $# -gt 0 ]; do
  case "$1" in
    --gpus) [ $# -ge 2 ] || die "--gpus needs a number"; gpus=$2; shift 2 ;;
    --venv) [ $# -ge 2 ] || die "--venv needs a directory"; venv=$2; shift 2 ;;
    --image) [ $# -ge 2 ] || die "--image needs an image name"; image=$2; shift 2 ;;
    -h|--help) sed -n '2,/^[^#]/s/^# \{0,1\}//p' "$0"; exit 0 ;;
    --) shift; break ;;
    -*) die "unknown option $1 before the script; options are --gpus N, --venv DIR, --image IMAGE" ;;
    *) break ;;
  esac
done
[ $# -ge 1 ] || die "name the script to run, e.g. single-node/run.sh benchmark.py --use_synth_data"

if [ -n "$image" ]; then
  # The checkout (and the working directory) at the same paths inside, so relative paths in ARGS and
  # results files mean the same thing; the image provides the dependencies.
  mounts=(-v "$repo:$repo")
  case "$PWD/" in "$repo"/*) ;; *) mounts+=(-v "$PWD:$PWD") ;; esac
  exec docker run --rm --gpus all --ipc=host --network=host --ulimit memlock=-1 --ulimit stack=67108864 \
    "${mounts[@]}" -w "$PWD" -e WANDB_API_KEY -e WANDB_MODE -e HF_HOME \
    "$image" bash "$repo/single-node/run.sh" ${gpus:+--gpus "$gpus"} "$@"
fi

if [ -n "$venv" ]; then
  [ -f "$venv/bin/activate" ] || die "--venv $venv has no bin/activate; create it with single-node/setup-env.sh"
  # shellcheck disable=SC1091
  source "$venv/bin/activate"
fi
if [ -z "$gpus" ]; then
  if [ -n "${CUDA_VISIBLE_DEVICES+set}" ]; then  # what this process may use (Slurm sets it per step)
    gpus=$(tr ',' '\n' <<<"$CUDA_VISIBLE_DEVICES" | grep -c '^[0-9A-Za-z]' || true)
    [ "$CUDA_VISIBLE_DEVICES" != NoDevFiles ] || gpus=0
  else
    gpus=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)
  fi
  [ "$gpus" -gt 0 ] || gpus=1
fi
[[ "$gpus" =~ ^[1-9][0-9]*$ ]] || die "--gpus $gpus is not a positive number"

# Composer's launcher with a SIGTERM that reads as a stop, not a crash (diffusion/launch.py; its arguments)
launch=(python -m diffusion.launch -n "$gpus")
if [ -n "${NNODES:-}" ]; then
  node_rank=${NODE_RANK:-${SLURM_NODEID:-}}
  [ -n "$node_rank" ] || die "NNODES=$NNODES but neither NODE_RANK nor SLURM_NODEID is set"
  if [ -z "${MASTER_ADDR:-}" ] || [ -z "${MASTER_PORT:-}" ]; then
    die "NNODES=$NNODES needs MASTER_ADDR and MASTER_PORT"
  fi
  launch+=(--world_size "$((NNODES * gpus))" --node_rank "$node_rank"
           --master_addr "$MASTER_ADDR" --master_port "$MASTER_PORT")
fi
if [ -n "${LOG_DIR:-}" ]; then
  mkdir -p "$LOG_DIR"
  launch+=(--stdout "$LOG_DIR/rank{rank}.stdout" --stderr "$LOG_DIR/rank{rank}.stderr")
fi

# Under Slurm the time-limit warning (SIGUSR1, passed on by multi-node/launch.sbatch) reaches every process of
# the step: the ranks finish their batch and save a checkpoint (diffusion/callbacks/preemption.py), while
# Composer's launcher, which has no handler for it and would die at once (Slurm would then kill the ranks
# mid-save), ignores it. SIGTERM it handles itself: it passes it on and waits for its ranks' checkpoint.
if [ -n "${SLURM_JOB_ID:-}" ]; then
  trap '' USR1
fi
echo "run.sh: $(hostname): ${launch[*]} $*" >&2
exec "${launch[@]}" "$@"
