"""A few training steps of a tiny Llama on rows of 1024 tokens under given meshes and attention implementations;
writes the logged losses and gradient norms as JSON.

Run as a script in a fresh process (the device count is fixed when JAX starts):
    XLA_FLAGS=--xla_force_host_platform_device_count=8 python tests/jobs/context_parallel_job.py OUT.json RUN_JSON...
where each RUN_JSON is {"mesh": {...}, "attention": "splash" | "auto", "window": null | int}.
"""

import json
import os
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")
if __name__ == "__main__":  # jtrainer runs without torch, as on a TPU VM (transformers would import it: slower)
    sys.modules["torch"] = None
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/: conftest

import numpy as np  # noqa: E402
from conftest import tiny_llama_config  # noqa: E402

from jtrainer import Trainer, TrainingArguments  # noqa: E402
from jtrainer.models.kernels import splash_attention  # noqa: E402
from jtrainer.models.llama import LlamaForCausalLM  # noqa: E402

LENGTH = 1024
ROWS = 4  # the global batch of every mesh
splash_attention.BLOCK = 128  # 8 x 8 tiles a row: the kernel's block skipping is exercised


def rows(n: int) -> list[dict]:
    """Random rows; every other one right-padded (attention_mask 0, labels -100), labels partly -100."""
    rng = np.random.RandomState(0)
    out = []
    for i in range(n):
        ids = rng.randint(0, 64, LENGTH)
        mask = np.ones(LENGTH, np.int64)
        labels = ids.copy()
        labels[: rng.randint(0, 100)] = -100
        if i % 2:
            mask[-rng.randint(1, 200) :] = 0
            labels[mask == 0] = -100
        out.append({"input_ids": ids, "attention_mask": mask, "labels": labels})
    return out


def run(spec: dict, out_dir: str) -> dict:
    os.environ["JTRAINER_ATTENTION"] = spec["attention"]
    mesh = spec["mesh"]  # {} on one device
    args = TrainingArguments(
        output_dir=out_dir,
        mesh_shape=mesh or None,
        per_device_train_batch_size=ROWS // (mesh.get("data", 1) * mesh.get("fsdp", 1)),
        max_steps=3,
        learning_rate=3e-3,
        weight_decay=0.1,
        max_grad_norm=1.0,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        disable_tqdm=True,
        train_sampling_strategy="sequential",
    )
    config = tiny_llama_config(
        hidden_size=64, intermediate_size=128, max_position_embeddings=LENGTH, sliding_window=spec.get("window")
    )
    if spec.get("window"):
        config.model_type = "mistral"  # every layer windowed
    model = LlamaForCausalLM.from_config(config)
    trainer = Trainer(model=model, args=args, train_dataset=rows(3 * ROWS))
    trainer.train()
    logs = [h for h in trainer.state.log_history if "loss" in h]
    return {"losses": [h["loss"] for h in logs], "grad_norms": [h["grad_norm"] for h in logs]}


if __name__ == "__main__":
    out, specs = sys.argv[1], [json.loads(a) for a in sys.argv[2:]]
    results = {}
    for i, spec in enumerate(specs):
        results[json.dumps(spec, sort_keys=True)] = run(spec, os.path.join(os.path.dirname(out), f"run{i}"))
    with open(out, "w") as f:
        json.dump(results, f)
