"""transformers' Llama through the torch bridge on a mesh of this process's CPU devices (XLA_FLAGS sets how many;
argv[1]: a mesh_shape as JSON, or "one" for one device), 8 rows a step: prints the logged losses, the trained
weights' absolute sums, the train step's compile count and the parameters' PartitionSpecs as JSON (and writes
them to argv[2] from process 0, if given: under `jtrainer launch`, the torch model of every process holds the
trained weights). JOB_MODEL=lora: the Llama wrapped in a peft LoRA model (the adapters trained, the base model frozen;
the frozen weights' PartitionSpecs are printed too); JOB_MODEL=mixtral: a Mixtral of 8 experts, top-2, with its
router auxiliary loss."""

import json
import os
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import jax  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402
import transformers  # noqa: E402
from conftest import count_compiles, scratch_dir, tiny_llama_config, token_rows  # noqa: E402

import jtrainer  # noqa: E402
from jtrainer import Trainer, TrainingArguments  # noqa: E402

# This script asks jax for its devices before it builds the TrainingArguments: start-up first (under `jtrainer
# launch`, joining the other process must come before JAX touches a device).
jtrainer.initialize()
mesh = None if sys.argv[1] == "one" else json.loads(sys.argv[1])
torch.manual_seed(0)
kind = os.environ.get("JOB_MODEL", "llama")
model = transformers.LlamaForCausalLM(tiny_llama_config(hidden_size=64, intermediate_size=128))
if kind == "mixtral":
    config = tiny_llama_config(hidden_size=32, intermediate_size=48).to_dict()
    moe = dict(num_local_experts=8, num_experts_per_tok=2, output_router_logits=True, router_aux_loss_coef=0.05)
    config = {k: config[k] for k in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers")}
    heads = dict(num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    model = transformers.MixtralForCausalLM(transformers.MixtralConfig(**config, **heads, **moe))
if kind == "lora":
    import peft

    lora = peft.LoraConfig(r=8, target_modules=["q_proj", "v_proj", "o_proj"], init_lora_weights=False)
    model = peft.get_peft_model(model, lora)
args = TrainingArguments(
    output_dir=scratch_dir(),
    # HF's per-device batch is per data-parallel rank: `tensor` devices share their rows.
    per_device_train_batch_size=8 // (jax.device_count() // (mesh or {}).get("tensor", 1)),
    learning_rate=3e-3,
    max_steps=4,
    logging_steps=1,
    report_to="none",
    disable_tqdm=True,
    save_strategy="no",
    train_sampling_strategy="sequential",
    mesh_shape=mesh,
)
trainer = Trainer(model=model, args=args, train_dataset=token_rows(32, ragged_labels=True))
with count_compiles() as compiles:
    trainer.train()
specs = {
    name.removesuffix(".value"): str(value.sharding.spec)  # model state's names end in their Variable's value
    for tree in (trainer._train_state.params, trainer._train_state.model_state)
    for name, value in jax.tree_util.tree_flatten_with_path(tree)[0]
    for name in [jax.tree_util.keystr(name, simple=True, separator=".")]
}
result = json.dumps(
    {
        "losses": [h["loss"] for h in trainer.state.log_history if "loss" in h],
        "weights": {k: float(np.abs(v.detach().numpy()).sum()) for k, v in model.named_parameters()},
        "compiles": len(compiles),
        "specs": specs,
    }
)
print(result)
if len(sys.argv) > 2:  # every process: its torch model's tensors; together: the export
    np.savez(
        f"{sys.argv[2]}.process{jax.process_index()}.npz",
        **{k: v.detach().numpy() for k, v in model.state_dict().items()},
    )
    trainer.save_model(f"{sys.argv[2]}.export")
    if jax.process_index() == 0:
        with open(sys.argv[2], "w") as f:
            f.write(result)
