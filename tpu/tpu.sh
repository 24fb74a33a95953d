#!/usr/bin/env bash
# Cloud TPU VM (or pod slice) lifecycle for jtrainer: create, install, run a config on every worker, fetch logs.
#
#   tpu/tpu.sh create  --name NAME --zone ZONE [--type v4-8] [--version tpu-ubuntu2204-base] [--spot]
#   tpu/tpu.sh install --name NAME --zone ZONE [--ref main]     # jax[tpu] + this repository on every worker
#   tpu/tpu.sh run     --name NAME --zone ZONE --config configs/X.yaml [-- extra jtrainer flags]
#   tpu/tpu.sh logs    --name NAME --zone ZONE [--dest ./tpu-logs]
#   tpu/tpu.sh delete  --name NAME --zone ZONE
#
# Every worker runs the same `jtrainer train`; jax.distributed finds the other workers by itself on TPU VMs.
# --dry-run prints each command instead of running it.
set -euo pipefail

cmd="${1:-}"; shift || true
name="" zone="" type="v4-8" version="tpu-ubuntu2204-base" config="" ref="main" dest="./tpu-logs"
spot="" dry_run="" extra=()
repo_url="${JTRAINER_REPO_URL:-$(git -C "$(dirname "$0")/.." remote get-url origin 2>/dev/null || echo https://example.invalid/jtrainer.git)}"
while [ $# -gt 0 ]; do
  case "$1" in
    --name) name="$2"; shift 2 ;;
    --zone) zone="$2"; shift 2 ;;
    --type) type="$2"; shift 2 ;;
    --version) version="$2"; shift 2 ;;
    --config) config="$2"; shift 2 ;;
    --ref) ref="$2"; shift 2 ;;
    --dest) dest="$2"; shift 2 ;;
    --spot) spot="--spot"; shift ;;
    --dry-run) dry_run=1; shift ;;
    --) shift; extra=("$@"); break ;;
    *) echo "tpu.sh: unknown option $1" >&2; exit 2 ;;
  esac
done

run() {
  if [ -n "$dry_run" ]; then printf '%q ' "$@"; echo; else "$@"; fi
}
need() { [ -n "$2" ] || { echo "tpu.sh $cmd: --$1 is required" >&2; exit 2; }; }
need name "$name"; need zone "$zone"
ssh_all() { run gcloud compute tpus tpu-vm ssh "$name" --zone "$zone" --worker=all --command "$1"; }

case "$cmd" in
  create)
    run gcloud compute tpus tpu-vm create "$name" --zone "$zone" --accelerator-type "$type" --version "$version" $spot
    ;;
  install)
    ssh_all "python3 -m pip install -U 'jax[tpu]' && rm -rf jtrainer && git clone $repo_url jtrainer && cd jtrainer && git checkout $ref && python3 -m pip install -e ."
    ;;
  run)
    need config "$config"
    ssh_all "cd jtrainer && nohup python3 -m jtrainer.cli train $config ${extra[*]:-} > jtrainer-\$(hostname).log 2>&1 &"
    ;;
  logs)
    run mkdir -p "$dest"
    run gcloud compute tpus tpu-vm scp "$name:jtrainer/jtrainer-*.log" "$dest" --zone "$zone" --worker=all
    ;;
  delete)
    run gcloud compute tpus tpu-vm delete "$name" --zone "$zone" --quiet
    ;;
  *) echo "usage: tpu/tpu.sh create|install|run|logs|delete --name NAME --zone ZONE [...] [--dry-run]" >&2; exit 2 ;;
esac
