"""peft adapters through the torch bridge, against peft on torch and transformers.Trainer with a PeftModel:
every peft method jtrainer trains gives torch's loss and adapter gradients; LoRA on Llama and Gemma3 trains as
transformers.Trainer trains it (losses, adapters), writes peft's files (no base weights), resumes exactly and
loads back with PeftModel.from_pretrained."""

import copy
import importlib.util
import json
import os

import numpy as np
import pytest

torch = pytest.importorskip("torch")
peft = pytest.importorskip("peft")
if importlib.util.find_spec("torchax") is None:  # imported by jtrainer.bridge, with its fixes for torch 2.13
    pytest.skip("torchax is not installed", allow_module_level=True)
transformers = pytest.importorskip("transformers")

from bridge_cases import _causal, _padded_lm_rows, assert_same_logs  # noqa: E402
from conftest import bridged_loss_and_grads, torch_rows  # noqa: E402
from conftest import side_by_side_args as _args  # noqa: E402

ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]


def _lora(model, **over):
    """LoRA r=8 on the attention projections; init_lora_weights=False so the adapters matter from step one."""
    kw = dict(r=8, lora_alpha=16, target_modules=ATTENTION, init_lora_weights=False, task_type="CAUSAL_LM")
    return peft.get_peft_model(model, peft.LoraConfig(**{**kw, **over}))


def _method_config(name):
    qv = ["q_proj", "v_proj"]
    lm = dict(task_type="CAUSAL_LM")
    return {
        "lora": lambda: peft.LoraConfig(r=4, target_modules=qv, init_lora_weights=False, **lm),
        "dora": lambda: peft.LoraConfig(r=4, target_modules=qv, init_lora_weights=False, use_dora=True, **lm),
        "rslora": lambda: peft.LoraConfig(r=4, target_modules=qv, init_lora_weights=False, use_rslora=True, **lm),
        "ia3": lambda: peft.IA3Config(target_modules=["v_proj", "down_proj"], feedforward_modules=["down_proj"], **lm),
        "loha": lambda: peft.LoHaConfig(r=4, target_modules=qv, init_weights=False, **lm),
        "lokr": lambda: peft.LoKrConfig(r=4, target_modules=qv, init_weights=False, **lm),
        "vera": lambda: peft.VeraConfig(r=4, target_modules=qv, init_weights=False, **lm),
        "oft": lambda: peft.OFTConfig(r=0, oft_block_size=4, target_modules=qv, **lm),
        "fourierft": lambda: peft.FourierFTConfig(n_frequency=16, target_modules=qv, **lm),
        "ln_tuning": lambda: peft.LNTuningConfig(target_modules=["input_layernorm"], **lm),
        "prompt_tuning": lambda: peft.PromptTuningConfig(num_virtual_tokens=4, **lm),
        "p_tuning": lambda: peft.PromptEncoderConfig(num_virtual_tokens=4, encoder_hidden_size=16, **lm),
        "prefix_tuning": lambda: peft.PrefixTuningConfig(num_virtual_tokens=4, **lm),
    }[name]()


METHODS = [
    "lora", "dora", "rslora", "ia3", "loha", "lokr", "vera", "oft", "fourierft", "ln_tuning",
    "prompt_tuning", "p_tuning", "prefix_tuning",
]  # fmt: skip


@pytest.mark.parametrize("method", METHODS)
def test_peft_method_traces_as_torch(method):
    """Loss and every trainable tensor's gradient through the bridge equal peft's on torch (float32)."""
    from jtrainer.bridge import adapters

    torch.manual_seed(0)
    model = peft.get_peft_model(_causal("llama"), _method_config(method))
    assert set(adapters.method_names(model)) <= adapters.TRAINED
    with torch.no_grad():  # adapters away from their identity initialisation, so gradients reach everything
        for parameter in model.parameters():
            if parameter.requires_grad and method not in ("oft",):
                parameter.add_(0.05 * torch.randn_like(parameter))
    ids = torch.randint(1, 64, (2, 12), generator=torch.Generator().manual_seed(1))
    model.eval()
    reference = model(input_ids=ids, labels=ids)
    reference.loss.backward()
    wanted = {n: p.grad.numpy() for n, p in model.named_parameters() if p.requires_grad}
    assert wanted and all(np.abs(g).max() > 0 for g in wanted.values())

    loss, got = bridged_loss_and_grads(model, input_ids=ids, labels=ids)
    np.testing.assert_allclose(loss, float(reference.loss), rtol=1e-6)
    assert set(got) == set(wanted)  # only the adapters are parameters; the base model is frozen
    for name, grad in wanted.items():
        np.testing.assert_allclose(got[name], grad, atol=2e-6, err_msg=name)


