"""Meshes and logical rules; one compiled step gives the same run under every layout on 8 CPU devices."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest
from conftest import tiny_llama_config

from jtrainer import Trainer, TrainingArguments
from jtrainer.models.llama import LlamaForCausalLM
from jtrainer.parallel import sharding

HERE = os.path.dirname(__file__)
LAYOUTS = [
    {"data": 8},
    {"fsdp": 8},
    {"data": 2, "fsdp": 4},
    {"fsdp": 2, "tensor": 4},
    {"data": 2, "tensor": 2, "sequence": 2},
]


def _run_layouts(tmp_path, *runs):
    """layout_job.py for each (devices, layouts) in its own process, side by side (each compile is mostly
    single-threaded); returns their results merged: {layout JSON: result}."""
    running = []
    for i, (devices, layouts) in enumerate(runs):
        out = tmp_path / f"layouts_{i}.json"
        env = dict(os.environ, XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}", JAX_PLATFORMS="cpu")
        cmd = [sys.executable, os.path.join(HERE, "jobs", "layout_job.py"), str(out)] + [json.dumps(x) for x in layouts]
        running.append(
            (out, subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True))
        )
    results = {}
    for out, process in running:
        _, stderr = process.communicate(timeout=600)
        assert process.returncode == 0, stderr[-3000:]
        results.update(json.loads(out.read_text()))
    return results


def test_every_layout_gives_the_same_run(tmp_path):
    results = _run_layouts(tmp_path, (1, [{}]), (8, LAYOUTS[:3]), (8, LAYOUTS[3:]))
    single = results.pop("{}")
    replicated_bytes = results[json.dumps({"data": 8})]["max_bytes_per_device"]
    for layout, result in results.items():
        assert result["batch"] == single["batch"] == 8, layout
        np.testing.assert_allclose(result["losses"], single["losses"], rtol=1e-5, err_msg=layout)
        assert result["compiles"] == 1, layout
    assert len(results) == len(LAYOUTS)
    # FSDP / ZeRO-3: each device holds an eighth of parameters and optimizer state (+5% for small replicated ones).
    assert results[json.dumps({"fsdp": 8})]["max_bytes_per_device"] <= replicated_bytes / 8 * 1.05


class Args:
    def __init__(self, **kw):
        self.mesh_shape = kw.get("mesh_shape")
        self.parallelism_config = kw.get("parallelism_config")
        self.fsdp = kw.get("fsdp")


def test_mesh_shape_sources_and_errors():
    assert sharding.resolve_mesh_shape(Args(), 8) == {"data": 8, "fsdp": 1, "expert": 1, "tensor": 1, "sequence": 1}
    assert sharding.resolve_mesh_shape(Args(fsdp="full_shard"), 8)["fsdp"] == 8
    assert sharding.resolve_mesh_shape(Args(mesh_shape='{"data": 2, "fsdp": -1, "tensor": 2}'), 8) == {
        "data": 2,
        "fsdp": 2,
        "expert": 1,
        "tensor": 2,
        "sequence": 1,
    }
    pc = {"dp_replicate_size": 2, "dp_shard_size": 2, "tp_size": 1, "cp_size": 2}
    assert sharding.resolve_mesh_shape(Args(parallelism_config=pc), 8) == {
        "data": 2,
        "fsdp": 2,
        "expert": 1,
        "tensor": 1,
        "sequence": 2,
    }
    with pytest.raises(ValueError, match="needs 6 devices but there are 8"):
        sharding.resolve_mesh_shape(Args(mesh_shape={"data": 3, "tensor": 2}), 8)
    with pytest.raises(ValueError, match="unknown mesh axes"):
        sharding.resolve_mesh_shape(Args(mesh_shape={"model": 8}), 8)
    with pytest.raises(ValueError, match="at most one axis may be -1"):
        sharding.resolve_mesh_shape(Args(mesh_shape={"data": -1, "fsdp": -1}), 8)


def _fake_mesh(**sizes):
    """A mesh over repeated CPU device objects: enough to compute specs and errors, never to run."""
    import jax

    full = {a: sizes.get(a, 1) for a in sharding.MESH_AXES}
    n = int(np.prod(list(full.values())))
    return sharding.make_mesh(full, [jax.devices()[0]] * n)


def test_logical_rules_give_megatron_and_zero3_specs():
    from jax.sharding import PartitionSpec as P

    model = LlamaForCausalLM.from_config(tiny_llama_config())
    specs = sharding.param_specs(model, _fake_mesh(fsdp=2, tensor=2), sharding.merged_rules())
    layer = specs["model"]["layers"][0]
    assert layer["self_attn"]["q_proj"]["kernel"] == P("fsdp", "tensor")  # column split of heads
    assert layer["self_attn"]["o_proj"]["kernel"] == P("tensor", "fsdp")  # row split
    assert layer["self_attn"]["k_proj"]["kernel"] == P("fsdp", None)  # kv heads replicated over tensor
    assert layer["mlp"]["down_proj"]["kernel"] == P("tensor", "fsdp")
    assert layer["input_layernorm"]["weight"] == P(None)
    overridden = sharding.param_specs(model, _fake_mesh(fsdp=2, tensor=2), sharding.merged_rules({"mlp": None}))
    assert overridden["model"]["layers"][0]["mlp"]["up_proj"]["kernel"] == P("fsdp", None)


def test_unannotated_parameters_get_a_default():
    from flax import nnx
    from jax.sharding import PartitionSpec as P

    layer = nnx.Linear(64, 48, rngs=nnx.Rngs(0))
    specs = sharding.param_specs(layer, _fake_mesh(fsdp=4), sharding.merged_rules())
    assert specs["kernel"] == P("fsdp", None) and specs["bias"] == P()


def test_layout_errors_name_the_parameter_and_the_fix():
    model = LlamaForCausalLM.from_config(
        tiny_llama_config(hidden_size=36, num_attention_heads=3, num_key_value_heads=1)
    )
    with pytest.raises(ValueError, match=r"lm_head.kernel of shape \(36, 64\): dimension 0.*mesh_shape"):
        sharding.param_specs(model, _fake_mesh(fsdp=8), sharding.merged_rules())
    wide = LlamaForCausalLM.from_config(tiny_llama_config())
    with pytest.raises(ValueError, match="does not divide num_attention_heads=4"):
        wide.check_mesh(_fake_mesh(tensor=8))
    with pytest.raises(ValueError, match="cannot be split over the 2-way `sequence`"):
        sharding.check_length_divisible(15, _fake_mesh(sequence=2))


def test_trainer_rejects_a_mesh_of_the_wrong_size():
    model = LlamaForCausalLM.from_config(tiny_llama_config())
    with pytest.raises(ValueError, match="needs 4 devices but there are 1"):
        Trainer(model, TrainingArguments("o", mesh_shape={"data": 2, "tensor": 2}, report_to="none"))


def test_from_pretrained_places_weights_on_their_shardings(tmp_path):
    """On 8 devices: each parameter arrives split by the rules; logits equal the unsharded model's."""
    script = """
import sys, numpy as np, jax, jax.numpy as jnp
sys.path.insert(0, sys.argv[2])
from conftest import tiny_llama_config
from jtrainer.parallel import sharding
from jtrainer.models import AutoModelForCausalLM, LlamaForCausalLM
LlamaForCausalLM.from_config(tiny_llama_config()).save_pretrained(sys.argv[1])
mesh = sharding.make_mesh(sharding.resolve_mesh_shape(type("A", (), {"mesh_shape": {"fsdp": 4, "tensor": 2}})(), 8))
sharded = AutoModelForCausalLM.from_pretrained(sys.argv[1], mesh=mesh, dtype=jnp.bfloat16)
plain = AutoModelForCausalLM.from_pretrained(sys.argv[1])
q = sharded.model.layers[0].self_attn.q_proj.kernel[...]
assert q.dtype == jnp.bfloat16 and q.sharding.spec == jax.sharding.PartitionSpec("fsdp", "tensor"), q.sharding
assert len({s.data.shape for s in q.addressable_shards}) == 1 and q.addressable_shards[0].data.shape == (8, 16)
ids = jnp.arange(12)[None]
a = np.asarray(sharded(ids).logits, np.float32)
b = np.asarray(plain(ids).logits)
assert np.abs(a - b).max() < 0.1, np.abs(a - b).max()
print("ok")
"""
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8", JAX_PLATFORMS="cpu")
    out = subprocess.run(
        [sys.executable, "-c", script, str(tmp_path), HERE], env=env, capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0 and "ok" in out.stdout, out.stderr[-3000:]
