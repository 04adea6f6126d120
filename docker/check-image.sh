#!/usr/bin/env bash
# Build docker/Dockerfile for real and run the project inside the image, on a machine with no Docker daemon
# and no container registry: podman (runc, cgroupfs) on a Debian bookworm + Python base made with debootstrap.
# For each MODE it builds the image, runs the README's one-minute benchmark (sd-tiny, 1 rank) and the tiny
# FLUX run (2 ranks, FSDP + EMA) in it, and checks their results lines. CI runs it; run it yourself to check
# an image before a cluster run.
#
#   docker/check-image.sh                      # pinned (INSTALL=pinned on a torch 2.7.0 base, the default image)
#   docker/check-image.sh pinned into-env      # ... and INSTALL=into-env on a newer torch (install/current.txt)
#   docker/check-image.sh --save DIR pinned    # ... and `podman save` each image to DIR/diffusion-MODE.tar
#   docker/check-image.sh --clean              # remove everything it keeps (the next run is a cold one)
#
# The bases stand in for pytorch/pytorch (pinned: torch 2.7.0 + torchvision 0.22.0, CUDA wheels from PyPI)
# and an NGC-style image (into-env: torch/torchvision from install/current.txt), each with `python` (a venv
# on PATH, as the real images have a conda env). Everything lives under STATE=${DIFFUSION_CI_CACHE:-
# ~/.cache/diffusion-ci}/image: podman's own storage, containers.conf and storage.conf (podman run by this
# script touches no other storage), logs/. Kept there on purpose, as the cache of the next run: the bases
# and the built images localhost/diffusion-check:MODE (their layers make a rebuild after a code change take
# under a minute). Removed on exit: its containers, dangling images, the debootstrap tree, the run's results.
# Needs root (apt-get installs podman, runc, debootstrap when missing). DEBIAN_MIRROR overrides the mirror
# read from /etc/apt/sources.list*. Exit status 1 with one line "check-image.sh: error: ..." on any failure.
set -euo pipefail
trap 'echo "check-image.sh: error: line $LINENO of $0 failed (exit status $?)" >&2' ERR

die() { echo "check-image.sh: error: $*" >&2; exit 1; }
say() { echo "check-image.sh: $*" >&2; }
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
state=${DIFFUSION_CI_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/diffusion-ci}/image
save=""
modes=()
while [ $# -gt 0 ]; do
  case "$1" in
    pinned|into-env) modes+=("$1"); shift ;;
    --save) [ $# -ge 2 ] || die "--save needs a directory"; save=$(mkdir -p "$2" && cd "$2" && pwd); shift 2 ;;
    --clean) clean=1; shift ;;
    -h|--help) sed -n '2,/^[^#]/s/^# \{0,1\}//p' "$0"; exit 0 ;;
    *) die "unknown argument $1; give modes (pinned, into-env), --save DIR or --clean" ;;
  esac