@pytest.mark.parametrize(
    "config",
    [
        lambda: peft.BOFTConfig(boft_block_size=4, target_modules=["q_proj"], task_type="CAUSAL_LM"),
        lambda: peft.AdaLoraConfig(r=4, target_modules=["q_proj"], total_step=10, task_type="CAUSAL_LM"),
    ],
    ids=["boft", "adalora"],
)
def test_untraced_peft_methods_are_refused_by_name(tmp_path, config):
    from jtrainer import Trainer, TrainingArguments

    model = peft.get_peft_model(_causal("llama"), config())
    with pytest.raises(NotImplementedError, match="BOFT|ADALORA") as error:  # before anything compiles
        Trainer(model=model, args=TrainingArguments(str(tmp_path), report_to="none"), train_dataset=[])
    assert "\n" not in str(error.value)


def _trainable(model) -> dict[str, np.ndarray]:
    return {n: p.detach().numpy().copy() for n, p in model.named_parameters() if p.requires_grad}


@pytest.mark.parametrize("name", ["llama", "gemma3"])
def test_lora_same_run_as_transformers_trainer(tmp_path, name):
    """LoRA r=8 on q/k/v/o, side by side with transformers.Trainer + peft (Llama with gradient checkpointing):
    losses, grad norms and adapters equal; the base model untouched; save_model writes peft's folder, which
    PeftModel.from_pretrained loads into the torch-trained model's logits; checkpoints hold adapters and their
    optimizer state only; merge_and_unload afterwards gives a plain transformers model of the same logits."""
    from jtrainer import Trainer, TrainingArguments

    torch.manual_seed(0)
    base = _causal(name)
    base_weights = {k: v.clone() for k, v in base.state_dict().items()}
    pristine = copy.deepcopy(base)
    model = _lora(base)
    ours_model = copy.deepcopy(model)
    rows = _padded_lm_rows(30)
    remat = dict(gradient_checkpointing=name == "llama")
    hf = transformers.Trainer(
        model=model,
        args=_args(transformers.TrainingArguments, tmp_path / "hf", **remat),
        train_dataset=torch_rows(rows),
    )
    hf.train()
    ours = Trainer(
        model=ours_model,
        args=_args(TrainingArguments, tmp_path / "jt", save_strategy="steps", save_steps=4, **remat),
        train_dataset=rows,
    )
    ours.train()
    assert ours.nnx_model.gradient_checkpointing is remat["gradient_checkpointing"]

    assert_same_logs(hf, ours, steps=8)
    assert ours.state.total_flos == pytest.approx(hf.state.total_flos, rel=1e-6)
    trained, ours_trained = _trainable(hf.model), _trainable(ours_model)
    assert set(ours_trained) == set(trained) and all("lora_" in n for n in trained)
    for key, value in ours_trained.items():
        np.testing.assert_allclose(value, trained[key], atol=1e-5, err_msg=key)
    for key, value in ours_model.get_base_model().state_dict().items():  # the base weights never moved
        if "lora_" not in key:
            torch.testing.assert_close(value, base_weights[key.replace(".base_layer", "")], rtol=0, atol=0)

    # Optimizer state: AdamW's two moments of the adapters, nothing for the base model.
    import jax

    adapter_count = sum(v.size for v in ours_trained.values())
    moments = [x for x in jax.tree.leaves(ours._train_state.opt_state) if getattr(x, "ndim", 0) > 0]
    assert sum(x.size for x in moments) == 2 * adapter_count

    # save_model: peft's adapter folder, loaded by peft on torch into the torch-trained model's predictions.
    final = tmp_path / "final"
    ours.save_model(str(final))
    assert {"adapter_model.safetensors", "adapter_config.json"} <= set(os.listdir(final))
    assert not {"model.safetensors", "pytorch_model.bin"} & set(os.listdir(final))
    loaded = peft.PeftModel.from_pretrained(pristine, str(final)).eval()
    ids = torch.tensor(np.stack([r["input_ids"] for r in rows[:4]]))
    with torch.no_grad():
        np.testing.assert_allclose(
            loaded(input_ids=ids).logits.numpy(), hf.model.eval()(input_ids=ids).logits.numpy(), atol=1e-4
        )

    # Each checkpoint: peft's files, and a train state without the base model.
    checkpoint_4 = tmp_path / "jt" / "checkpoint-4"
    files = set(os.listdir(checkpoint_4))
    assert {"adapter_model.safetensors", "adapter_config.json", "trainer_state.json", "train_state"} <= files
    assert "model.safetensors" not in files
    import orbax.checkpoint as ocp

    from jtrainer.checkpointing import checkpoint

    with ocp.StandardCheckpointer() as reader:
        saved = reader.metadata(checkpoint._orbax_path(str(checkpoint_4 / "train_state"))).item_metadata.tree
    saved_arrays = [x for x in jax.tree.leaves(saved) if hasattr(x, "shape")]
    assert "frozen" not in saved["model_state"]
    # Adapters, their two moments and small scalars: no base weights (a full-model AdamW checkpoint holds 3x them).
    assert sum(int(np.prod(x.shape)) for x in saved_arrays) < 3 * adapter_count + 64
    with open(checkpoint_4 / "adapter_config.json") as f:
        assert json.load(f)["r"] == 8

    with torch.no_grad():
        adapted = ours_model.eval()(input_ids=ids).logits.numpy()
        merged = ours_model.merge_and_unload()
        assert type(merged) is type(pristine)
        np.testing.assert_allclose(merged(input_ids=ids).logits.numpy(), adapted, atol=1e-5)


