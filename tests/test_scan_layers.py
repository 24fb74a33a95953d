"""scan_layers: the Llama family's decoder layers stacked and run as one nnx.scan give transformers' logits, the
unrolled model's loss and gradients, HF names on export and import, the same generations and the same training."""

from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import safetensors.numpy
import torch
import transformers
from conftest import count_compiles, scratch_dir, tiny_llama_config, token_rows
from flax import nnx

from jtrainer import Trainer, TrainingArguments
from jtrainer.models import AutoModelForCausalLM, hf_io
from jtrainer.models.generation import generate


def _reference(tmp_path, kind="llama", **overrides):
    """A torch model of `kind` saved to tmp_path (the folder both of our layouts load)."""
    config_class, model_class = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
        "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
    }[kind]
    base = tiny_llama_config(num_hidden_layers=3, tie_word_embeddings=False).to_dict()
    base.update(overrides)
    for key in ("model_type", "architectures", "transformers_version"):
        base.pop(key, None)
    torch.manual_seed(0)
    reference = model_class(config_class(**base)).eval()
    reference.save_pretrained(tmp_path)
    return reference


def _ids(rows=2, length=9, seed=0):
    return np.random.RandomState(seed).randint(0, 64, (rows, length))


@pytest.mark.parametrize("kind", ["llama", "qwen2", "qwen3"])
def test_scanned_layers_give_transformers_logits_and_the_unrolled_gradients(tmp_path, kind):
    reference = _reference(tmp_path, kind)
    ids = _ids()
    with torch.no_grad():
        expected = reference(torch.tensor(ids)).logits.numpy()
    plain = AutoModelForCausalLM.from_pretrained(str(tmp_path))
    scanned = AutoModelForCausalLM.from_pretrained(str(tmp_path), scan_layers=True)
    kernel = nnx.state(scanned.model.layers, nnx.Param)["mlp"]["up_proj"]["kernel"]
    assert kernel[...].shape == (3, 32, 64) and kernel.get_metadata()["logical_axes"] == ("layers", "embed", "mlp")
    np.testing.assert_allclose(np.asarray(scanned(jnp.asarray(ids)).logits), expected, atol=2e-5)

    for model in (plain, scanned):
        model.model.gradient_checkpointing = True  # remat inside the scan's body
    loss = lambda m: m(jnp.asarray(ids), labels=jnp.asarray(ids)).loss  # noqa: E731
    np.testing.assert_allclose(float(loss(scanned)), float(loss(plain)), rtol=1e-6)
    grads_plain, grads_scanned = nnx.grad(loss)(plain), nnx.grad(loss)(scanned)
    nnx.update(plain, grads_plain)
    nnx.update(scanned, grads_scanned)
    by_name_plain, by_name_scanned = hf_io.to_hf_state_dict(plain), hf_io.to_hf_state_dict(scanned)
    assert set(by_name_plain) == set(by_name_scanned)  # the gradients, under HF's per-layer names
    for name in by_name_plain:
        np.testing.assert_allclose(by_name_scanned[name], by_name_plain[name], atol=1e-6, err_msg=name)


def test_scanned_export_is_transformers_folder_and_loads_sharded(tmp_path):
    _reference(tmp_path / "ref")
    scanned = AutoModelForCausalLM.from_pretrained(str(tmp_path / "ref"), scan_layers=True)
    scanned.save_pretrained(str(tmp_path / "out"))
    back = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "out").eval()
    ids = _ids()
    with torch.no_grad():
        np.testing.assert_allclose(
            np.asarray(scanned(jnp.asarray(ids)).logits), back(torch.tensor(ids)).logits.numpy(), atol=2e-5
        )
    # Onto a mesh: every device reads only its slices of every layer's tensors.
    from jtrainer.parallel import sharding

    mesh = sharding.make_mesh(sharding.resolve_mesh_shape(SimpleNamespace(mesh_shape={"fsdp": -1}), jax.device_count()))
    placed = AutoModelForCausalLM.from_pretrained(str(tmp_path / "out"), mesh=mesh, scan_layers=True)
    kernel = placed.model.layers.mlp.down_proj.kernel[...]
    assert kernel.shape == (3, 64, 32) and kernel.sharding.spec[0] is None
    ours, theirs = hf_io.to_hf_state_dict(placed), hf_io.to_hf_state_dict(scanned)
    assert all(np.array_equal(ours[k], theirs[k]) for k in theirs)


