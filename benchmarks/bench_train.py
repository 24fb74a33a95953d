"""jtrainer vs transformers.Trainer (torch, CPU) vs a bare loop over the same jitted step vs the torch bridge
(jtrainer's step on transformers' own PyTorch Llama, through torchax).

    python benchmarks/bench_train.py                      # tiny and small Llama, 3 alternating repeats
    python benchmarks/bench_train.py --configs small --repeats 5 --steps 30
    python benchmarks/bench_train.py --accelerator --configs 1b --repeats 1 --no-startup   # on a GPU: bf16, MFU
    python benchmarks/bench_train.py --systems bridge hf --lora 16 --no-startup   # peft LoRA: bridge vs torch

The same job in each system: a Llama of the config (weights saved once by PyTorch transformers and loaded by
each), the same random token rows, batch and sequence length, AdamW (weight decay 0.01) with clipping at 1.0,
a linear schedule. Each run is a fresh subprocess (so peak memory is its own and nothing is warm); runs
alternate between systems. Printed per system: median steady-state tokens/s and step time (steps after the
first two), time to the end of the first step, peak resident memory; then the ratios a/b and a/c.

`--lora R` wraps transformers' model of the `bridge` and `hf` systems in a peft LoRA adapter of rank R on the
attention projections (the base frozen): LoRA fine-tuning through the bridge against transformers.Trainer + peft.

`--accelerator` runs on the default JAX backend (and torch on CUDA) rather than the CPU, every system in bf16
(fp32 master weights), with rows that carry no attention mask (as packed pretraining data: causal attention
alone, for both frameworks' fused kernels), and also prints peak device memory and model FLOPs utilisation
(jtrainer.sizing.throughput's FLOPs per token and peak, the same numbers for every system). The `1b` config is
Llama 3.2 1B's shape (tied embeddings, vocabulary 128,256) with random weights.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

CONFIGS = {
    "tiny": dict(
        hidden_size=64,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=1024,
        seq=128,
        batch=8,
    ),
    "small": dict(
        hidden_size=256,
        intermediate_size=688,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=4,
        vocab_size=4096,
        seq=256,
        batch=8,
    ),
    "1b": dict(
        hidden_size=2048,
        intermediate_size=8192,
        num_hidden_layers=16,
        num_attention_heads=32,
        num_key_value_heads=8,
        vocab_size=128256,
        rope_theta=500000.0,
        tie_word_embeddings=True,
        seq=2048,
        batch=8,
    ),
}
SHAPE_KEYS = ("seq", "batch")
SYSTEMS = ("jtrainer", "hf", "bare", "bridge")


def _rows(cfg, n, accelerator, seed=0):
    import numpy as np

    rng = np.random.RandomState(seed)
    ids = rng.randint(0, cfg["vocab_size"], (n, cfg["seq"])).astype(np.int64)
    if accelerator:
        return [{"input_ids": r, "labels": r.copy()} for r in ids]
    return [{"input_ids": r, "attention_mask": np.ones_like(r), "labels": r.copy()} for r in ids]


def _weights(cfg, folder):
    import torch
    import transformers

    torch.manual_seed(0)
    model_cfg = dict({"tie_word_embeddings": False}, **{k: v for k, v in cfg.items() if k not in SHAPE_KEYS})
    config = transformers.LlamaConfig(max_position_embeddings=cfg["seq"], **model_cfg)
    transformers.LlamaForCausalLM(config).save_pretrained(folder)


def _peak_rss_mb() -> float:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _train_args(cls, out, cfg, steps, accelerator, **extra):
    return cls(
        output_dir=out,
        per_device_train_batch_size=cfg["batch"],
        max_steps=steps,
        learning_rate=1e-4,
        weight_decay=0.01,
        max_grad_norm=1.0,
        logging_steps=steps,
        save_strategy="no",
        report_to="none",
        disable_tqdm=True,
        train_sampling_strategy="sequential",
        bf16=accelerator,
        **extra,
    )


def _jax_extras(model, cfg) -> dict:
    """Peak device memory (where the backend reports it) and the numbers MFU is computed from."""
    import jax

    from jtrainer.sizing import throughput

    stats = jax.devices()[0].memory_stats() or {}
    return {
        "peak_device_mb": stats.get("peak_bytes_in_use", 0) / 2**20,
        "flops_per_token": throughput.flops_per_token(model, cfg["seq"]),
        "peak_flops": (throughput.peak_flops() or 0) * jax.device_count(),
        "device": jax.devices()[0].device_kind,
        "devices": jax.device_count(),
    }


def _jtrainer_run(load_model, cfg, steps, accelerator):
    """Time jtrainer's Trainer on the model `load_model()` returns (its loading timed too)."""
    import jax

    from jtrainer import Trainer, TrainerCallback, TrainingArguments

    stamps = []

    class Clock(TrainerCallback):
        def on_step_end(self, args, state, control, **kw):
            if state.global_step in (1, 2, steps):
                jax.block_until_ready(trainer._train_state)  # only to time these steps
            stamps.append(time.perf_counter())

    start = time.perf_counter()
    model = load_model()
    with tempfile.TemporaryDirectory() as out:
        trainer = Trainer(
            model,
            _train_args(TrainingArguments, out, cfg, steps, accelerator),
            train_dataset=_rows(cfg, steps * cfg["batch"], accelerator),
            callbacks=[Clock()],
        )
        trainer.train()
    return start, stamps, _jax_extras(trainer.nnx_model, cfg)


