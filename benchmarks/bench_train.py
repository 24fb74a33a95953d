"""jtrainer vs transformers.Trainer (torch, CPU) vs a bare loop over the same jitted step.

    python benchmarks/bench_train.py                      # tiny and small Llama, 3 alternating repeats
    python benchmarks/bench_train.py --configs small --repeats 5 --steps 30

The same job in each system: a Llama of the config (weights saved once by PyTorch transformers and loaded by
each), the same random token rows, batch and sequence length, AdamW (weight decay 0.01) with clipping at 1.0,
a linear schedule. Each run is a fresh subprocess (so peak memory is its own and nothing is warm); runs
alternate between systems. Printed per system: median steady-state tokens/s and step time (steps after the
first two), time to the end of the first step, peak resident memory; then the ratios a/b and a/c.
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
    "tiny": dict(hidden_size=64, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=1024, seq=128, batch=8),
    "small": dict(hidden_size=256, intermediate_size=688, num_hidden_layers=4, num_attention_heads=8,
                  num_key_value_heads=4, vocab_size=4096, seq=256, batch=8),
}
SYSTEMS = ("jtrainer", "hf", "bare")


def _rows(cfg, n, seed=0):
    import numpy as np

    rng = np.random.RandomState(seed)
    ids = rng.randint(0, cfg["vocab_size"], (n, cfg["seq"])).astype(np.int64)
    return [{"input_ids": r, "attention_mask": np.ones_like(r), "labels": r.copy()} for r in ids]


def _weights(cfg, folder):
    import torch
    import transformers

    torch.manual_seed(0)
    model_cfg = {k: v for k, v in cfg.items() if k not in ("seq", "batch")}
    config = transformers.LlamaConfig(max_position_embeddings=cfg["seq"], tie_word_embeddings=False, **model_cfg)
    transformers.LlamaForCausalLM(config).save_pretrained(folder)


def _peak_rss_mb() -> float:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _train_args(cls, out, cfg, steps, **extra):
    return cls(output_dir=out, per_device_train_batch_size=cfg["batch"], max_steps=steps, learning_rate=1e-4,
               weight_decay=0.01, max_grad_norm=1.0, logging_steps=steps, save_strategy="no", report_to="none",
               disable_tqdm=True, train_sampling_strategy="sequential", **extra)


def worker_jtrainer(cfg, folder, steps):
    import jax

    from jtrainer import Trainer, TrainerCallback, TrainingArguments
    from jtrainer.models import LlamaForCausalLM

    stamps = []

    class Clock(TrainerCallback):
        def on_step_end(self, args, state, control, **kw):
            if state.global_step in (1, 2, steps):
                jax.block_until_ready(trainer._train_state)  # only to time these steps
            stamps.append(time.perf_counter())

    start = time.perf_counter()
    model = LlamaForCausalLM.from_pretrained(folder)
    with tempfile.TemporaryDirectory() as out:
        trainer = Trainer(model, _train_args(TrainingArguments, out, cfg, steps), train_dataset=_rows(cfg, steps * cfg["batch"]),
                          callbacks=[Clock()])
        trainer.train()
    return start, stamps


def worker_hf(cfg, folder, steps):
    import torch
    import transformers

    torch.set_num_threads(os.cpu_count())
    stamps = []

    class Clock(transformers.TrainerCallback):
        def on_step_end(self, args, state, control, **kw):
            stamps.append(time.perf_counter())

    start = time.perf_counter()
    model = transformers.LlamaForCausalLM.from_pretrained(folder)

    class Rows(torch.utils.data.Dataset):
        def __init__(self, rows):
            self.rows = rows

        def __len__(self):
            return len(self.rows)

        def __getitem__(self, i):
            return {k: torch.tensor(v) for k, v in self.rows[i].items()}

    with tempfile.TemporaryDirectory() as out:
        args = _train_args(transformers.TrainingArguments, out, cfg, steps, use_cpu=True)
        trainer = transformers.Trainer(model, args, train_dataset=Rows(_rows(cfg, steps * cfg["batch"])),
                                       callbacks=[Clock()])
        trainer.train()
    return start, stamps


def worker_bare(cfg, folder, steps):
    """The Trainer's own compiled step (same optimizer, loss and shardings), called on pre-built device batches."""
    import jax

    from jtrainer import Trainer, TrainingArguments, data, sharding
    from jtrainer.models import LlamaForCausalLM

    start = time.perf_counter()
    model = LlamaForCausalLM.from_pretrained(folder)
    rows = _rows(cfg, steps * cfg["batch"])
    with tempfile.TemporaryDirectory() as out:
        trainer = Trainer(model, _train_args(TrainingArguments, out, cfg, steps), train_dataset=rows)
        loader = trainer.get_train_dataloader()
        shapes = data.ShapeKeeper(loader.local_rows, 0)
        batches = [trainer._step_batch([b], shapes, loader.batch_size) for b, _ in loader]
        spec = trainer._loss_spec(shapes.pad(batches and next(iter(loader))[0], cfg["seq"]))
        trainer.create_optimizer_and_scheduler(steps)
        state, shardings = trainer._initial_train_state(trainer.optimizer)
        step = trainer._compiled_train_step(trainer.optimizer, spec, shardings)
        stamps = []
        with jax.set_mesh(trainer.mesh), sharding.axis_rules(trainer.axis_rules):
            for i, batch in enumerate(batches):
                state, metrics = step(state, batch)
                if i in (0, 1, steps - 1):
                    jax.block_until_ready(state)
                stamps.append(time.perf_counter())
    return start, stamps


