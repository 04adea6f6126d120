#!/usr/bin/env bash
# Create a Python environment with this project and its pinned dependencies (pyproject.toml), for
# single-node/run.sh and multi-node/launch.sbatch. Nothing to edit: the pins come from pyproject.toml.
#
#   single-node/setup-env.sh                      # virtualenv in ./.venv, extras xformers,wandb
#   single-node/setup-env.sh --venv /fsx/envs/diffusion --extras wandb
#   single-node/setup-env.sh --conda diffusion    # conda env named "diffusion" (Python 3.11)
#
# Options: --venv DIR (default .venv in the checkout), --conda NAME (instead of a virtualenv),
# --extras LIST (default xformers,wandb; "" for none; add dev for the tests).
# PYTHON picks the interpreter for a virtualenv (default python3; it must be 3.10-3.12).
set -euo pipefail

die() { echo "setup-env.sh: error: $*" >&2; exit 2; }
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
venv="$repo/.venv"
conda_env=""
extras="xformers,wandb"
while [ $# -gt 0 ]; do
  case "$1" in
    --venv) [ $# -ge 2 ] || die "--venv needs a directory"; venv=$2; shift 2 ;;
    --conda) [ $# -ge 2 ] || die "--conda needs an environment name"; conda_env=$2; shift 2 ;;
    --extras) [ $# -ge 2 ] || die "--extras needs a list like xformers,wandb"; extras=$2; shift 2 ;;
    -h|--help) sed -n '2,/^[^#]/s/^# \{0,1\}//p' "$0"; exit 0 ;;
    *) die "unknown argument $1; options are --venv DIR, --conda NAME, --extras LIST" ;;
  esac
done
spec="$repo${extras:+[$extras]}"

if [ -n "$conda_env" ]; then
  command -v conda >/dev/null || die "--conda: conda is not on PATH; load it (module load / conda init) or use --venv"
  conda create -y -n "$conda_env" python=3.11 pip
  conda run -n "$conda_env" python -m pip install --upgrade pip
  conda run -n "$conda_env" python -m pip install -e "$spec"
  echo "done: conda activate $conda_env   (or: single-node/run.sh with that env active)"
  exit 0
fi

python=${PYTHON:-python3}
command -v "$python" >/dev/null || die "PYTHON=$python is not on PATH; set PYTHON to a Python 3.10-3.12 interpreter"
"$python" -c 'import sys; sys.exit(not (3, 10) <= sys.version_info[:2] <= (3, 12))' ||
  die "$python is Python $("$python" -c 'import platform; print(platform.python_version())'); this project needs 3.10-3.12 (set PYTHON)"
"$python" -m venv "$venv"
"$venv/bin/python" -m pip install --upgrade pip
"$venv/bin/python" -m pip install -e "$spec"
echo "done: source $venv/bin/activate   (or: single-node/run.sh --venv $venv SCRIPT ARGS)"
