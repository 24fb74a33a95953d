"""The torch semantics zoo beside torch eager: each module of tests/bridge_zoo.py trained 3 steps by
transformers.Trainer (torch) and by jtrainer (the bridge), then evaluated and predicted: losses, every parameter
and buffer, the evaluation loss and predictions agree. Then each refusal, by its message, and the same zoo on 8
devices (a subprocess: the device count is fixed when jax starts)."""

import copy
import importlib.util
import json
import os
import subprocess
import sys
import tempfile

import numpy as np
import pytest

torch = pytest.importorskip("torch")
if importlib.util.find_spec("torchax") is None:
    pytest.skip("torchax is not installed", allow_module_level=True)
transformers = pytest.importorskip("transformers")

import bridge_zoo  # noqa: E402
from bridge_zoo import Regression, arguments, rows  # noqa: E402
from conftest import torch_rows  # noqa: E402

from jtrainer import Trainer, TrainingArguments  # noqa: E402

JOB = os.path.join(os.path.dirname(os.path.abspath(__file__)), "jobs", "bridge_zoo_job.py")


@pytest.mark.parametrize("model_class", bridge_zoo.ZOO, ids=lambda c: c.__name__)
def test_the_bridge_gives_torchs_answer(model_class):
    differences = bridge_zoo.differences(bridge_zoo.side_by_side(model_class))
    assert differences.pop("losses") < 1e-5
    assert max(differences.values()) < 1e-5, {k: v for k, v in differences.items() if v >= 1e-5}


def test_batch_norm_statistics_move_checkpoint_and_resume(tmp_path):
    """The running statistics are state of the step: saved in checkpoints and resumed, as torch's module."""
    torch.manual_seed(0)
    model = bridge_zoo.BatchNorm()
    over = dict(max_steps=4, save_strategy="steps", save_steps=2)
    whole = Trainer(copy.deepcopy(model), arguments(TrainingArguments, tmp_path / "a", **over), train_dataset=rows())
    whole.train()
    assert not torch.equal(whole.model.norm.running_var, torch.ones(bridge_zoo.WIDTH))
    stopped = Trainer(
        copy.deepcopy(model),
        arguments(TrainingArguments, tmp_path / "b", **over | {"max_steps": 2}),
        train_dataset=rows(),
    )
    stopped.train()
    resumed = Trainer(copy.deepcopy(model), arguments(TrainingArguments, tmp_path / "b", **over), train_dataset=rows())
    resumed.train(resume_from_checkpoint=str(tmp_path / "b" / "checkpoint-2"))
    for name, value in whole.model.state_dict().items():
        torch.testing.assert_close(resumed.model.state_dict()[name], value, rtol=0, atol=1e-6, msg=name)


def test_a_plain_module_saves_its_state_dict_as_transformers_trainer(tmp_path):
    torch.manual_seed(0)
    ours = Trainer(Regression(), arguments(TrainingArguments, tmp_path), train_dataset=rows())
    ours.train()
    ours.save_model(str(tmp_path / "final"))
    assert sorted(os.listdir(tmp_path / "final")) == ["model.safetensors", "training_args.json"]
    import safetensors.torch

    saved = safetensors.torch.load_file(str(tmp_path / "final" / "model.safetensors"))
    for name, value in ours.model.state_dict().items():
        assert torch.equal(saved[name], value)
    assert ours.state.total_flos == 0  # HF: no num_parameters, no estimate


class _RegressionConfig(transformers.PretrainedConfig):
    model_type = "zoo-regression"


class _PreTrainedRegression(transformers.PreTrainedModel):
    """A PreTrainedModel without embeddings (HF's own tests' regression model): get_input_embeddings raises."""

    config_class = _RegressionConfig

    def __init__(self, config):
        super().__init__(config)
        self.a = torch.nn.Parameter(torch.tensor(0.5))
        self.b = torch.nn.Parameter(torch.tensor(-0.5))
        self.post_init()

    def forward(self, x, labels=None):
        y = x.sum(-1) * self.a + self.b
        return (y,) if labels is None else (torch.nn.functional.mse_loss(y, labels), y)