def test_param_from_hf_inverts_the_export_layout(tmp_path):
    """hf_io.param_from_hf (what a torch checkpoint's optimizer moments are read with) takes a parameter back
    from its HF tensors: transposed kernels and per-layer tensors of a stacked parameter."""
    _reference(tmp_path)
    tensors = dict(safetensors.numpy.load_file(str(tmp_path / "model.safetensors")))
    for scan_layers in (False, True):
        model = AutoModelForCausalLM.from_pretrained(str(tmp_path), scan_layers=scan_layers)
        for path, var in nnx.to_flat_state(nnx.state(model, nnx.Param)):
            np.testing.assert_array_equal(hf_io.param_from_hf(model, path, tensors), np.asarray(var[...]))


def test_scanned_layers_generate_as_unrolled(tmp_path):
    _reference(tmp_path, pad_token_id=0, eos_token_id=None)
    plain = AutoModelForCausalLM.from_pretrained(str(tmp_path))
    scanned = AutoModelForCausalLM.from_pretrained(str(tmp_path), scan_layers=True)
    prompts = np.array([[5, 9, 17, 3], [11, 12, 13, 14]])
    for options in ({}, {"num_beams": 3}):  # the beam search reorders the stacked cache's rows
        np.testing.assert_array_equal(
            generate(scanned, prompts, max_new_tokens=6, eos_token_id=None, pad_token_id=0, **options),
            generate(plain, prompts, max_new_tokens=6, eos_token_id=None, pad_token_id=0, **options),
        )


def test_a_trainer_run_with_scanned_layers_equals_the_unrolled_run(tmp_path):
    _reference(tmp_path / "ref")

    def run(scan):
        args = TrainingArguments(
            output_dir=scratch_dir(),
            per_device_train_batch_size=4,
            max_steps=3,
            learning_rate=1e-3,
            logging_steps=1,
            save_strategy="no",
            report_to="none",
            disable_tqdm=True,
            activation_checkpointing=True,
            seed=1,
        )
        model = AutoModelForCausalLM.from_pretrained(str(tmp_path / "ref"), scan_layers=scan)
        trainer = Trainer(model=model, args=args, train_dataset=token_rows(12, length=16))
        with count_compiles() as compiles:
            trainer.train()
        return trainer, [h["loss"] for h in trainer.state.log_history if "loss" in h], len(compiles)

    plain, plain_losses, _ = run(False)
    scanned, scanned_losses, compiles = run(True)
    assert compiles == 1
    np.testing.assert_allclose(scanned_losses, plain_losses, rtol=1e-5)
    ours, theirs = hf_io.to_hf_state_dict(scanned.model), hf_io.to_hf_state_dict(plain.model)
    for name in theirs:
        np.testing.assert_allclose(ours[name], theirs[name], atol=1e-5, err_msg=name)


def test_layers_that_differ_cannot_be_scanned_and_a_checkpoint_says_how_it_was_built(tmp_path):
    config = transformers.Qwen2Config(
        **{
            **tiny_llama_config(num_hidden_layers=3).to_dict(),
            "model_type": "qwen2",
            "use_sliding_window": True,
            "sliding_window": 4,
            "max_window_layers": 1,
        }
    )
    with pytest.raises(ValueError, match="scan_layers runs one compiled layer for all, but this config's layers"):
        AutoModelForCausalLM.from_config(config, scan_layers=True)

    from jtrainer.checkpointing import checkpoint

    def trainer(scan):
        args = TrainingArguments(
            output_dir=str(tmp_path / "run"),
            per_device_train_batch_size=4,
            max_steps=1,
            save_steps=1,
            report_to="none",
            disable_tqdm=True,
        )
        model = AutoModelForCausalLM.from_config(tiny_llama_config(), scan_layers=scan)
        return Trainer(model=model, args=args, train_dataset=token_rows(4, length=16))

    trainer(False).train()
    with pytest.raises(ValueError, match="was saved without scan_layers and this model is built the other way"):
        trainer(True).train(resume_from_checkpoint=str(tmp_path / "run" / "checkpoint-1"))
    assert checkpoint.get_last_checkpoint(str(tmp_path / "run")).endswith("checkpoint-1")


def test_the_cli_refuses_scan_layers_for_other_families():
    from jtrainer.cli import tasks as jobs
    from jtrainer.core.errors import BadInput

    with pytest.raises(BadInput, match="scan_layers: only the causal-LM Llama family"):
        jobs.build_model(jobs.ModelArguments(model_type="gpt2", scan_layers=True), 64, None, 0, abstract=True)