def worker_jtrainer(cfg, folder, steps, accelerator):
    from jtrainer.models import LlamaForCausalLM

    return _jtrainer_run(lambda: LlamaForCausalLM.from_pretrained(folder), cfg, steps, accelerator)


def _with_lora(model):
    """The model in a peft LoRA adapter of rank BENCH_LORA (set by --lora) on q/k/v/o, or as it is."""
    rank = int(os.environ.get("BENCH_LORA", "0"))
    if not rank:
        return model
    import peft

    targets = ["q_proj", "k_proj", "v_proj", "o_proj"]
    return peft.get_peft_model(model, peft.LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=targets))


def worker_bridge(cfg, folder, steps, accelerator):
    """jtrainer's step on transformers' own PyTorch Llama (the torch bridge, through torchax), fp32 master weights
    as every system (bf16 compute comes from the arguments on the accelerator)."""
    import torch
    import transformers

    def load():
        return _with_lora(transformers.LlamaForCausalLM.from_pretrained(folder, dtype=torch.float32))

    return _jtrainer_run(load, cfg, steps, accelerator)


def worker_hf(cfg, folder, steps, accelerator):
    import torch
    import transformers

    torch.set_num_threads(os.cpu_count())
    stamps = []

    class Clock(transformers.TrainerCallback):
        def on_step_end(self, args, state, control, **kw):
            stamps.append(time.perf_counter())

    start = time.perf_counter()
    model = _with_lora(transformers.LlamaForCausalLM.from_pretrained(folder))

    class Rows(torch.utils.data.Dataset):
        def __init__(self, rows):
            self.rows = rows

        def __len__(self):
            return len(self.rows)

        def __getitem__(self, i):
            return {k: torch.tensor(v) for k, v in self.rows[i].items()}

    with tempfile.TemporaryDirectory() as out:
        on_cuda = accelerator and torch.cuda.is_available()
        args = _train_args(transformers.TrainingArguments, out, cfg, steps, accelerator, use_cpu=not on_cuda)
        trainer = transformers.Trainer(
            model, args, train_dataset=Rows(_rows(cfg, steps * cfg["batch"], accelerator)), callbacks=[Clock()]
        )
        trainer.train()
    peak = torch.cuda.max_memory_allocated() / 2**20 if torch.cuda.is_available() else 0
    return start, stamps, {"peak_device_mb": peak}


