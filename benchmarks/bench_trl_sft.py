"""SFT throughput with and without packing on mixed-length text: jtrainer.trl's SFTTrainer vs TRL's on torch.

    python benchmarks/bench_trl_sft.py                 # small Llama, 20 steps, both systems, both modes
    python benchmarks/bench_trl_sft.py --steps 40 --systems jtrainer

The same job in each run: a Llama of 4 layers x 256 (vocabulary 4096; weights saved once by PyTorch transformers
and loaded by each system from that folder), 512 text rows of 16 to 256 words (uniform), batch 8, max_length 256,
AdamW, fp32. `unpacked`: TRL's default rows, padded per batch; `packed`: packing=True (BFD: padding-free rows
whose documents attend only within themselves). Each run is a fresh subprocess. Printed per run: tokens/s
(TRL's num_tokens, the non-padding tokens trained, over the steps after the first two), seconds to the end of
step 1, and the ratios packed / unpacked and jtrainer / TRL.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_train import CONFIGS  # noqa: E402  (bench_train's "small" Llama)

MODEL = {k: v for k, v in CONFIGS["small"].items() if k not in ("seq", "batch")} | {"max_position_embeddings": 2048}


def prepare(folder: str) -> None:
    """The model folder (weights and a word-level tokenizer) and the mixed-length rows."""
    import numpy as np
    import torch
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(**MODEL, pad_token_id=0, eos_token_id=1)).save_pretrained(folder)
    vocab = {"<pad>": 0, "<eos>": 1, "<unk>": 2, **{f"w{i}": 3 + i for i in range(MODEL["vocab_size"] - 3)}}
    tok = Tokenizer(WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = Whitespace()
    PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>"
    ).save_pretrained(folder)
    rng = np.random.RandomState(0)
    with open(os.path.join(folder, "rows.jsonl"), "w") as f:
        for _ in range(512):
            words = rng.randint(3, MODEL["vocab_size"], rng.randint(16, 257))
            f.write(json.dumps({"text": " ".join(f"w{i - 3}" for i in words)}) + "\n")


RUN = r"""
import json, sys, time
import datasets
from transformers import AutoTokenizer, TrainerCallback
system, folder, packing, steps = sys.argv[1], sys.argv[2], sys.argv[3] == "packed", int(sys.argv[4])
if system == "trl":
    from trl import SFTConfig, SFTTrainer
else:
    from jtrainer.trl import SFTConfig, SFTTrainer

class Clock(TrainerCallback):
    def __init__(self):
        self.start, self.ends = time.perf_counter(), []
    def on_step_end(self, args, state, control, **kw):
        self.ends.append(time.perf_counter())

clock = Clock()
rows = datasets.load_dataset("json", data_files=folder + "/rows.jsonl", split="train")
args = SFTConfig(output_dir=folder + "/out-" + system, per_device_train_batch_size=8, max_steps=steps, logging_steps=1,
                 max_length=256, packing=packing, bf16=False, gradient_checkpointing=False, report_to="none",
                 save_strategy="no", disable_tqdm=True, learning_rate=1e-4, use_cpu=True)
tokenizer = AutoTokenizer.from_pretrained(folder)
trainer = SFTTrainer(model=folder, args=args, train_dataset=rows, processing_class=tokenizer, callbacks=[clock])
trainer.train()
tokens = [h["num_tokens"] for h in trainer.state.log_history if "num_tokens" in h]
steady = (tokens[-1] - tokens[1]) / (clock.ends[-1] - clock.ends[1])
print(json.dumps({"tokens_per_s": steady, "first_step_s": clock.ends[0] - clock.start}))
"""


def run(system: str, folder: str, mode: str, steps: int) -> dict:
    env = dict(os.environ, JAX_PLATFORMS="cpu", TQDM_DISABLE="1")
    out = subprocess.run(
        [sys.executable, "-c", RUN, system, folder, mode, str(steps)], env=env, capture_output=True, text=True
    )
    if out.returncode != 0:
        raise SystemExit(f"{system} {mode} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--systems", nargs="+", default=["jtrainer", "trl"], choices=["jtrainer", "trl"])
    options = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        prepare(folder)
        results = {}
        for system in options.systems:
            for mode in ("unpacked", "packed"):
                started = time.perf_counter()
                results[system, mode] = run(system, folder, mode, options.steps)
                r = results[system, mode]
                print(
                    f"{system:9s} {mode:9s} {r['tokens_per_s']:9.0f} tokens/s   first step {r['first_step_s']:6.2f} s"
                    f"   (run {time.perf_counter() - started:.0f} s)",
                    flush=True,
                )
    for system in options.systems:
        ratio = results[system, "packed"]["tokens_per_s"] / results[system, "unpacked"]["tokens_per_s"]
        print(f"{system}: packed / unpacked {ratio:.2f}x")
    if len(options.systems) == 2:
        for mode in ("unpacked", "packed"):
            ratio = results["jtrainer", mode]["tokens_per_s"] / results["trl", mode]["tokens_per_s"]
            print(f"{mode}: jtrainer / TRL {ratio:.2f}x")


if __name__ == "__main__":
    main()
