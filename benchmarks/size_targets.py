"""Size the shipped pod configs for the slices they name, and the layouts that do not fit, from any machine:
each row is one `jtrainer check CONFIG --target NAME` (a cross-compile through libtpu's compile-only topologies;
nothing runs on a TPU). Prints the memory per chip against its HBM, XLA's FLOPs and the roofline estimate.

    pip install -e ".[tpu]"
    python benchmarks/size_targets.py                 # the 1B Llama on v5e-16 (fsdp and data parallel), ~6 min
    python benchmarks/size_targets.py --rows 1b-v5e-16 --rows 1b-v5p-8
    python benchmarks/size_targets.py --rows 8b-v5p-8 --rows 8b-v5p-8-chunked --rows 8b-h100x8   # Llama-3-8B's shape
    python benchmarks/size_targets.py --rows 1b-v5e-16-32k --rows 1b-v5e-16-128k   # long context (8k/32k/128k)
GPU rows (h100x8) need the CUDA plugin: pip install -e ".[gpu-target]".
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import sys
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("JTRAINER_COMPILATION_CACHE_DIR", "none")

ROWS: dict[str, tuple[str, str, list[str]]] = {
    "1b-v5e-16": ("configs/llama_1b_fsdp_v5e_16.yaml", "v5litepod-16", []),
    "1b-v5e-16-data-parallel": ("configs/llama_1b_fsdp_v5e_16.yaml", "v5litepod-16", ["--mesh_shape", '{"data": -1}']),
    "1b-v5p-8": ("configs/llama_1b_fsdp_v5e_16.yaml", "v5p-8", ["--per_device_train_batch_size", "16"]),
    "1b-v6e-8x2-slices": (
        "configs/llama_1b_fsdp_v5e_16.yaml",
        "v6e-8",
        ["--num_slices", "2", "--mesh_shape", '{"data": 2, "fsdp": 8}'],
    ),
    "gpt2-v4-8": ("configs/gpt2_small_tpu_v4_8.yaml", "v4-8", []),
    # scan_layers: one compiled decoder layer for all 16 (compare the compile column with 1b-v5e-16's)
    "1b-v5e-16-scan": ("configs/llama_1b_fsdp_v5e_16.yaml", "v5litepod-16", ["--scan_layers", "true"]),
    "1b-v5e-16-scan-chunked": (
        "configs/llama_1b_fsdp_v5e_16.yaml",
        "v5litepod-16",
        ["--scan_layers", "true", "--use_liger_kernel", "true"],
    ),
}
# Llama-3-8B's shape (32 layers, 4096/14336, 32/8 heads, vocabulary 128,256) on the same recipe, scanned layers.
LLAMA3_8B = [
    "--hidden_size",
    "4096",
    "--intermediate_size",
    "14336",
    "--num_hidden_layers",
    "32",
    "--num_attention_heads",
    "32",
    "--num_key_value_heads",
    "8",
    "--tokenizer_vocab_size",
    "128256",
    "--max_position_embeddings",
    "8192",
    "--scan_layers",
    "true",
]
ROWS["1b-h100x8"] = ("configs/llama_1b_fsdp_v5e_16.yaml", "h100x8", ["--per_device_train_batch_size", "8"])
ROWS["1b-h100x8-chunked"] = (
    "configs/llama_1b_fsdp_v5e_16.yaml",
    "h100x8",
    ["--per_device_train_batch_size", "8", "--use_liger_kernel", "true"],
)
ROWS["1b-h100x8-scan"] = (
    "configs/llama_1b_fsdp_v5e_16.yaml",
    "h100x8",
    ["--per_device_train_batch_size", "8", "--scan_layers", "true"],
)
for _target, _batch in (("v5litepod-16", "1"), ("v5p-8", "4"), ("h100x8", "2")):
    _rows = {"": [], "-chunked": ["--use_liger_kernel", "true"]}
    for _suffix, _extra in _rows.items():
        ROWS[f"8b-{_target}{_suffix}"] = (
            "configs/llama_1b_fsdp_v5e_16.yaml",
            _target,
            [*LLAMA3_8B, "--per_device_train_batch_size", _batch, "--per_device_eval_batch_size", _batch, *_extra],
        )
# Long context: one row per chip of 8k, 32k or 128k tokens, the chunked loss, no eval step; 128k splits each row
# over the `sequence` axis (context parallelism: the splash kernel's queries per chip fall with it).
LONG_CONTEXT_MESHES = {
    "v5litepod-16": {8192: '{"fsdp": 16}', 32768: '{"fsdp": 16}', 131072: '{"fsdp": 4, "sequence": 4}'},
    "v5p-8": {8192: '{"fsdp": 4}', 32768: '{"fsdp": 4}', 131072: '{"fsdp": 2, "sequence": 2}'},
}
for _target, _meshes in LONG_CONTEXT_MESHES.items():
    for _tokens, _mesh in _meshes.items():
        _long = ["--block_size", str(_tokens), "--per_device_train_batch_size", "1", "--eval_strategy", "no"]
        _long += ["--use_liger_kernel", "true", "--mesh_shape", _mesh]
        _short = _target.replace("litepod", "e")
        ROWS[f"1b-{_short}-{_tokens // 1024}k"] = (
            "configs/llama_1b_fsdp_v5e_16.yaml",
            _target,
            [*_long, "--max_position_embeddings", str(_tokens)],
        )
        ROWS[f"8b-{_short}-{_tokens // 1024}k"] = (
            "configs/llama_1b_fsdp_v5e_16.yaml",
            _target,
            [*LLAMA3_8B, *_long, "--max_position_embeddings", str(_tokens)],
        )
DEFAULT_ROWS = ["1b-v5e-16", "1b-v5e-16-data-parallel"]


def size(config: str, target: str, extra: list[str]) -> dict:
    from jtrainer.cli import parse_train_args
    from jtrainer.cli.check import run_check

    model_args, data_args, training_args, run_args = parse_train_args([config, "--target", target, *extra], "check")
    printed = io.StringIO()
    start = time.perf_counter()
    with contextlib.redirect_stdout(printed):
        result = run_check(
            model_args, data_args, training_args, run_args.target, run_args.num_slices, run_args.num_nodes
        )
    result["seconds"] = time.perf_counter() - start
    result["printed"] = printed.getvalue()
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", action="append", choices=sorted(ROWS), help=f"default: {DEFAULT_ROWS}")
    parser.add_argument("--full", action="store_true", help="also print each check's own report")
    ns = parser.parse_args()
    print("| row | target | params | per chip | of HBM | fits | XLA FLOPs/chip | step (est.) | MFU (est.) | compile |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for name in ns.rows or DEFAULT_ROWS:
        config, target, extra = ROWS[name]
        result = size(config, target, extra)
        if ns.full:
            print(result["printed"], file=sys.stderr)
        if "memory_per_device" not in result:  # XLA refused the layout: the reason is in the report
            reason = next(line for line in result["printed"].splitlines() if "does not fit" in line)
            print(
                f"| {name} | {target} | | | | no: {reason.split(': ', 2)[-1][:90]} | | | | {result['seconds']:.0f} s |"
            )
            continue
        total, hbm = result["step_bytes_per_device"], result["device_memory_bytes"]
        estimate = result["estimate"] or {}
        print(
            f"| {name} | {target} | {result['parameters'] / 1e9:.2f}B | {total / 2**30:.2f} GiB | "
            f"{total / hbm:.0%} of {hbm / 2**30:.0f} GiB | {'yes' if result['fits'] else 'no'} | "
            f"{result['flops_per_step_per_device'] or float('nan'):.2e} | {_step(estimate)} | "
            f"{_mfu(estimate)} | {result['seconds']:.0f} s |"
        )


def _step(estimate: dict) -> str:
    if "step_s" not in estimate:
        return ""
    return f"{'>= ' if estimate['mfu'] is None else ''}{estimate['step_s']:.2f} s"


def _mfu(estimate: dict) -> str:
    return "" if estimate.get("mfu") is None else f"{estimate['mfu']:.0%}"


if __name__ == "__main__":
    main()
