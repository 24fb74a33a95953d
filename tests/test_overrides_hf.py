"""HF's override points: a subclass's compute_loss runs inside the compiled step and gives transformers.Trainer's
numbers for the same override; hooks jtrainer never calls are refused at construction, untraceable overrides
before compiling."""

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("accelerate")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from conftest import tiny_llama_config, token_rows, torch_rows  # noqa: E402

VOCAB = 64
TOKEN_WEIGHTS = np.linspace(0.5, 2.0, VOCAB).astype(np.float32)  # a class-weighted loss over the vocabulary


def _args(cls, out, **over):
    kw = dict(
        output_dir=str(out),
        per_device_train_batch_size=4,
        gradient_accumulation_steps=2,
        learning_rate=3e-3,
        weight_decay=0.1,
        lr_scheduler_type="linear",
        warmup_steps=1,
        max_grad_norm=1.0,
        num_train_epochs=1,
        logging_steps=1,
        train_sampling_strategy="sequential",
        save_strategy="no",
        report_to="none",
        disable_tqdm=True,
        seed=0,
        use_cpu=True,
        optim="adamw_torch",
        per_device_eval_batch_size=4,
        eval_strategy="steps",
        eval_steps=2,
    )
    kw.update(over)
    return cls(**kw)


def _hf_trainers():
    import transformers

    class WeightedHF(transformers.Trainer):
        """Class-weighted token cross-entropy, the most common compute_loss override."""

        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            labels = inputs.pop("labels")
            outputs = model(**inputs)
            logits = outputs.logits[:, :-1].reshape(-1, VOCAB)
            targets = labels[:, 1:].reshape(-1)
            loss = torch.nn.functional.cross_entropy(logits, targets, weight=torch.tensor(TOKEN_WEIGHTS))
            return (loss, outputs) if return_outputs else loss

    class AuxHF(transformers.Trainer):
        """super().compute_loss plus an auxiliary term on the logits."""

        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            loss, outputs = super().compute_loss(model, inputs, True, num_items_in_batch)
            loss = loss + 1e-2 * (outputs.logits**2).mean()
            return (loss, outputs) if return_outputs else loss

    return {"weighted": WeightedHF, "super-aux": AuxHF}


def _jt_trainers():
    from jtrainer import Trainer

    class WeightedJT(Trainer):
        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            labels = inputs.pop("labels")
            outputs = model(**inputs)
            logp = jax.nn.log_softmax(outputs.logits[:, :-1].astype(jnp.float32), axis=-1)
            targets = labels[:, 1:]
            valid = targets != -100
            safe = jnp.where(valid, targets, 0)
            weight = jnp.where(valid, jnp.asarray(TOKEN_WEIGHTS)[safe], 0.0)
            nll = -jnp.take_along_axis(logp, safe[..., None], axis=-1)[..., 0]
            loss = jnp.sum(weight * nll) / jnp.sum(weight)  # torch's weighted mean
            return (loss, outputs) if return_outputs else loss

    class AuxJT(Trainer):
        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            loss, outputs = super().compute_loss(model, inputs, True, num_items_in_batch)
            loss = loss + 1e-2 * jnp.mean(outputs.logits.astype(jnp.float32) ** 2)
            return (loss, outputs) if return_outputs else loss

    return {"weighted": WeightedJT, "super-aux": AuxJT}


@pytest.mark.parametrize("kind", ["weighted", "super-aux"])
def test_compute_loss_override_as_transformers(tmp_path, kind):
    import transformers

    from jtrainer.models.hf_io import to_hf_state_dict
    from jtrainer.models.llama import LlamaForCausalLM

    torch.manual_seed(0)
    transformers.LlamaForCausalLM(tiny_llama_config()).save_pretrained(tmp_path / "init")
    rows, eval_rows = token_rows(20, ragged_labels=True), token_rows(8, seed=1, ragged_labels=True)
    hf = _hf_trainers()[kind](
        model=transformers.LlamaForCausalLM.from_pretrained(tmp_path / "init"),
        args=_args(transformers.TrainingArguments, tmp_path / "hf"),
        train_dataset=torch_rows(rows),
        eval_dataset=torch_rows(eval_rows),
    )
    hf.train()
    ours = _jt_trainers()[kind](
        model=LlamaForCausalLM.from_pretrained(str(tmp_path / "init")),
        args=_args(__import__("jtrainer").TrainingArguments, tmp_path / "jt"),
        train_dataset=rows,
        eval_dataset=eval_rows,
    )
    ours.train()

    for key in ("loss", "eval_loss"):
        ref = [h for h in hf.state.log_history if key in h]
        got = [h for h in ours.state.log_history if key in h]
        assert [h["step"] for h in got] == [h["step"] for h in ref] and ref
        for r, g in zip(ref, got):
            np.testing.assert_allclose(g[key], r[key], rtol=2e-5, err_msg=f"{key} at step {r['step']}")
    ref_params = {k: v.detach().numpy() for k, v in hf.model.state_dict().items()}
    for name, value in to_hf_state_dict(ours.model).items():
        np.testing.assert_allclose(value, ref_params[name], rtol=1e-4, atol=1e-5, err_msg=name)


