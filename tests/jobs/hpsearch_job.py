"""A 3-trial optuna search run by `jtrainer launch` on 2 processes; process 0 writes the trials to OUT.json.

jtrainer launch --num_processes 2 --devices_per_process 2 tests/jobs/hpsearch_job.py OUT.json
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

from conftest import tiny_llama_config, token_rows  # noqa: E402

from jtrainer import Trainer, TrainingArguments  # noqa: E402
from jtrainer.models.llama import LlamaForCausalLM  # noqa: E402


def main(out: str) -> None:
    args = TrainingArguments(
        os.path.dirname(out) + "/run",
        per_device_train_batch_size=2,
        max_steps=3,
        report_to="none",
        disable_tqdm=True,
        save_strategy="no",
        logging_steps=1,
        train_sampling_strategy="sequential",
        eval_strategy="steps",
        eval_steps=3,
    )
    trainer = Trainer(
        args=args,
        model_init=lambda trial: LlamaForCausalLM.from_config(tiny_llama_config()),
        train_dataset=token_rows(24),
        eval_dataset=token_rows(8, seed=1),
    )
    seen = []

    def space(trial):
        params = {"learning_rate": trial.suggest_float("learning_rate", 1e-4, 1e-1, log=True)}
        seen.append(params["learning_rate"])
        return params

    best = trainer.hyperparameter_search(hp_space=space, n_trials=3)
    if jax.process_index() == 0:
        with open(out, "w") as f:
            json.dump({"best": best.objective, "rates": seen}, f)
    else:
        with open(out + ".other", "w") as f:
            json.dump({"rates": seen, "best": best}, f)


if __name__ == "__main__":
    main(sys.argv[1])
