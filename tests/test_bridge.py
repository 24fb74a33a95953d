"""The torch bridge's own promises: torchax set up without changing torch for code outside the step, the
fixes it needs (each test fails once torchax no longer needs its fix), dropout from JAX keys (same seed, same run;
resume exact), exports transformers loads, HF's evaluate/predict, torch-written compute_loss overrides, and one
error for what torchax cannot run."""

import copy
import importlib.util
import subprocess
import sys

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
if importlib.util.find_spec("torchax") is None:
    pytest.skip("torchax is not installed", allow_module_level=True)

from bridge_cases import _case  # noqa: E402
from conftest import scratch_dir, tiny_llama_config, token_rows, torch_rows  # noqa: E402
from conftest import side_by_side_args as _args  # noqa: E402

from jtrainer import Trainer, TrainingArguments  # noqa: E402
from jtrainer.bridge import torchax_compat  # noqa: E402


def test_torchax_still_names_overloads_torch_removed():
    """torchax 0.0.13's tables name named-tensor overloads torch 2.13 removed: without the placeholders it does not
    import. When this fails, torchax no longer needs `_removed_overloads_tolerated`: remove it."""
    torchax_compat.environment()
    names = {o.name for o in torchax_compat.REMOVED_OVERLOADS}
    assert "aten::prod.dim_Dimname" in names and len(names) >= 20
    assert not any(isinstance(op, torchax_compat.RemovedOverload) for op in torchax_compat.environment()._ops)


def test_fully_masked_queries_attend_to_nothing_as_in_torch():
    """torch's scaled_dot_product_attention gives 0 for a query whose keys are all masked; torchax's own gives NaN
    (when this fails, torchax computes it as torch does: remove `_sdpa`)."""
    import jax.numpy as jnp
    from torchax.ops import jtorch

    env = torchax_compat.environment()
    q, k, v = (torch.randn(1, 2, 4, 8, generator=torch.Generator().manual_seed(i)) for i in range(3))
    mask = torch.ones(4, 4, dtype=torch.bool)
    mask[2] = False
    expected = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    assert float(expected[0, 0, 2].abs().max()) == 0.0
    with env:
        tensors = env.j2t_iso(tuple(jnp.asarray(x.numpy()) for x in (q, k, v, mask)))
        ours = env.t2j_iso(torch.nn.functional.scaled_dot_product_attention(*tensors[:3], attn_mask=tensors[3]))
        theirs = env.t2j_iso(jtorch._sdpa_reference(*tensors[:3], attn_mask=tensors[3]))
    np.testing.assert_allclose(np.asarray(ours), expected.numpy(), atol=1e-6)
    assert np.isnan(np.asarray(theirs)[0, 0, 2]).all()


@pytest.mark.parametrize("shape,bias", [((5,), True), ((2, 3, 5), True), ((2, 3, 5), False)])
def test_linear_runs_the_dense_kernel_with_torchs_values_and_gradients(shape, bias):
    """On CPU a bridged F.linear runs the native models' dense kernel (bridge/linear.py: its explicit transpose
    behind an optimisation barrier); values and gradients are torch's (float64 reference)."""
    import jax
    import jax.numpy as jnp

    env = torchax_compat.environment()
    generator = torch.Generator().manual_seed(0)
    x, w, b = (torch.randn(*s, generator=generator, dtype=torch.float64) for s in (shape, (4, 5), (4,)))
    b = b if bias else None
    leaves = [t.requires_grad_() for t in (x, w, b) if t is not None]
    torch.sin(torch.nn.functional.linear(x, w, b)).sum().backward()

    def objective(*arrays):
        with env:
            tensors = env.j2t_iso(arrays) + (None,) * (3 - len(arrays))
            return env.t2j_iso(torch.sin(torch.nn.functional.linear(*tensors)).sum())

    arrays = tuple(jnp.asarray(t.detach().numpy(), jnp.float32) for t in leaves)
    grad = jax.jit(jax.grad(objective, argnums=tuple(range(len(arrays)))))
    for ours, theirs in zip(grad(*arrays), leaves):
        np.testing.assert_allclose(np.asarray(ours), theirs.grad.numpy(), rtol=1e-5, atol=1e-5)
    assert "optimization_barrier" in grad.lower(*arrays).as_text()