def test_unsupported_hook_override_is_refused(tmp_path):
    from jtrainer import Trainer, TrainingArguments
    from jtrainer.models.llama import LlamaForCausalLM

    class StepOverride(Trainer):
        def training_step(self, model, inputs, num_items_in_batch=None):
            raise AssertionError("never called")

    model = LlamaForCausalLM.from_config(tiny_llama_config())
    with pytest.raises(TypeError, match=r"StepOverride\.training_step .*Override compute_loss"):
        StepOverride(model=model, args=TrainingArguments(output_dir=str(tmp_path), report_to="none"))


def test_untraceable_compute_loss_fails_before_compiling(tmp_path):
    from conftest import count_compiles

    from jtrainer import Trainer, TrainingArguments
    from jtrainer.models.llama import LlamaForCausalLM

    class TorchStyle(Trainer):
        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            outputs = model(**inputs)
            return float(outputs.loss)  # a host conversion: not traceable

    trainer = TorchStyle(
        model=LlamaForCausalLM.from_config(tiny_llama_config()),
        args=TrainingArguments(
            output_dir=str(tmp_path), report_to="none", max_steps=2, save_strategy="no", per_device_train_batch_size=4
        ),
        train_dataset=token_rows(8),
    )
    with count_compiles() as compiles, pytest.raises(TypeError, match=r"TorchStyle\.compute_loss cannot run inside"):
        trainer.train()
    assert compiles == []


def test_create_optimizer_and_dataloader_overrides(tmp_path):
    """Overrides jtrainer calls by name are honoured (an optax optimizer of one's own, a torch DataLoader as HF
    takes it); a torch optimizer set by an overridden create_optimizer is refused, naming the method."""
    import optax

    from jtrainer import Trainer, TrainingArguments
    from jtrainer.models.hf_io import to_hf_state_dict
    from jtrainer.models.llama import LlamaForCausalLM

    def build(cls):
        return cls(
            model=LlamaForCausalLM.from_config(tiny_llama_config()),
            args=TrainingArguments(
                output_dir=str(tmp_path),
                report_to="none",
                max_steps=2,
                save_strategy="no",
                per_device_train_batch_size=4,
            ),
            train_dataset=token_rows(8),
        )

    class FrozenOptimizer(Trainer):
        def create_optimizer(self):
            self.optimizer = optax.sgd(0.0)
            return self.optimizer

    trainer = build(FrozenOptimizer)
    before = to_hf_state_dict(trainer.model)
    trainer.train()
    after = to_hf_state_dict(trainer.model)
    assert all(np.array_equal(before[k], after[k]) for k in before)

    class TranslatedOptimizer(Trainer):
        def create_optimizer(self):
            self.optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
            return self.optimizer

    with pytest.raises(TypeError, match=r"TranslatedOptimizer\.create_optimizer set self\.optimizer to a SGD"):
        build(TranslatedOptimizer).train()

    class TorchLoader(Trainer):
        def get_train_dataloader(self):
            return torch.utils.data.DataLoader(torch_rows(token_rows(8)), batch_size=4)

    loaded = build(TorchLoader)
    loaded.train()
    assert loaded.state.global_step == 2

    class NotBatches(Trainer):
        def get_train_dataloader(self):
            return 42

    with pytest.raises(TypeError, match=r"NotBatches\.get_train_dataloader returned a int, which is not an"):
        build(NotBatches).train()
