"""Host memory of a resume: a ~60M-parameter Llama trains one step and saves (params + AdamW moments: ~3 x 230 MiB
of float32), then a fresh process resumes from that checkpoint and prints how much its peak resident memory grew
from the start of train() to on_train_begin (Linux VmHWM, reset just before; the restore happens in between,
straight into the sharded abstract train state, with no throwaway initialisation), beside the train state's size.

    python benchmarks/resume_memory.py            # ~1 minute on 2 cores
"""

from __future__ import annotations

import ctypes
import os
import subprocess
import sys
import tempfile

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("JTRAINER_COMPILATION_CACHE_DIR", "none")


def _kib(field: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field + ":"))


def run(out: str, resume: bool) -> None:
    sys.modules["torch"] = None  # as on a TPU VM
    import numpy as np
    from transformers import LlamaConfig

    from jtrainer import Trainer, TrainerCallback, TrainingArguments
    from jtrainer.models.llama import LlamaForCausalLM

    class Peak(TrainerCallback):
        def on_train_begin(self, args, state, control, **kwargs):
            if resume:
                grown = (_kib("VmHWM") - self.start) / 1024
                print(
                    f"resume: peak memory grew by {grown:,.0f} MiB during the restore "
                    f"(train state {self.state_mib:,.0f} MiB)",
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
    rng = np.random.RandomState(0)
    rows = [{"input_ids": ids, "labels": ids} for ids in rng.randint(0, 32000, (8, 64)).tolist()]
    args = TrainingArguments(
        output_dir=out,
        per_device_train_batch_size=2,
        max_steps=1,
        save_steps=1,
        report_to="none",
        disable_tqdm=True,
        logging_steps=1,
    )
    peak = Peak()
    trainer = Trainer(LlamaForCausalLM.from_config(config), args, train_dataset=rows, callbacks=[peak])
    peak.state_mib = 3 * trainer.model.num_parameters() * 4 / 2**20
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    peak.start = _kib("VmRSS")
    trainer.train(resume_from_checkpoint=os.path.join(out, "checkpoint-1") if resume else None)


def main() -> None:
    with tempfile.TemporaryDirectory() as out:
        for resume in ("0", "1"):
            subprocess.run([sys.executable, os.path.abspath(__file__), out, resume], check=True)


if __name__ == "__main__":
    if len(sys.argv) > 2:
        run(sys.argv[1], sys.argv[2] == "1")
    else:
        main()