def worker_bare(cfg, folder, steps, accelerator):
    """The Trainer's own compiled step (same optimizer, loss and shardings), called on pre-built device batches."""
    import jax

    from jtrainer import Trainer, TrainingArguments
    from jtrainer.models import LlamaForCausalLM
    from jtrainer.parallel import sharding
    from jtrainer.trainer import data
    from jtrainer.trainer.training_run import TrainingRun

    start = time.perf_counter()
    model = LlamaForCausalLM.from_pretrained(folder)
    rows = _rows(cfg, steps * cfg["batch"], accelerator)
    with tempfile.TemporaryDirectory() as out:
        trainer = Trainer(model, _train_args(TrainingArguments, out, cfg, steps, accelerator), train_dataset=rows)
        loader = trainer.get_train_dataloader()
        shapes = data.ShapeKeeper(loader.local_rows, 0)
        spec = trainer._loss_spec(shapes.pad(loader.peek(), cfg["seq"]))  # the loop's probe: kept for iteration
        trainer.create_optimizer_and_scheduler(steps)
        tx = trainer._step_optimizer()  # the optimizer as the step applies it: clipping in front
        state, shardings = trainer._initial_train_state(tx)
        step = trainer._compiled_train_step(tx, spec, shardings)
        run = TrainingRun(loader, shapes, step, steps, ragged_tail=False, label_classes=None)
        batches = [trainer._step_batch(run, [b]) for b, _ in loader]  # padded and placed as the loop does
        stamps = []
        with jax.set_mesh(trainer.mesh), sharding.axis_rules(trainer.axis_rules):
            for i, batch in enumerate(batches):
                state, metrics = step(state, batch)
                if i in (0, 1, steps - 1):
                    jax.block_until_ready(state)
                stamps.append(time.perf_counter())
    return start, stamps, _jax_extras(model, cfg)


def weights_folder(config):
    return os.path.join(tempfile.gettempdir(), f"jtrainer-bench-{config}")


def run_worker(system, config, steps, accelerator):
    cfg = CONFIGS[config]
    folder = weights_folder(config)
    if not os.path.isfile(os.path.join(folder, "config.json")):
        _weights(cfg, folder)
    worker = {"jtrainer": worker_jtrainer, "hf": worker_hf, "bare": worker_bare, "bridge": worker_bridge}[system]
    start, stamps, extras = worker(cfg, folder, steps, accelerator)
    steady = (stamps[-1] - stamps[1]) / (len(stamps) - 2)
    tokens = cfg["batch"] * cfg["seq"]
    print(
        json.dumps(
            {
                "tokens_per_second": tokens / steady,
                "step_ms": steady * 1e3,
                "first_step_s": stamps[0] - start,
                "peak_rss_mb": _peak_rss_mb(),
                **extras,
            }
        )
    )


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    parser.add_argument("--systems", nargs="+", default=list(SYSTEMS), choices=SYSTEMS)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument(
        "--no-startup",
        dest="startup",
        action="store_false",
        help="skip the time-to-first-step measurement with and without the compilation cache",
    )
    parser.add_argument(
        "--accelerator",
        action="store_true",
        help="run on the default JAX backend and torch's CUDA, in bf16, and report MFU",
    )
    parser.add_argument("--lora", type=int, default=0, help="LoRA rank for the bridge and hf systems (0: full)")
    parser.add_argument("--worker", choices=SYSTEMS, help=argparse.SUPPRESS)
    parser.add_argument("--config", help=argparse.SUPPRESS)
    ns = parser.parse_args()
    if ns.worker:
        return run_worker(ns.worker, ns.config, ns.steps, ns.accelerator)
    if ns.lora:
        os.environ["BENCH_LORA"] = str(ns.lora)  # the workers' environment
    for config in ns.configs:
        # The throughput runs share one warm compilation cache (steady state is what they measure); `startup`
        # measures the cache itself.
        results = {s: [] for s in ns.systems}
        for _ in range(ns.repeats):
            for system in ns.systems:  # alternating, so drifts of a shared machine hit every system alike
                result = _run(ns, system, config, ns.steps)
                if result is not None:
                    results[system].append(result)
        report(config, ns, {system: runs for system, runs in results.items() if runs})
        if ns.startup:
            startup(config, ns)


def _run(ns, system, config, steps, **env) -> dict | None:
    """One worker subprocess; its last stdout line is its JSON result. A failed run is reported and left out
    (None), so one system's failure does not cost the others' numbers."""
    if not ns.accelerator:
        env.setdefault("JAX_PLATFORMS", os.environ.get("JAX_PLATFORMS", "cpu"))
    command = [sys.executable, __file__, "--worker", system, "--config", config, "--steps", str(steps)]
    out = subprocess.run(
        command + ["--accelerator"] * ns.accelerator, env=dict(os.environ, **env), capture_output=True, text=True
    )
    if out.returncode:
        print(f"{system} failed (left out):\n{out.stderr[-4000:]}", flush=True)
        return None
    return json.loads(out.stdout.strip().splitlines()[-1])