def run_worker(system, config, steps):
    cfg = CONFIGS[config]
    folder = os.path.join(tempfile.gettempdir(), f"jtrainer-bench-{config}")
    if not os.path.isfile(os.path.join(folder, "config.json")):
        _weights(cfg, folder)
    start, stamps = {"jtrainer": worker_jtrainer, "hf": worker_hf, "bare": worker_bare}[system](cfg, folder, steps)
    steady = (stamps[-1] - stamps[1]) / (len(stamps) - 2)
    tokens = cfg["batch"] * cfg["seq"]
    print(json.dumps({"tokens_per_second": tokens / steady, "step_ms": steady * 1e3,
                      "first_step_s": stamps[0] - start, "peak_rss_mb": _peak_rss_mb()}))


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    parser.add_argument("--systems", nargs="+", default=list(SYSTEMS), choices=SYSTEMS)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--no-startup", dest="startup", action="store_false",
                        help="skip the time-to-first-step measurement with and without the compilation cache")
    parser.add_argument("--worker", choices=SYSTEMS, help=argparse.SUPPRESS)
    parser.add_argument("--config", help=argparse.SUPPRESS)
    ns = parser.parse_args()
    if ns.worker:
        return run_worker(ns.worker, ns.config, ns.steps)
    # The throughput runs share one warm compilation cache (steady state is what they measure); `startup`
    # measures the cache itself.
    env = dict(os.environ, JAX_PLATFORMS=os.environ.get("JAX_PLATFORMS", "cpu"))
    for config in ns.configs:
        results = {s: [] for s in ns.systems}
        for _ in range(ns.repeats):
            for system in ns.systems:  # alternating, so drifts of a shared machine hit every system alike
                out = subprocess.run([sys.executable, __file__, "--worker", system, "--config", config,
                                      "--steps", str(ns.steps)], env=env, capture_output=True, text=True)
                if out.returncode:
                    raise SystemExit(f"{system} failed:\n{out.stderr[-4000:]}")
                results[system].append(json.loads(out.stdout.strip().splitlines()[-1]))
        cfg = CONFIGS[config]
        print(f"\n== {config}: Llama {cfg['num_hidden_layers']} layers x {cfg['hidden_size']}, vocab "
              f"{cfg['vocab_size']}, batch {cfg['batch']} x {cfg['seq']} tokens, {ns.steps} steps, "
              f"median of {ns.repeats}")
        med = {s: {k: statistics.median(r[k] for r in runs) for k in runs[0]} for s, runs in results.items()}
        print(f"{'system':<10}{'tokens/s':>12}{'step ms':>10}{'first step s':>14}{'peak MB':>10}")
        for system, m in med.items():
            print(f"{system:<10}{m['tokens_per_second']:>12.0f}{m['step_ms']:>10.1f}{m['first_step_s']:>14.2f}"
                  f"{m['peak_rss_mb']:>10.0f}")
        if "jtrainer" in med and "hf" in med:
            print(f"a/b  jtrainer / transformers.Trainer tokens/s: "
                  f"{med['jtrainer']['tokens_per_second'] / med['hf']['tokens_per_second']:.2f}x")
        if "jtrainer" in med and "bare" in med:
            print(f"a/c  jtrainer / bare jit loop tokens/s:        "
                  f"{med['jtrainer']['tokens_per_second'] / med['bare']['tokens_per_second']:.3f}x")
        if ns.startup:
            startup(config, ns)


def startup(config, ns):
    """Time to the end of the first step: a first run with an empty persistent compilation cache, then a second
    identical run that loads the compiled steps from it (median of the repeats, each with a fresh cache)."""
    first, second = [], []
    for _ in range(ns.repeats):
        with tempfile.TemporaryDirectory() as cache:
            env = dict(os.environ, JAX_PLATFORMS=os.environ.get("JAX_PLATFORMS", "cpu"),
                       JTRAINER_COMPILATION_CACHE_DIR=cache)
            for times in (first, second):
                out = subprocess.run([sys.executable, __file__, "--worker", "jtrainer", "--config", config,
                                      "--steps", "3"], env=env, capture_output=True, text=True)
                if out.returncode:
                    raise SystemExit(f"startup run failed:\n{out.stderr[-4000:]}")
                times.append(json.loads(out.stdout.strip().splitlines()[-1])["first_step_s"])
    a, b = statistics.median(first), statistics.median(second)
    print(f"startup: first step {a:.2f} s with an empty compilation cache, {b:.2f} s on the second run: "
          f"{b / a:.2f}x")


if __name__ == "__main__":
    main()