def test_torchax_still_copies_views_drops_running_statistics_and_ignores_no_grad():
    """What torchax_compat's points 5-8 fix, asked of torchax itself: when one of these fails, torchax has fixed it
    upstream and the fix can go (tests/test_bridge_semantics.py holds torch's answers)."""
    import jax
    import jax.numpy as jnp

    env = torchax_compat.environment()  # torchax imports only with its fixes
    import torchax.tensor
    from torchax.ops import jaten

    assert not env._get_op_or_decomp(torch.ops.aten.slice.Tensor).is_view_op  # a copy: writes through it are lost
    stats = jnp.zeros(3), jnp.ones(3)
    assert len(jaten._aten__native_batch_norm_legit(jnp.ones((4, 3)), None, None, *stats, True, 0.1, 1e-5)) == 3

    def gated(x):  # torchax's own dispatch under torch.no_grad(): JAX still differentiates through
        with env, torch.no_grad():
            tensor = env.j2t_iso(x)
            return torchax.tensor.Environment.dispatch(env, torch.ops.aten.mul.Tensor, (), (tensor, tensor), {})._elem

    assert float(jax.grad(lambda x: gated(x).sum())(jnp.ones(2))[0]) == 2.0
    with env:
        tensor = env.j2t_iso(jnp.ones(2, jnp.float32))
        torchax_compat.TORCHAX_OWN["type_as"](tensor, env.j2t_iso(jnp.ones(2, jnp.int32)))
        assert tensor.dtype == torch.int32  # torchax's type_as changed the tensor it was called on


def test_torch_outside_the_step_is_left_as_it_was(tmp_path):
    """After the bridge has run, torch has no new accelerator and transformers.Trainer in the same process trains on
    the CPU, as without jtrainer."""
    torchax_compat.environment()
    fast_path = torch.backends.mha.get_fastpath_enabled()
    Trainer(model=transformers.LlamaForCausalLM(tiny_llama_config()), args=_args(TrainingArguments, scratch_dir()))
    assert torch.accelerator.current_accelerator() is None
    assert torch._C._get_privateuse1_backend_name() == "privateuseone"
    assert torch.backends.mha.get_fastpath_enabled() == fast_path
    model = transformers.LlamaForCausalLM(tiny_llama_config())
    hf = transformers.Trainer(
        model=model,
        args=_args(transformers.TrainingArguments, tmp_path, max_steps=2),
        train_dataset=torch_rows(token_rows(8)),
    )
    hf.train()
    assert hf.args.device.type == "cpu" and next(model.parameters()).device.type == "cpu"


def test_import_jtrainer_does_not_import_torchax():
    code = "import sys, jtrainer; print('torchax' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip().splitlines()[-1] == "False"


def test_a_torch_model_without_torchax_names_the_extra(monkeypatch):
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "torchax" else find_spec(name))
    with pytest.raises(ImportError, match=r'pip install "jtrainer\[torch\]"'):
        Trainer(model=transformers.LlamaForCausalLM(tiny_llama_config()), args=_args(TrainingArguments, "unused"))


def test_an_op_torchax_cannot_lower_is_named():
    class Spherical(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.weight = torch.nn.Parameter(torch.ones(4))

        def forward(self, inputs, labels=None):
            out = torch.special.spherical_bessel_j0(inputs * self.weight)  # no torchax lowering
            return {"loss": out.sum(), "logits": out}

    rows = [{"inputs": np.ones(4, np.float32), "labels": np.int64(0)} for _ in range(4)]
    trainer = Trainer(model=Spherical(), args=_args(TrainingArguments, scratch_dir()), train_dataset=rows)
    with pytest.raises(
        NotImplementedError, match=r"Spherical's forward cannot run .*torch's aten::special_spherical_bessel"
    ):
        trainer.train()


def _dropout_run(model, out, **over):
    kw = dict(
        output_dir=str(out),
        per_device_train_batch_size=4,
        learning_rate=3e-3,
        lr_scheduler_type="constant",
        max_steps=8,
        logging_steps=1,
        save_steps=4,
        report_to="none",
        disable_tqdm=True,
        seed=3,
    )
    args = TrainingArguments(**{**kw, **over})
    trainer = Trainer(model=copy.deepcopy(model), args=args, train_dataset=token_rows(40, ragged_labels=True))
    return trainer


def test_dropout_is_a_function_of_the_seed_and_resume_is_exact(tmp_path):
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(tiny_llama_config(attention_dropout=0.3))
    first, second = _dropout_run(model, tmp_path / "a"), _dropout_run(model, tmp_path / "b")
    first.train()
    second.train()
    losses = [h["loss"] for h in first.state.log_history if "loss" in h]
    assert losses == [h["loss"] for h in second.state.log_history if "loss" in h]
    torch.manual_seed(0)  # the same weights, no dropout
    without = _dropout_run(transformers.LlamaForCausalLM(tiny_llama_config()), tmp_path / "c", max_steps=1)
    without.train()
    assert without.state.log_history[0]["loss"] != losses[0]  # dropout is on

    stopped = _dropout_run(model, tmp_path / "d", max_steps=4)
    stopped.train()
    resumed = _dropout_run(model, tmp_path / "d")
    resumed.train(resume_from_checkpoint=True)
    assert [h["loss"] for h in resumed.state.log_history if "loss" in h and h["step"] > 4] == losses[4:]
    for a, b in zip(first.model.parameters(), resumed.model.parameters()):
        assert torch.equal(a, b)
    exported = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "a" / "checkpoint-8")
    for a, b in zip(exported.parameters(), first.model.parameters()):
        assert torch.equal(a, b)