def test_a_pretrained_model_without_embeddings_trains_checkpoints_and_resumes(tmp_path):
    over = dict(max_steps=4, save_strategy="steps", save_steps=2)
    hf = transformers.Trainer(
        _PreTrainedRegression(_RegressionConfig()),
        arguments(transformers.TrainingArguments, tmp_path / "hf", **over),
        train_dataset=torch_rows(rows()),
    )
    hf.train()
    ours = Trainer(
        _PreTrainedRegression(_RegressionConfig()),
        arguments(TrainingArguments, tmp_path / "jt", **over),
        train_dataset=rows(),
    )
    ours.train()
    for name, value in hf.model.state_dict().items():
        torch.testing.assert_close(ours.model.state_dict()[name], value, rtol=1e-5, atol=1e-6)
    assert "model.safetensors" in os.listdir(tmp_path / "jt" / "checkpoint-2")
    resumed = Trainer(
        _PreTrainedRegression(_RegressionConfig()),
        arguments(TrainingArguments, tmp_path / "jt", **over),
        train_dataset=rows(),
    )
    resumed.train(resume_from_checkpoint=str(tmp_path / "jt" / "checkpoint-2"))
    assert torch.equal(resumed.model.a, ours.model.a) and torch.equal(resumed.model.b, ours.model.b)


class _Detached(Trainer):
    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        return model(**inputs)["loss"].detach()


class _LogitsOnly(Regression):
    def forward(self, x, labels=None):
        return (self.predict(x),)


class _DictWithoutLoss(Regression):
    def forward(self, x, labels=None):
        return {"logits": self.predict(x)}


def _frozen():
    model = Regression()
    for parameter in model.parameters():
        parameter.requires_grad_(False)
    return model


class _HostRead(Regression):
    def body(self, h):
        if h.sum() > 0:  # a value read on the host
            return h
        return -h


class _DataDependentShape(Regression):
    def body(self, h):
        return h * (h[h > 0].sum())  # boolean-mask indexing: a shape from values


class _WriteIntoExpanded(Regression):
    def body(self, h):
        wide = h[:, :1].expand(-1, bridge_zoo.WIDTH)
        wide.add_(1.0)
        return h


class _SplitThenWrite(Regression):
    def body(self, h):
        h = h * 1.0
        _, second = h.split(4, dim=1)
        second.mul_(2.0)
        return h


REFUSALS = [
    (_frozen, Trainer, RuntimeError, r"^element 0 of tensors does not require grad .*Regression has no trainable"),
    (Regression, _Detached, RuntimeError, r"^element 0 of tensors does not require grad .*_Detached.compute_loss"),
    (_LogitsOnly, Trainer, RuntimeError, r"^grad can be implicitly created only for scalar outputs"),
    (_DictWithoutLoss, Trainer, ValueError, r"^The model did not return a loss from the inputs, only .*: logits\."),
    (_HostRead, Trainer, NotImplementedError, r"^_HostRead's forward cannot run .* \(`if h.sum\(\) > 0:.*host"),
    (_DataDependentShape, Trainer, NotImplementedError, r"^_DataDependentShape's forward .*depends on tensor values"),
    (_WriteIntoExpanded, Trainer, RuntimeError, r"^unsupported operation: more than one element"),
    (_SplitThenWrite, Trainer, RuntimeError, r"^Output 1 of Split is a view and is being modified inplace"),
]


@pytest.mark.parametrize("make, trainer_class, error, message", REFUSALS, ids=lambda v: getattr(v, "__name__", ""))
def test_what_torch_refuses_or_cannot_compile_is_one_line(make, trainer_class, error, message):
    torch.manual_seed(0)
    trainer = trainer_class(make(), arguments(TrainingArguments, tempfile.mkdtemp()), train_dataset=rows())
    with pytest.raises(error, match=message) as raised:
        trainer.train()
    assert "\n" not in str(raised.value)