def report(config, ns, results):
    cfg = CONFIGS[config]
    if not results:
        raise SystemExit(f"{config}: every system failed")
    print(
        f"\n== {config}: Llama {cfg['num_hidden_layers']} layers x {cfg['hidden_size']}, vocab "
        f"{cfg['vocab_size']}, batch {cfg['batch']} x {cfg['seq']} tokens, {ns.steps} steps, "
        f"median of {ns.repeats}" + (", bf16 on the accelerator" if ns.accelerator else "")
    )
    med = {
        s: {k: statistics.median(r[k] for r in runs) for k in runs[0] if isinstance(runs[0][k], (int, float))}
        for s, runs in results.items()
    }
    jax_run = next((runs[0] for s, runs in results.items() if s != "hf"), None)
    flops, peak = (jax_run["flops_per_token"] or 0, jax_run["peak_flops"]) if jax_run else (0, 0)
    if jax_run:
        print(f"device: {jax_run['devices']} x {jax_run['device']}; {flops:.4g} model FLOPs per token")
    print(
        f"{'system':<10}{'tokens/s':>12}{'step ms':>10}{'first step s':>14}{'peak MB':>10}{'device MB':>11}{'MFU':>8}"
    )
    for system, m in med.items():
        mfu = f"{m['tokens_per_second'] * flops / peak:.1%}" if peak and flops else "-"
        print(
            f"{system:<10}{m['tokens_per_second']:>12.0f}{m['step_ms']:>10.1f}{m['first_step_s']:>14.2f}"
            f"{m['peak_rss_mb']:>10.0f}{m['peak_device_mb']:>11.0f}{mfu:>8}"
        )
    if "jtrainer" in med and "hf" in med:
        print(
            f"a/b  jtrainer / transformers.Trainer tokens/s: "
            f"{med['jtrainer']['tokens_per_second'] / med['hf']['tokens_per_second']:.2f}x"
        )
    if "bridge" in med and "jtrainer" in med:
        print(
            f"d/a  bridge (transformers' model) / jtrainer's native model tokens/s: "
            f"{med['bridge']['tokens_per_second'] / med['jtrainer']['tokens_per_second']:.2f}x"
        )
    if "bridge" in med and "hf" in med:
        print(
            f"d/b  bridge / transformers.Trainer tokens/s: "
            f"{med['bridge']['tokens_per_second'] / med['hf']['tokens_per_second']:.2f}x"
        )
    if "jtrainer" in med and "bare" in med:
        print(
            f"a/c  jtrainer / bare jit loop tokens/s:        "
            f"{med['jtrainer']['tokens_per_second'] / med['bare']['tokens_per_second']:.3f}x"
        )


def startup(config, ns):
    """Time to the end of the first step: for jtrainer's native model and the bridge, a first run with an empty
    persistent compilation cache, then a second identical run that loads the compiled steps from it (median of
    the repeats, each with a fresh cache); for transformers.Trainer (no compilation), two runs alike. Printed
    with the ratios to torch's."""
    systems = [s for s in ("jtrainer", "bridge", "hf") if s in ns.systems]
    first: dict[str, list[float]] = {s: [] for s in systems}
    second: dict[str, list[float]] = {s: [] for s in systems}
    for _ in range(ns.repeats):
        for system in systems:
            with tempfile.TemporaryDirectory() as cache:
                for times in (first[system], second[system]):
                    result = _run(ns, system, config, 3, JTRAINER_COMPILATION_CACHE_DIR=cache)
                    if result is None:
                        raise SystemExit(f"the startup run of {system} failed")
                    times.append(result["first_step_s"])
    cold = {s: statistics.median(first[s]) for s in systems}
    warm = {s: statistics.median(second[s]) for s in systems}
    for system in systems:
        line = f"startup {system:<9} first step {cold[system]:.2f} s cold, {warm[system]:.2f} s on the second run"
        if "hf" in cold and system != "hf":
            line += f"; / torch's: {cold[system] / cold['hf']:.2f}x cold, {warm[system] / warm['hf']:.2f}x warm"
        print(line)


if __name__ == "__main__":
    main()
