"""The torch bridge on a mesh: transformers' Llama with fsdp 8, and fsdp 2 x tensor 4 from its own
tensor-parallel plan, on 8 CPU devices, equals one device (losses and trained weights to 1e-5), compiling once."""

import importlib.util
import json
import os
import subprocess
import sys

import numpy as np
import pytest

pytest.importorskip("torch")
if importlib.util.find_spec("torchax") is None:
    pytest.skip("torchax is not installed", allow_module_level=True)

JOB = os.path.join(os.path.dirname(os.path.abspath(__file__)), "jobs", "bridge_mesh_job.py")


def _run(mesh: str, devices: int, *paths: str, **env_over) -> dict:
    env = dict(os.environ, XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}", JAX_PLATFORMS="cpu")
    env.update(env_over)
    out = subprocess.run([sys.executable, JOB, mesh, *paths], env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def _equal_to_one_device(mesh: str, **env) -> dict:
    """The job on 8 devices with `mesh`: one compile, one device's losses and trained weights (1e-5)."""
    one, got = _run("one", 1, **env), _run(mesh, 8, **env)
    assert got["compiles"] == 1
    assert got["losses"] == pytest.approx(one["losses"], rel=1e-5)
    for name, total in one["weights"].items():
        assert got["weights"][name] == pytest.approx(total, rel=1e-5), name
    return got


def test_fsdp_and_tensor_parallel_from_the_tp_plan_equal_one_device():
    one = _run("one", 1)
    for mesh in ('{"fsdp": 8}', '{"fsdp": 2, "tensor": 4}'):
        got = _run(mesh, 8)
        assert got["compiles"] == 1
        assert got["losses"] == pytest.approx(one["losses"], rel=1e-5), mesh
        for name, total in one["weights"].items():
            assert got["weights"][name] == pytest.approx(total, rel=1e-5), (mesh, name)
        specs = got["specs"]
        if "tensor" in mesh:  # transformers' plan: q colwise (out over tensor), o rowwise (in over tensor)
            assert specs["params.model.layers.0.self_attn.q_proj.weight"] == "P('tensor', 'fsdp')"
            assert specs["params.model.layers.0.self_attn.o_proj.weight"] == "P('fsdp', 'tensor')"
            assert specs["params.lm_head.weight"] == "P('tensor', 'fsdp')"
        else:
            assert specs["params.model.layers.0.mlp.up_proj.weight"] == "P('fsdp',)" or "fsdp" in str(
                specs["params.model.layers.0.mlp.up_proj.weight"]
            )


def test_lora_adapters_and_frozen_base_on_the_mesh_equal_one_device():
    """A peft LoRA Llama: the frozen base laid out by the tp plan as trainable weights are (model state, not
    replicated), the adapters by the same rules (A shares its layer's input axis, B its output axis)."""
    pytest.importorskip("peft")
    got = _equal_to_one_device('{"fsdp": 2, "tensor": 4}', JOB_MODEL="lora")
    specs, layer = got["specs"], "base_model.model.model.layers.0.self_attn"
    assert specs[f"frozen.{layer}.q_proj.base_layer.weight"] == "P('tensor', 'fsdp')"
    assert specs[f"frozen.{layer}.o_proj.base_layer.weight"] == "P('fsdp', 'tensor')"
    assert specs[f"params.{layer}.q_proj.lora_A.default.weight"] == "P(None, 'fsdp')"
    assert specs[f"params.{layer}.q_proj.lora_B.default.weight"] == "P('tensor', None)"
    assert "fsdp" in specs["frozen.base_model.model.model.layers.0.mlp.up_proj.weight"]


def test_mixture_of_experts_over_the_expert_axis_equals_one_device():
    """Mixtral (8 experts, top-2, router aux loss): its stacked expert weights split over `expert` (from its own
    ep_plan), rows over fsdp x expert; 8 devices equal one device."""
    got = _equal_to_one_device('{"fsdp": 2, "expert": 4}', JOB_MODEL="mixtral")
    experts = "params.model.layers.0.mlp.experts"
    assert got["specs"][f"{experts}.gate_up_proj"] == "P('expert', None, 'fsdp')"
    assert got["specs"][f"{experts}.down_proj"] == "P('expert', 'fsdp', None)"


def test_two_processes_equal_one(tmp_path):
    """`jtrainer launch` with 2 processes x 4 CPU devices (fsdp 8) equals one process with 8; after train() each
    process's torch model holds the whole trained weights (gathered from both processes)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("JTRAINER_")}
    env.update(JAX_PLATFORMS="cpu")
    out = tmp_path / "launched.json"
    launch = [sys.executable, "-m", "jtrainer.cli", "launch", "--num_processes", "2", "--devices_per_process", "4"]
    run = subprocess.run([*launch, JOB, '{"fsdp": 8}', str(out)], env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    one = tmp_path / "one.json"
    launched, single = json.loads(out.read_text()), _run('{"fsdp": 8}', 8, str(one))
    assert launched["losses"] == pytest.approx(single["losses"], rel=1e-5)
    import safetensors.numpy

    expected = dict(np.load(f"{one}.process0.npz"))
    exported = safetensors.numpy.load_file(f"{out}.export/model.safetensors")
    assert set(exported) <= set(expected)
    first, second = (dict(np.load(f"{out}.process{i}.npz")) for i in (0, 1))
    for name, tensor in first.items():  # every process's torch model holds the same tensors, and the export too
        np.testing.assert_array_equal(second[name], tensor, err_msg=name)
        if name in exported:
            np.testing.assert_array_equal(exported[name], tensor, err_msg=name)
        # one process's run, to float noise (AdamW normalises gradients near 0 summed in another order)
        np.testing.assert_allclose(tensor, expected[name], rtol=1e-5, atol=1e-5, err_msg=name)