def test_transformers_trainer_refuses_the_same_torch_code():
    """The refusals above that torch itself makes: transformers.Trainer fails on them too."""
    for make, trainer_class, error, message in REFUSALS:
        if trainer_class is not Trainer or error is NotImplementedError:
            continue
        hf = transformers.Trainer(
            make(), arguments(transformers.TrainingArguments, tempfile.mkdtemp()), train_dataset=torch_rows(rows())
        )
        with pytest.raises(error, match=message.split(" .*")[0].removeprefix("^")):
            hf.train()


def test_a_meta_device_model_is_refused_in_one_line():
    with torch.device("meta"):
        model = Regression()
    with pytest.raises(ValueError, match=r"^Regression's inner.weight \(and 3 more\) is on torch's meta device"):
        Trainer(model, arguments(TrainingArguments, tempfile.mkdtemp()), train_dataset=rows())


def test_seq2seq_generation_runs_in_eval_mode_as_transformers():
    """predict_with_generate right after construction (the torch model in train mode, dropout on): transformers'
    evaluation loop calls model.eval(), so the ids are greedy decoding's without dropout."""
    from jtrainer import Seq2SeqTrainer, Seq2SeqTrainingArguments

    torch.manual_seed(0)
    config = transformers.T5Config(
        vocab_size=64,
        d_model=16,
        d_ff=32,
        num_layers=1,
        num_heads=2,
        d_kv=8,
        dropout_rate=0.5,
        decoder_start_token_id=0,
    )
    model = transformers.T5ForConditionalGeneration(config).train()
    rng = np.random.RandomState(0)
    data = [{"input_ids": rng.randint(1, 64, 6), "labels": rng.randint(1, 64, 4)} for _ in range(4)]
    over = dict(predict_with_generate=True, generation_max_length=6, per_device_eval_batch_size=4)
    hf = transformers.Seq2SeqTrainer(
        copy.deepcopy(model), arguments(transformers.Seq2SeqTrainingArguments, tempfile.mkdtemp(), **over)
    )
    ours = Seq2SeqTrainer(copy.deepcopy(model), arguments(Seq2SeqTrainingArguments, tempfile.mkdtemp(), **over))
    expected = hf.predict(torch_rows(data)).predictions
    np.testing.assert_array_equal(ours.predict(data).predictions, expected)


def test_the_zoo_on_eight_devices_gives_torchs_answer():
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8", JAX_PLATFORMS="cpu")
    out = subprocess.run([sys.executable, JOB], env=env, capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    differences = json.loads(out.stdout.strip().splitlines()[-1])
    assert set(differences) == {"Narrow", "SelectTranspose", "BatchNorm", "CustomAutograd", "TiedAndReused"}
    for name, by_quantity in differences.items():
        assert by_quantity.pop("losses") < 1e-5, name
        assert max(by_quantity.values()) < 1e-5, (name, by_quantity)


class _HostRandom(Regression):
    def body(self, h):
        return h + float(np.random.rand())  # drawn on the host: once, when the step compiles


class _CpuRandom(Regression):
    def body(self, h):
        return h + torch.randn(bridge_zoo.WIDTH)  # torch's CPU generator: no device=


@pytest.mark.parametrize("model_class, generator", [(_HostRandom, "numpy's"), (_CpuRandom, "torch's CPU generator")])
def test_host_randomness_in_forward_is_refused_in_one_line(model_class, generator):
    trainer = Trainer(model_class(), arguments(TrainingArguments, tempfile.mkdtemp()), train_dataset=rows())
    with pytest.raises(NotImplementedError, match=rf"^{model_class.__name__}'s forward draws from {generator}"):
        trainer.train()
