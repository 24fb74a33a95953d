"""jtrainer.trl's SFT (BFD-packed rows) and DPO (explicit reference) on a mesh of 8 CPU devices: one process, or
two joined by `jtrainer launch --num_processes 2 --devices_per_process 4`; process 0 writes each run's logs as
JSON to OUT.json (tests/test_trl_mesh.py compares them with TRL's on one torch process).

    python tests/jobs/trl_mesh_job.py OUT.json
"""

import json
import os
import sys

if "JTRAINER_NUM_PROCESSES" not in os.environ:  # one process: 8 devices of its own (launched: 4 each)
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import datasets  # noqa: E402

from jtrainer import trl as jtrl  # noqa: E402
from tests import trl_cases as cases  # noqa: E402

path = sys.argv[1]
out = os.path.join(os.path.dirname(path), "runs")
mesh = {"data": 2, "fsdp": 4}
model = cases.torch_llama()
fields = dict(per_device_train_batch_size=1, mesh_shape=mesh, max_steps=2)
sft = jtrl.SFTTrainer(
    model=cases.twin(model),
    args=jtrl.SFTConfig(**cases.config_fields(f"{out}/sft", packing=True, max_length=24, **fields)),
    train_dataset=datasets.Dataset.from_list(cases.text_rows(60)),
    processing_class=cases.tokenizer(),
)
sft.train()
dpo = jtrl.DPOTrainer(
    model=cases.twin(model),
    ref_model=cases.twin(model),
    args=jtrl.DPOConfig(**cases.config_fields(f"{out}/dpo", learning_rate=1e-3, **fields)),
    train_dataset=datasets.Dataset.from_list(cases.preference_rows(16)),
    processing_class=cases.tokenizer(),
)
dpo.train()
assert dict(dpo.mesh.shape)["fsdp"] == 4
if dpo.is_world_process_zero():
    with open(path, "w") as f:
        json.dump({"sft": sft.state.log_history, "dpo": dpo.state.log_history, "processes": dpo.args.world_size}, f)
