#!/usr/bin/env bash
# How flux-tiny-ep0-ba2-rank0.pt.xz was made, once, on 2026-12-02: the pinned set before issue 64 (transformers
# 4.57.6, diffusers 0.39.0, mosaicml-streaming 0.13.0, torch 2.7.0; a venv of that commit's pyproject.toml) and the
# code of commit 82ba85a, two batches of the FLUX recipe on synthetic data with EMA. tests/test_old_checkpoints.py
# resumes and exports it on whatever stack the venv has. Not run by the tests.
#   usage: tests/data/checkpoint-transformers-4.57/make.sh OLD_VENV_PYTHON CHECKOUT_OF_82ba85a
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
python=$1
cd "$2"
out=$(mktemp -d)
HF_HUB_OFFLINE=1 "$python" train.py yamls/flux-tiny-cpu.yaml max_duration=2ba save_interval=2ba save_folder="$out" \
  eval_interval=null batch_size=2 autoresume=false num_workers=0
xz -9 -c "$out/ep0-ba2-rank0.pt" >"$here/flux-tiny-ep0-ba2-rank0.pt.xz"
rm -rf "$out"
