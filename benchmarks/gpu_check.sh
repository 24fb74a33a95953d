#!/usr/bin/env bash
# The GPU check, as one command on a machine with an NVIDIA GPU (e.g. an H200) and JAX with CUDA installed:
#   1. the machine and the versions of the stack;
#   2. cuDNN's fused attention against XLA's (values, gradients, time) at Llama 3.2 1B's attention shape;
#   3. the 1B Llama benchmark in bf16: jtrainer's native Llama, then transformers.Trainer on CUDA, then
#      transformers' own Llama through the torch bridge (needs torchax; a system that fails is left out with its
#      error), with tokens/s, step time, peak device memory and MFU (benchmarks/bench_train.py --accelerator);
#      SYSTEMS="jtrainer hf bare" measures the bare jit loop instead of the bridge.
# Everything printed also goes to $OUT/gpu_check.log (OUT defaults to /tmp/gpu-check).
#
#   bash benchmarks/gpu_check.sh                 # ~6-8 minutes on an H200, most of it compiling and loading
#   STEPS=30 SYSTEMS="jtrainer" bash benchmarks/gpu_check.sh
#   CONFIG=tiny ATTENTION_ARGS="--length 256 --heads 8 --kv-heads 2" bash benchmarks/gpu_check.sh   # a smoke test
#
# A machine without internet whose Python lacks jtrainer's pinned versions can take them as wheels in .whl/
# (installed to /tmp/site first when present); fetch them where pip works, from the repository root:
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 -d .whl \
#       flax==0.12.8 optax==0.2.8 orbax-checkpoint==0.12.8 transformers==5.24.0 torchax==0.0.13
# (16 MB; checked 2026-12-03). Their own needs (huggingface_hub>=1.31,<3, tokenizers 0.23, tensorstore>=0.1.84,
# treescope, ...) are expected on the machine; the versions printed first say what it has.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/gpu-check}
mkdir -p "$OUT"
STEPS=${STEPS:-20}
SYSTEMS=${SYSTEMS:-jtrainer hf bridge}
CONFIG=${CONFIG:-1b}
ATTENTION_ARGS=${ATTENTION_ARGS:-}
PYTHON=${PYTHON:-python3}

{
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
    if compgen -G ".whl/*.whl" >/dev/null; then
        "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
            .whl/*.whl && export PYTHONPATH=/tmp/site
    fi
    export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
    "$PYTHON" - <<'EOF'
import importlib.metadata as md
import sys

import jax

names = ("jax", "jaxlib", "flax", "optax", "orbax-checkpoint", "transformers", "torch")
versions = []
for name in names:
    try:
        versions.append(f"{name} {md.version(name)}")
    except md.PackageNotFoundError:
        versions.append(f"{name} missing")
print(f"python {sys.version.split()[0]}; " + ", ".join(versions))
print("devices:", jax.devices())
EOF
    echo "== attention: cuDNN vs XLA"
    # shellcheck disable=SC2086  # ATTENTION_ARGS and SYSTEMS are lists of words
    timeout 180 "$PYTHON" benchmarks/attention_check.py $ATTENTION_ARGS
    echo "== Llama $CONFIG, bf16"
    # shellcheck disable=SC2086
    timeout 480 "$PYTHON" benchmarks/bench_train.py --accelerator --configs "$CONFIG" --systems $SYSTEMS --repeats 1 \
        --steps "$STEPS" --no-startup
} 2>&1 | tee "$OUT/gpu_check.log"