def test_lora_dropout_inside_rematerialised_layers_draws_the_same_masks():
    """peft's LoRA dropout inside layers transformers checkpoints: with gradient checkpointing the step draws the
    masks it draws without (the key passes through jax.checkpoint), so the losses are the same."""
    from conftest import scratch_dir

    from jtrainer import Trainer, TrainingArguments

    torch.manual_seed(0)
    model = _lora(_causal("llama"), lora_dropout=0.3)
    rows = _padded_lm_rows(16)
    losses = {}
    for remat in (False, True):
        args = _args(TrainingArguments, scratch_dir(), max_steps=3, gradient_checkpointing=remat)
        trainer = Trainer(model=copy.deepcopy(model), args=args, train_dataset=rows)
        trainer.train()
        losses[remat] = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    np.testing.assert_allclose(losses[True], losses[False], rtol=1e-6)


def test_bf16_holds_the_frozen_base_in_bfloat16_and_leaves_the_torch_base_alone():
    """bf16=True: the base computes in bfloat16 like the adapters, and is held so (half its memory); the
    adapters keep float32 masters; the torch model's base weights are not touched."""
    import jax
    import jax.numpy as jnp
    from conftest import scratch_dir
    from flax import nnx

    from jtrainer import Trainer, TrainingArguments
    from jtrainer.core.state import Frozen

    torch.manual_seed(0)
    model = _lora(_causal("llama"))
    base = {k: v.clone() for k, v in model.state_dict().items() if "lora_" not in k}
    args = _args(TrainingArguments, scratch_dir(), max_steps=2, bf16=True)
    trainer = Trainer(model=model, args=args, train_dataset=_padded_lm_rows(16))
    trainer.train()
    state = trainer._train_state
    frozen = [v for _, v in nnx.to_flat_state(state.model_state) if isinstance(v, Frozen)]
    assert frozen and all(v[...].dtype == jnp.bfloat16 for v in frozen)
    assert all(x.dtype == jnp.float32 for x in jax.tree.leaves(state.params))
    for key, value in model.state_dict().items():
        if key in base:
            torch.testing.assert_close(value, base[key], rtol=0, atol=0)


def test_neftune_with_a_peft_model():
    """NEFTune on a peft model: transformers' hook on the base model's input embeddings in training steps only."""
    from conftest import scratch_dir

    from jtrainer import Trainer, TrainingArguments

    torch.manual_seed(0)
    model = _lora(_causal("llama"))
    rows = _padded_lm_rows(16)

    def run(alpha):
        args = _args(TrainingArguments, scratch_dir(), max_steps=2, neftune_noise_alpha=alpha)
        trainer = Trainer(model=copy.deepcopy(model), args=args, train_dataset=rows)
        trainer.train()
        embeddings = trainer.model.get_base_model().get_input_embeddings()
        assert not hasattr(embeddings, "neftune_noise_alpha") and not embeddings._forward_hooks  # removed after
        return [h["loss"] for h in trainer.state.log_history if "loss" in h]

    quiet, noisy, again = run(None), run(5.0), run(5.0)
    assert noisy == again and noisy[0] != quiet[0]


@pytest.mark.parametrize("method", ["prompt_tuning", "prefix_tuning"])
def test_prompt_learning_same_run_as_transformers_trainer(tmp_path, method):
    """Virtual tokens before the rows (peft pads the labels and mask for them): transformers.Trainer's losses."""
    from jtrainer import Trainer, TrainingArguments

    torch.manual_seed(0)
    model = peft.get_peft_model(_causal("llama"), _method_config(method))
    ours_model = copy.deepcopy(model)
    rows = _padded_lm_rows(16)
    kw = dict(max_steps=3)
    hf = transformers.Trainer(
        model=model, args=_args(transformers.TrainingArguments, tmp_path / "hf", **kw), train_dataset=torch_rows(rows)
    )
    hf.train()
    ours = Trainer(model=ours_model, args=_args(TrainingArguments, tmp_path / "jt", **kw), train_dataset=rows)
    ours.train()
    expected = [h["loss"] for h in hf.state.log_history if "loss" in h]
    np.testing.assert_allclose([h["loss"] for h in ours.state.log_history if "loss" in h], expected, rtol=1e-5)
    for key, value in _trainable(ours_model).items():
        np.testing.assert_allclose(value, _trainable(hf.model)[key], atol=1e-5, err_msg=key)


