#!/usr/bin/env bash
# A SLURM job for a multi-host GPU cluster: one process per node, each using all of its node's GPUs.
#
#   tpu/slurm_gpu.sh --nodes 4 --gpus-per-node 8 --config configs/X.yaml [--partition P] [--time 24:00:00] [--dry-run]
#
# jtrainer calls jax.distributed.initialize() itself when SLURM_NTASKS > 1 (JAX reads SLURM's variables).
# --dry-run prints the batch script and the sbatch command instead of submitting.
set -euo pipefail
nodes=1 gpus=8 config="" partition="" time_limit="24:00:00" dry_run="" extra=()
while [ $# -gt 0 ]; do
  case "$1" in
    --nodes) nodes="$2"; shift 2 ;;
    --gpus-per-node) gpus="$2"; shift 2 ;;
    --config) config="$2"; shift 2 ;;
    --partition) partition="$2"; shift 2 ;;
    --time) time_limit="$2"; shift 2 ;;
    --dry-run) dry_run=1; shift ;;
    --) shift; extra=("$@"); break ;;
    *) echo "slurm_gpu.sh: unknown option $1" >&2; exit 2 ;;
  esac
done
[ -n "$config" ] || { echo "slurm_gpu.sh: --config is required" >&2; exit 2; }

script=$(cat <<SBATCH
#!/usr/bin/env bash
#SBATCH --job-name=jtrainer
#SBATCH --nodes=$nodes
#SBATCH --ntasks-per-node=1
#SBATCH --gpus-per-node=$gpus
#SBATCH --time=$time_limit
${partition:+#SBATCH --partition=$partition}
#SBATCH --output=jtrainer-%j-%t.log
srun python3 -m jtrainer.cli train $config ${extra[*]:-}
SBATCH
)
if [ -n "$dry_run" ]; then
  echo "$script"
  echo "sbatch <the script above>"
else
  echo "$script" | sbatch
fi
