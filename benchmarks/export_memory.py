"""Host memory of a checkpoint's HF export on many hosts: two CPU processes (4 devices each, fsdp 8) train a
~60M-parameter Llama for three steps and save after each; each process prints how much its peak resident
memory grew during each save (Linux VmHWM, reset just before it). The first save also compiles the gathers;
the later ones show the tensors held. Only process 0 writes the export, so only it should hold
the whole model (~240 MB of float32 here, 32 GB at 8B); the other takes part in the gathers and keeps nothing.

With a train state in the checkpoint (the default) the export is read back from it by process 0 inside the
commit: no gather, so process 1's memory should not grow by the model at all; `--gathered` saves with
save_only_model=True, whose export is gathered (process 0 keeps it, process 1 one block at a time).

    python benchmarks/export_memory.py            # ~2 minutes on 2 cores
    python benchmarks/export_memory.py --gathered
"""

from __future__ import annotations

import ctypes
import os
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _kib(field: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field + ":"))


def worker(out: str) -> None:
    if __name__ == "__main__":
        sys.modules["torch"] = None  # as on a TPU VM: jtrainer needs no torch
    import jax
    import numpy as np
    from flax import nnx
    from transformers import LlamaConfig

    from jtrainer import Trainer, TrainerCallback, TrainingArguments
    from jtrainer.models.llama import LlamaForCausalLM

    class SaveMemory(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            ctypes.CDLL("libc.so.6").malloc_trim(0)  # freed memory back to the system, so RSS is what is live
            with open("/proc/self/clear_refs", "w") as f:  # the peak (VmHWM) restarts from the current RSS
                f.write("5")
            self.before = _kib("VmRSS")

        def on_save(self, args, state, control, **kwargs):
            grown = (_kib("VmHWM") - self.before) / 1024
            print(
                f"process {args.process_index}: peak memory grew by {grown:,.0f} MiB during save {state.global_step}",
                flush=True,
            )

    config = LlamaConfig(
        vocab_size=32000,
        hidden_size=512,
        intermediate_size=1536,
        num_hidden_layers=8,
        num_attention_heads=8,
        num_key_value_heads=4,
        max_position_embeddings=256,
    )
    model = LlamaForCausalLM.from_config(config)
    rng = np.random.RandomState(0)
    rows = [{"input_ids": ids, "labels": ids} for ids in rng.randint(0, 32000, (16, 64)).tolist()]
    args = TrainingArguments(
        output_dir=out,
        mesh_shape={"fsdp": -1},
        per_device_train_batch_size=1,
        max_steps=3,
        save_steps=1,
        async_checkpointing=False,
        report_to="none",
        save_only_model=os.environ.get("EXPORT_MEMORY_MODE") == "gathered",
        disable_tqdm=True,
        logging_steps=1,
    )
    trainer = Trainer(model, args, train_dataset=rows, callbacks=[SaveMemory()])
    params = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
    if args.process_index == 0:
        print(f"{params / 1e6:.0f}M parameters, {params * 4 / 2**20:,.0f} MiB in float32", flush=True)
    trainer.train()


def main() -> None:
    with tempfile.TemporaryDirectory() as out:
        env = dict(
            os.environ,
            JAX_PLATFORMS="cpu",
            JTRAINER_COMPILATION_CACHE_DIR="none",
            EXPORT_MEMORY_MODE="gathered" if "--gathered" in sys.argv else "in-commit",
        )
        subprocess.run(
            [
                sys.executable,
                "-m",
                "jtrainer.cli",
                "launch",
                "--num_processes",
                "2",
                "--devices_per_process",
                "4",
                os.path.abspath(__file__),
                os.path.join(out, "run"),
            ],
            env=env,
            cwd=ROOT,
            check=True,
        )


if __name__ == "__main__":
    if len(sys.argv) > 1 and not sys.argv[1].startswith("--"):
        worker(sys.argv[1])
    else:
        main()
