"""A 10-step training run under given mesh layouts; writes losses, bytes per device and compile counts as JSON.

Run as a script in a fresh process (the device count is fixed when JAX starts):
    XLA_FLAGS=--xla_force_host_platform_device_count=8 python tests/jobs/layout_job.py OUT.json LAYOUT_JSON...
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
from jtrainer.parallel.sharding import per_device_bytes  # noqa: E402


def run(layout: dict, out_dir: str) -> dict:
    # The same global batch of 8 rows in every layout: 8 / data-parallel devices per device.
    data_parallel = layout.get("data", 1) * layout.get("fsdp", 1) if layout else jax.device_count()
    per_device = 8 // data_parallel
    args = TrainingArguments(
        output_dir=out_dir,
        mesh_shape=layout or None,
        per_device_train_batch_size=per_device,
        max_steps=10,
        learning_rate=3e-3,
        warmup_steps=2,
        weight_decay=0.1,
        max_grad_norm=1.0,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        disable_tqdm=True,
        train_sampling_strategy="sequential",
    )
    model = LlamaForCausalLM.from_config(tiny_llama_config(hidden_size=64, intermediate_size=128))
    trainer = Trainer(model=model, args=args, train_dataset=token_rows(48, length=16, ragged_labels=True))
    trainer.train()
    state = trainer._train_state
    bytes_by_device = per_device_bytes((state.params, state.opt_state))
    return {
        "losses": [h["loss"] for h in trainer.state.log_history if "loss" in h],
        "max_bytes_per_device": max(bytes_by_device.values()),
        "compiles": trainer._run.train_step._cache_size(),
        "batch": trainer.get_train_dataloader().batch_size,
    }


if __name__ == "__main__":
    out, layouts = sys.argv[1], [json.loads(a) for a in sys.argv[2:]]
    results = {
        json.dumps(layout, sort_keys=True): run(layout, os.path.splitext(out)[0] + "_output") for layout in layouts
    }
    with open(out, "w") as f:
        json.dump(results, f)
