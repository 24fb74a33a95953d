"""A training run for the checkpoint/preemption tests, in its own process (to be killed or sent SIGTERM).

    python tests/ckpt_job.py OUT_DIR MAX_STEPS SAVE_STEPS EVAL(0|1) [resume]
Touches OUT_DIR/step (the global step) after every step, and OUT_DIR/evaluating during evaluations.
"""

import os
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, os.path.dirname(__file__))

import jax  # noqa: E402

jax.config.update("jax_disable_most_optimizations", True)

from conftest import tiny_llama_config, token_rows  # noqa: E402

from jtrainer import Trainer, TrainerCallback, TrainingArguments  # noqa: E402
from jtrainer.models.llama import LlamaForCausalLM  # noqa: E402


class Marker(TrainerCallback):
    def __init__(self, out):
        self.out = out

    def on_step_end(self, args, state, control, **kwargs):
        with open(os.path.join(self.out, "step"), "w") as f:
            f.write(str(state.global_step))

    def on_prediction_step(self, args, state, control, **kwargs):
        open(os.path.join(self.out, "evaluating"), "w").close()


def make_trainer(out, max_steps, save_steps, evaluate):
    os.makedirs(out, exist_ok=True)
    args = TrainingArguments(
        output_dir=out,
        per_device_train_batch_size=4,
        per_device_eval_batch_size=2,
        gradient_accumulation_steps=2,
        max_steps=max_steps,
        learning_rate=1e-3,
        lr_scheduler_type="constant",
        weight_decay=0.1,
        logging_steps=1,
        save_strategy="steps" if save_steps else "no",
        save_steps=save_steps or 500,
        eval_strategy="steps" if evaluate else "no",
        eval_steps=1,
        report_to="none",
        disable_tqdm=True,
        seed=3,
    )
    return Trainer(
        model=LlamaForCausalLM.from_config(tiny_llama_config()),
        args=args,
        train_dataset=token_rows(20, length=16, ragged_labels=True),
        eval_dataset=token_rows(200, length=16, seed=9) if evaluate else None,
        callbacks=[Marker(out)],
    )


if __name__ == "__main__":
    out, max_steps, save_steps, evaluate = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4] == "1"
    os.makedirs(out, exist_ok=True)
    make_trainer(out, max_steps, save_steps, evaluate).train(resume_from_checkpoint=len(sys.argv) > 5 or None)