def test_evaluate_and_predict_as_transformers_trainer(tmp_path):
    torch.manual_seed(0)
    model, rows = _case("bert-sequence")
    hf = transformers.Trainer(model=model, args=_args(transformers.TrainingArguments, tmp_path / "hf"))
    ours = Trainer(model=copy.deepcopy(model), args=_args(TrainingArguments, tmp_path / "jt"))
    expected, got = hf.predict(torch_rows(rows[:10])), ours.predict(rows[:10])
    np.testing.assert_allclose(got.predictions, expected.predictions, rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(got.label_ids, expected.label_ids)
    np.testing.assert_allclose(got.metrics["test_loss"], expected.metrics["test_loss"], rtol=1e-5)
    np.testing.assert_allclose(
        ours.evaluate(rows[:10])["eval_loss"], hf.evaluate(torch_rows(rows[:10]))["eval_loss"], rtol=1e-5
    )


def _weighted_trainer(base):
    """HF's documented class-weighted compute_loss (transformers' trainer.md), verbatim."""
    from torch import nn

    class CustomTrainer(base):
        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            labels = inputs.pop("labels")
            # forward pass
            outputs = model(**inputs)
            logits = outputs.get("logits")
            # compute custom loss for 3 labels with different weights
            reduction = "sum" if num_items_in_batch is not None else "mean"
            loss_fct = nn.CrossEntropyLoss(
                weight=torch.tensor([1.0, 2.0, 3.0], device=model.device), reduction=reduction
            )
            loss = loss_fct(logits.view(-1, self.model.config.num_labels), labels.view(-1))
            if num_items_in_batch is not None:
                loss = loss / num_items_in_batch
            return (loss, outputs) if return_outputs else loss

    return CustomTrainer


@pytest.mark.parametrize("native", [False, True], ids=["bridge", "native"])
def test_a_torch_compute_loss_override_runs_in_the_step(tmp_path, native):
    torch.manual_seed(0)
    model, rows = _case("bert-sequence")
    model.save_pretrained(tmp_path / "init")
    hf = _weighted_trainer(transformers.Trainer)(
        model=model,
        args=_args(transformers.TrainingArguments, tmp_path / "hf"),
        train_dataset=torch_rows(rows),
        eval_dataset=torch_rows(rows[:8]),
    )
    hf.train()
    if native:
        from jtrainer.models.bert import BertForSequenceClassification

        ours_model = BertForSequenceClassification.from_pretrained(str(tmp_path / "init"))
    else:
        ours_model = transformers.BertForSequenceClassification.from_pretrained(tmp_path / "init")
    ours = _weighted_trainer(Trainer)(
        model=ours_model, args=_args(TrainingArguments, tmp_path / "jt"), train_dataset=rows, eval_dataset=rows[:8]
    )
    ours.train()
    hf_logs = [h for h in hf.state.log_history if "loss" in h]
    jt_logs = [h for h in ours.state.log_history if "loss" in h]
    np.testing.assert_allclose([h["loss"] for h in jt_logs], [h["loss"] for h in hf_logs], rtol=1e-5)
    np.testing.assert_allclose(ours.evaluate()["eval_loss"], hf.evaluate()["eval_loss"], rtol=1e-5)


def test_gradient_checkpointing_rematerialises_each_layer_with_the_same_numbers():
    torch.manual_seed(0)
    base = transformers.LlamaForCausalLM(tiny_llama_config(num_hidden_layers=4, hidden_size=64, intermediate_size=512))
    rows = token_rows(8, length=64, ragged_labels=True)
    example = {k: np.stack([r[k] for r in rows[:4]]) for k in rows[0]}  # one device's rows
    results = {}
    for on in (False, True):
        args = _args(TrainingArguments, scratch_dir(), gradient_checkpointing=on, max_steps=2, num_train_epochs=1)
        args.gradient_accumulation_steps = 1
        trainer = Trainer(model=copy.deepcopy(base), args=args, train_dataset=rows)
        trainer.train()
        temp = trainer.compile_train_step(example, 2).memory_analysis().temp_size_in_bytes
        logs = [h for h in trainer.state.log_history if "loss" in h]
        results[on] = ([h["loss"] for h in logs], [h["grad_norm"] for h in logs], temp)
        assert trainer.nnx_model.gradient_checkpointing is on
    assert results[True][:2] == results[False][:2]
    assert results[True][2] < results[False][2]


@pytest.mark.parametrize("name", ["t5", "whisper"])
def test_seq2seq_predict_with_generate_gives_transformers_ids(tmp_path, name, caplog):
    """Seq2SeqTrainer.predict with predict_with_generate, greedy and with beams, after training: the generated
    ids (and the loss) of transformers' Seq2SeqTrainer on the same model and rows; one line says where the
    decoding runs (torch, on the host)."""
    from jtrainer import Seq2SeqTrainer, Seq2SeqTrainingArguments

    torch.manual_seed(0)
    model, rows = _case(name)
    ours_model = copy.deepcopy(model)
    over = dict(predict_with_generate=True, generation_max_length=8, max_steps=3, per_device_eval_batch_size=4)
    hf = transformers.Seq2SeqTrainer(
        model=model,
        args=_args(transformers.Seq2SeqTrainingArguments, tmp_path / "hf", **over),
        train_dataset=torch_rows(rows),
    )
    ours = Seq2SeqTrainer(
        model=ours_model, args=_args(Seq2SeqTrainingArguments, tmp_path / "jt", **over), train_dataset=rows
    )
    hf.train()
    ours.train()
    for beams in (1, 2):
        expected = hf.predict(torch_rows(rows[:6]), num_beams=beams)
        with caplog.at_level("WARNING", logger="jtrainer.bridge.trained"):
            got = ours.predict(rows[:6], num_beams=beams)
        np.testing.assert_array_equal(got.predictions, expected.predictions)
        np.testing.assert_allclose(got.metrics["test_loss"], expected.metrics["test_loss"], rtol=1e-5)
    told = [r.getMessage() for r in caplog.records if "decodes it in torch on this host" in r.getMessage()]
    assert len(told) == 1 and type(ours_model).__name__ in told[0]  # once a model


def test_neftune_adds_transformers_noise_in_training_steps_only():
    torch.manual_seed(0)
    base = transformers.LlamaForCausalLM(tiny_llama_config())
    rows = token_rows(16, ragged_labels=True)

    def run(alpha):
        args = _args(TrainingArguments, scratch_dir(), max_steps=2, neftune_noise_alpha=alpha)
        trainer = Trainer(model=copy.deepcopy(base), args=args, train_dataset=rows, eval_dataset=rows[:4])
        trainer.train()
        embeddings = trainer.model.get_input_embeddings()
        assert not hasattr(embeddings, "neftune_noise_alpha") and not embeddings._forward_hooks  # removed after
        return [h["loss"] for h in trainer.state.log_history if "loss" in h]

    quiet, noisy, again = run(None), run(5.0), run(5.0)
    assert noisy == again and noisy[0] != quiet[0]


def test_torch_without_torchax_keeps_a_jax_compute_loss_override_working(monkeypatch):
    """A script with torch installed but not torchax: a native model's jax.numpy compute_loss override runs as
    before (the torch path is not tried), instead of failing for want of the bridge."""
    import jax.numpy as jnp

    from jtrainer.models.llama import LlamaForCausalLM

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "torchax" else find_spec(name))

    class MeanLogitTrainer(Trainer):
        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            outputs = model(input_ids=inputs["input_ids"])
            loss = jnp.mean(outputs.logits**2)
            return (loss, outputs) if return_outputs else loss

    args = _args(TrainingArguments, scratch_dir(), max_steps=1)
    trainer = MeanLogitTrainer(
        model=LlamaForCausalLM.from_config(tiny_llama_config()), args=args, train_dataset=token_rows(8)
    )
    trainer.train()
    assert [h for h in trainer.state.log_history if "loss" in h]