done
[ ${#modes[@]} -gt 0 ] || modes=(pinned)
[ "$(id -u)" = 0 ] || die "run it as root (podman's overlay storage and debootstrap need it)"

for tool in podman runc debootstrap; do
  command -v "$tool" >/dev/null && continue
  say "installing podman runc debootstrap with apt-get"
  { apt-get update -q && apt-get install -y -q podman runc debootstrap; } >/dev/null 2>&1 \
    || die "apt-get install -y podman runc debootstrap failed; install them by hand"
  break
done

# podman's configuration and storage, all under $state (crun fails on this kind of host: runc + cgroupfs).
mkdir -p "$state/logs" "$state/tmp"
nofile=$(ulimit -Sn)
[[ "$nofile" =~ ^[0-9]+$ ]] || nofile=1048576
cat > "$state/containers.conf" <<EOF
[containers]
default_ulimits = ["nofile=$nofile:$nofile", "nproc=32768:32768"]
[engine]
runtime = "runc"
cgroup_manager = "cgroupfs"
events_logger = "file"
events_logfile_path = "$state/events.log"
image_copy_tmp_dir = "$state/tmp"
EOF
cat > "$state/storage.conf" <<EOF
[storage]
driver = "overlay"
graphroot = "$state/storage"
runroot = "$state/run"
EOF
export CONTAINERS_CONF=$state/containers.conf CONTAINERS_STORAGE_CONF=$state/storage.conf TMPDIR=$state/tmp

if [ "${clean:-0}" = 1 ]; then
  podman rm --all --force >/dev/null 2>&1 || true
  podman rmi --all --force >/dev/null 2>&1 || true
  rm -rf "$state"
  say "removed $state"
  exit 0
fi

work=$(mktemp -d "$state/tmp/run.XXXXXX")
containers=()
cleanup() {
  for c in "${containers[@]}"; do podman rm --force --ignore "$c" >/dev/null 2>&1 || true; done
  podman image prune --force >/dev/null 2>&1 || true
  rm -rf "$work"
}
trap cleanup EXIT

# pip inside the builds uses this machine's index settings (http(s) ones; file:// and find-links are local
# paths the build cannot see) and the CA bundle update-ca-certificates writes into the base.
{
  echo "[global]"
  echo "cert = /etc/ssl/certs/ca-certificates.crt"
  python3 -m pip config list 2>/dev/null | sed -n -E "s/^[^.]*\.(index-url|extra-index-url|trusted-host)='(.*)'$/\1 \2/p" |
    while read -r key values; do
      kept=$(printf '%s\n' "$values" | tr ' ' '\n' | grep -E '^https?://|^[^/:]+$' | tr '\n' ' ' || true)
      if [ -n "$kept" ]; then echo "$key = $kept"; fi
    done
} > "$state/pip.conf"
build_opts=(--pull=never --layers -v "$state/pip.conf:/etc/pip.conf:ro")

# Base 1: Debian bookworm minbase + python3 and the host's extra CA certificates, imported with no registry.
mirror=${DEBIAN_MIRROR:-$({ cat /etc/apt/sources.list.d/*.sources /etc/apt/sources.list 2>/dev/null || true; } \
  | awk '/^(URIs:|deb) +https?:\/\// {print $2; exit}')}
mirror=${mirror:-http://deb.debian.org/debian}
certs=(/usr/local/share/ca-certificates/*.crt)
[ -e "${certs[0]}" ] || certs=()
key=$({ echo "$mirror v1"; cat "${certs[@]}" /dev/null; } | sha256sum | cut -c1-12)
debian=localhost/diffusion-check/debian:bookworm-$key
if ! podman image exists "$debian"; then
  say "making $debian with debootstrap from $mirror"
  t0=$SECONDS
  rootfs=$work/rootfs
  debootstrap --variant=minbase --include=ca-certificates,python3,python3-venv,python3-pip bookworm "$rootfs" \
    "$mirror" > "$state/logs/debootstrap.log" 2>&1 || die "debootstrap failed (log: $state/logs/debootstrap.log)"
  [ ${#certs[@]} -eq 0 ] || cp "${certs[@]}" "$rootfs/usr/local/share/ca-certificates/"
  env -i PATH=/usr/sbin:/usr/bin:/sbin:/bin chroot "$rootfs" update-ca-certificates >> "$state/logs/debootstrap.log" 2>&1 || die "update-ca-certificates failed in the base"
  rm -rf "$rootfs"/var/cache/apt/archives/*.deb "$rootfs"/var/lib/apt/lists/*
  tar -C "$rootfs" -c . | podman import - "$debian" >> "$state/logs/debootstrap.log" 2>&1 || die "podman import of the base failed"
  rm -rf "$rootfs"
  say "made $debian in $((SECONDS - t0)) s"
fi

# Base 2 per mode: a venv with `python` on PATH (as the real images' conda env) and the torch it brings.
torch_base() {  # $1 torch version, $2 torchvision version -> sets base, the image name
  local image=localhost/diffusion-check/torch:$1-$key t0=$SECONDS
  if ! podman image exists "$image"; then
    say "making $image (torch $1 + torchvision $2 from the index, with their CUDA wheels)"
    cat > "$work/Containerfile.torch" <<EOF
FROM $debian
RUN python3 -m venv /opt/venv
ENV PATH=/opt/venv/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin PYTHONUNBUFFERED=1
RUN python -m pip install -q --no-cache-dir torch==$1 torchvision==$2
EOF
    podman build "${build_opts[@]}" -t "$image" -f "$work/Containerfile.torch" "$work" \
      > "$state/logs/torch-$1.log" 2>&1 || die "building $image failed (log: $state/logs/torch-$1.log)"
    say "made $image in $((SECONDS - t0)) s"
  fi
  base=$image
}

pin() { sed -n -E "s/^$1==([^ ;]+).*/\1/p" "$repo/install/current.txt" | head -1; }

check_results() {  # $1 file, $2 expected world_size
  python3 - "$1" "$2" <<'PY' || exit 1
import json, sys
path, world = sys.argv[1], int(sys.argv[2])
try:
    rec = json.loads(open(path).read().splitlines()[-1])
except (OSError, IndexError, ValueError) as e:
    sys.exit(f"check-image.sh: error: no results line in {path} ({e})")
if rec.get("world_size") != world or not rec.get("images_per_sec"):
    sys.exit(f"check-image.sh: error: {path}: world_size {rec.get('world_size')} (want {world}), images_per_sec {rec.get('images_per_sec')}")
print(f"check-image.sh: {path.rsplit('/', 1)[-1]}: world_size {world}, {rec['images_per_sec']:.1f} images/s")
PY
}

run_in() {  # $1 image, $2 name, $3 log, command... : run in a fresh container, results in /out
  local image=$1 name=diffusion-check-$$-$2 log=$3
  shift 3
  containers+=("$name")
  podman run --rm --name "$name" --network none --shm-size 2g -v "$work:/out" "$image" "$@" > "$log" 2>&1 \
    || die "$* failed in $image (log: $log, last line: $(tail -n 1 "$log"))"
}

for mode in "${modes[@]}"; do
  t0=$SECONDS
  if [ "$mode" = pinned ]; then
    torch_base 2.7.0 0.22.0
    args=(--build-arg INSTALL=pinned)
  else
    torch_base "$(pin torch)" "$(pin torchvision)"
    args=(--build-arg INSTALL=into-env --build-arg EXTRAS=wandb)
  fi
  image=localhost/diffusion-check:$mode
  t1=$SECONDS
  say "building $image from docker/Dockerfile on $base"
  podman build "${build_opts[@]}" --build-arg BASE_IMAGE="$base" "${args[@]}" -t "$image" \
    -f "$repo/docker/Dockerfile" --ignorefile "$repo/docker/Dockerfile.dockerignore" "$repo" \
    > "$state/logs/build-$mode.log" 2>&1 \
    || die "podman build of $image failed (log: $state/logs/build-$mode.log, last line: $(tail -n 1 "$state/logs/build-$mode.log"))"
  say "built $image in $((SECONDS - t1)) s ($(podman image inspect --format '{{.Size}}' "$image" | awk '{printf "%.1f GB", $1 / 1e9}'))"

  t1=$SECONDS
  run_in "$image" "$mode-sd" "$state/logs/sd-$mode.log" composer benchmark.py --use_synth_data --model_name sd-tiny \
    --use_ema --batch_size 8 --num_workers 0 --max_duration 40ba --results "/out/sd-$mode.jsonl"
  check_results "$work/sd-$mode.jsonl" 1
  run_in "$image" "$mode-flux" "$state/logs/flux-$mode.log" composer -n 2 benchmark.py --use_synth_data \
    --model_name flux-tiny --fsdp --use_ema --batch_size 8 --max_duration 4ba --eval_interval 2ba --eval_samples 16 \
    --results "/out/flux-$mode.jsonl"
  check_results "$work/flux-$mode.jsonl" 2
  say "ran both in $image in $((SECONDS - t1)) s"

  if [ -n "$save" ]; then
    t1=$SECONDS
    rm -f "$save/diffusion-$mode.tar"
    podman save -q --format docker-archive -o "$save/diffusion-$mode.tar" "$image" || die "podman save of $image failed"
    say "saved $save/diffusion-$mode.tar ($(du -h "$save/diffusion-$mode.tar" | cut -f1)) in $((SECONDS - t1)) s"
  fi
  say "$mode: ok in $((SECONDS - t0)) s"
done
