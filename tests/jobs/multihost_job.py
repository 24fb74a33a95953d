"""A 10-step run for the multi-process tests, then predict_with_generate; process 0 writes losses, final
parameters and the generated ids to OUT.npz.

    jtrainer launch --num_processes 2 --devices_per_process 4 tests/jobs/multihost_job.py OUT.npz [MESH_JSON] [STEPS]
"""

import json
import os
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")
if __name__ == "__main__":  # jtrainer runs without torch, as on a TPU VM (transformers would import it: slower)
    sys.modules["torch"] = None
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/: conftest

import jax  # noqa: E402

jax.config.update("jax_disable_most_optimizations", True)

import numpy as np  # noqa: E402
from conftest import tiny_llama_config, token_rows  # noqa: E402

from jtrainer import (  # noqa: E402
    Seq2SeqTrainer,
    Seq2SeqTrainingArguments,
    Trainer,
    TrainerCallback,
    TrainingArguments,
)
from jtrainer.models import hf_io  # noqa: E402
from jtrainer.models.hf_io import to_hf_state_dict  # noqa: E402
from jtrainer.models.llama import LlamaForCausalLM  # noqa: E402


class Marker(TrainerCallback):
    """Touches OUT.step once training runs (so a test knows when to kill a process)."""

    def __init__(self, path):
        self.path = path

    def on_step_end(self, args, state, control, **kwargs):
        open(self.path, "w").write(str(state.global_step))


def main(out, mesh="{}", steps="10"):
    mesh_shape = json.loads(mesh) or None
    args = TrainingArguments(
        output_dir=os.path.dirname(out),
        mesh_shape=mesh_shape,
        per_device_train_batch_size=1,
        max_steps=int(steps),
        learning_rate=3e-3,
        warmup_steps=2,
        weight_decay=0.1,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        disable_tqdm=True,
        train_sampling_strategy="sequential",
    )
    trainer = Trainer(
        model=LlamaForCausalLM.from_config(tiny_llama_config()),
        args=args,
        train_dataset=token_rows(48, length=16, ragged_labels=True),
        eval_dataset=token_rows(10, length=16, seed=5),
        callbacks=[Marker(out + f".step{jax.process_index()}")],
    )
    trainer.train()
    metrics = trainer.evaluate()
    # predict_with_generate on every process: prompts of 6 and 9 tokens (right-padded; left-aligned for decoding).
    prompts = token_rows(10, length=9, seed=7)
    for row in prompts[::2]:
        row["attention_mask"][6:] = 0
    generator = Seq2SeqTrainer(
        model=trainer.model,
        args=Seq2SeqTrainingArguments(
            output_dir=os.path.dirname(out),
            mesh_shape=mesh_shape,
            per_device_eval_batch_size=1,
            report_to="none",
            disable_tqdm=True,
            predict_with_generate=True,
        ),
    )
    generated = generator.predict(prompts, max_new_tokens=4, eos_token_id=None).predictions
    params = to_hf_state_dict(trainer.model)
    # The export in row blocks of at most 512 bytes (a handful of rows per gather), kept by process 0 only.
    hf_io.GATHER_BLOCK_BYTES = 512
    blocked = to_hf_state_dict(trainer.model, keep=jax.process_index() == 0)
    if jax.process_index() != 0:
        assert blocked == {}, "a process that writes nothing kept tensors"
    if jax.process_index() == 0:
        losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
        np.savez(
            out,
            losses=np.asarray(losses),
            eval_loss=metrics["eval_loss"],
            processes=jax.process_count(),
            compiles=trainer._run.train_step._cache_size(),
            generated=generated,
            **{f"param:{k}": v for k, v in params.items()},
            **{f"blocked:{k}": v for k, v in blocked.items()},
        )


if __name__ == "__main__":
    main(*sys.argv[1:])