def test_lora_resume_and_best_model(tmp_path):
    """Resume from checkpoint-4 gives the 8-step run's adapters bit for bit; load_best_model_at_end puts the best
    checkpoint's adapters into the PeftModel."""
    from jtrainer import Trainer, TrainingArguments

    torch.manual_seed(0)
    base = _causal("llama")
    pristine = copy.deepcopy(base)
    model = _lora(base)
    rows = _padded_lm_rows(30)
    kw = dict(save_strategy="steps", save_steps=4, eval_strategy="steps", eval_steps=4)

    def run(model, out, **over):
        args = _args(TrainingArguments, out, **{**kw, **over})
        trainer = Trainer(model=model, args=args, train_dataset=rows, eval_dataset=rows[:8])
        return trainer

    straight = copy.deepcopy(model)
    run(straight, tmp_path / "a").train()
    resumed = copy.deepcopy(model)
    run(resumed, tmp_path / "a2").train(resume_from_checkpoint=str(tmp_path / "a" / "checkpoint-4"))
    for key, value in _trainable(straight).items():
        np.testing.assert_array_equal(_trainable(resumed)[key], value, err_msg=key)

    best = copy.deepcopy(model)
    best_args = dict(load_best_model_at_end=True, metric_for_best_model="loss", greater_is_better=True)
    trainer = run(best, tmp_path / "b", **best_args)
    trainer.train()  # the worse (higher) eval loss is "best": step 4's, not the last
    assert trainer.state.best_model_checkpoint.endswith("checkpoint-4")
    at_best = peft.PeftModel.from_pretrained(pristine, trainer.state.best_model_checkpoint)
    wanted = {n.replace(".default", ""): v for n, v in at_best.state_dict().items() if "lora_" in n}
    for name, value in best.state_dict().items():
        if "lora_" in name:
            np.testing.assert_array_equal(value.numpy(), wanted[name.replace(".default", "")].numpy(), err_msg=name)


@pytest.mark.parametrize("adapted", [True, False], ids=["lora", "full"])
def test_resuming_a_transformers_trainer_checkpoint_through_the_bridge(tmp_path, adapted):
    """transformers.Trainer trains 4 steps (a PeftModel, or the plain torch model) saving at 2; jtrainer resumes
    its checkpoint-2 on a fresh copy of the model given to it and continues as torch did: the logs of steps 3-4
    and the weights of checkpoint-4."""
    from safetensors.numpy import load_file

    from jtrainer import Trainer, TrainingArguments

    torch.manual_seed(0)
    model = _lora(_causal("llama")) if adapted else _causal("llama")
    fresh = copy.deepcopy(model)
    rows = _padded_lm_rows(24)
    kw = dict(max_steps=4, save_strategy="steps", save_steps=2, num_train_epochs=1, gradient_accumulation_steps=1)
    hf_out = tmp_path / "hf"
    transformers.Trainer(
        model=model, args=_args(transformers.TrainingArguments, hf_out, **kw), train_dataset=torch_rows(rows)
    ).train()

    ours = Trainer(model=fresh, args=_args(TrainingArguments, tmp_path / "jt", **kw), train_dataset=rows)
    ours.train(resume_from_checkpoint=str(hf_out / "checkpoint-2"))
    theirs = transformers.TrainerState.load_from_json(str(hf_out / "checkpoint-4" / "trainer_state.json"))
    expected = [(h["step"], h["learning_rate"], h["loss"]) for h in theirs.log_history if "loss" in h]
    got = [(h["step"], h["learning_rate"], h["loss"]) for h in ours.state.log_history if "loss" in h]
    assert [g[0] for g in got] == [1, 2, 3, 4]
    for (step, lr, loss), (_, g_lr, g_loss) in zip(expected, got, strict=True):
        assert g_lr == pytest.approx(lr, rel=1e-12) and g_loss == pytest.approx(loss, rel=1e-5), step
    weights = "adapter_model.safetensors" if adapted else "model.safetensors"
    want = load_file(str(hf_out / "checkpoint-4" / weights))
    have = {n.replace(".default", ""): p.detach().numpy() for n, p in fresh.named_parameters()}
    assert want
    for name, value in want.items():
        np.testing.assert_allclose(have[name], value, rtol=1e-4, atol=2e-6, err_msg=name)
