"""Where the small job's host memory goes, phase by phase: the native model, the same model through the torch
bridge, and transformers.Trainer on torch, each in a fresh process as `bench_train.py` runs them.

    python benchmarks/memory_phases.py                        # native, bridge, hf (~2 minutes on 2 cores)
    python benchmarks/memory_phases.py --systems bridge --steps 16

For each phase (imports, the model, the Trainer, then each step's end) it prints resident memory (VmRSS), its
peak so far (VmHWM) and glibc malloc's arena (mapped by the heap, in use, free), then the compiled step's XLA
buffers (temporaries, arguments, outputs). The free part of the arena is memory the tuned heap keeps for reuse
(`jtrainer/runtime/host_allocator.py`); resident memory outside the arena is libraries' code and data, thread
stacks and XLA's own mappings.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_train  # noqa: E402

SYSTEMS = ("jtrainer", "bridge", "hf")


def _status_mb() -> dict[str, int]:
    with open("/proc/self/status") as f:
        fields = dict(line.split(":", 1) for line in f)
    return {key: int(fields[key].split()[0]) // 1024 for key in ("VmRSS", "VmHWM")}


class _MallInfo2(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in "arena ordblks smblks hblks hblkhd usmblks fsmblks uordblks fordblks keepcost".split()
    ]


def _heap_mb() -> dict[str, int]:
    """glibc's mallinfo2 (read here, not through jtrainer: the torch process must not import jax)."""
    mallinfo2 = getattr(ctypes.CDLL(None), "mallinfo2", None)
    if mallinfo2 is None:
        return {}
    mallinfo2.restype = _MallInfo2
    info = mallinfo2()
    return {"arena": info.arena >> 20, "in_use": info.uordblks >> 20, "free": info.fordblks >> 20}


def _phase(name: str, rows: list) -> None:
    rows.append({"phase": name, **_status_mb(), **_heap_mb()})


def worker(system: str, steps: int) -> None:
    rows: list = []
    _phase("start", rows)
    cfg = bench_train.CONFIGS["small"]
    folder = bench_train.weights_folder("small")
    if not os.path.isfile(os.path.join(folder, "config.json")):
        bench_train._weights(cfg, folder)
    import transformers

    if system == "hf":
        import torch

        torch.set_num_threads(os.cpu_count())
        trainer_class, args_class, callback_class = transformers.Trainer, transformers.TrainingArguments, None
    else:
        import jax

        from jtrainer import Trainer, TrainerCallback, TrainingArguments

        trainer_class, args_class = Trainer, TrainingArguments
    _phase("imports", rows)
    if system == "jtrainer":
        from jtrainer.models import LlamaForCausalLM

        model = LlamaForCausalLM.from_pretrained(folder)
    else:
        import torch

        model = transformers.LlamaForCausalLM.from_pretrained(folder, dtype=torch.float32)
    _phase("model", rows)
    callback_class = transformers.TrainerCallback if system == "hf" else TrainerCallback

    class Phases(callback_class):
        def on_step_end(self, args, state, control, **kw):
            _phase(f"step {state.global_step}", rows)

    buffers = {}
    with tempfile.TemporaryDirectory() as out:
        trainer = trainer_class(
            model=model,
            args=bench_train._train_args(args_class, out, cfg, steps, False),
            train_dataset=bench_train._rows(cfg, steps * cfg["batch"], False),
            callbacks=[Phases()],
        )
        _phase("trainer", rows)
        trainer.train()
        if system != "hf":
            run = trainer._run
            with trainer._mesh_context():
                analysis = run.train_step.lower(trainer._train_state, run.last_step_batch).compile()
            stats = analysis.memory_analysis()
            buffers = {
                "temporaries": stats.temp_size_in_bytes >> 20,
                "arguments": stats.argument_size_in_bytes >> 20,
                "outputs": stats.output_size_in_bytes >> 20,
                "aliased": stats.alias_size_in_bytes >> 20,
            }
            jax.block_until_ready(trainer._train_state)
    _phase("end", rows)
    print(json.dumps({"rows": rows, "buffers": buffers}))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--systems", nargs="+", default=list(SYSTEMS), choices=SYSTEMS)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--worker", choices=SYSTEMS, help=argparse.SUPPRESS)
    ns = parser.parse_args()
    if ns.worker:
        worker(ns.worker, ns.steps)
        return
    env = dict(os.environ, JAX_PLATFORMS=os.environ.get("JAX_PLATFORMS", "cpu"))
    for system in ns.systems:
        command = [sys.executable, os.path.abspath(__file__), "--worker", system, "--steps", str(ns.steps)]
        done = subprocess.run(command, env=env, capture_output=True, text=True)
        if done.returncode != 0:
            raise SystemExit(f"{system} failed:\n{done.stderr[-3000:]}")
        result = json.loads(done.stdout.strip().splitlines()[-1])
        print(f"== {system}: MB (heap: glibc malloc's arena; the tuned heap keeps what is freed)")
        print(f"{'phase':<10}{'RSS':>7}{'peak':>7}{'heap':>7}{'in use':>8}{'free':>7}")
        for row in result["rows"]:
            heap = [row.get(key, 0) for key in ("arena", "in_use", "free")]
            print(f"{row['phase']:<10}{row['VmRSS']:>7}{row['VmHWM']:>7}{heap[0]:>7}{heap[1]:>8}{heap[2]:>7}")
        if result["buffers"]:
            print("compiled step's XLA buffers (MB): " + ", ".join(f"{k} {v}" for k, v in result["buffers"].items()))


if __name__ == "__main__":
    main()
