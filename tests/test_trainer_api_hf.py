"""Trainer methods HF documents, beside transformers.Trainer on the same torch module: optimizer introspection
(`get_optimizer_group`, `get_learning_rates`) at the points HF allows, and the names of the public API."""

import copy
import importlib.util

import numpy as np
import pytest

torch = pytest.importorskip("torch")
if importlib.util.find_spec("torchax") is None:
    pytest.skip("torchax is not installed", allow_module_level=True)
transformers = pytest.importorskip("transformers")

from bridge_zoo import Regression, arguments, rows  # noqa: E402
from conftest import short_run_args, tiny_llama_config, token_rows, torch_rows  # noqa: E402

from jtrainer import Trainer, TrainingArguments  # noqa: E402
from jtrainer.models import LlamaForCausalLM  # noqa: E402

torch.manual_seed(0)
MODEL = Regression()


def _pair(tmp_path, **over):
    over = {"lr_scheduler_type": "linear", "warmup_steps": 2, "max_steps": 4, "weight_decay": 0.1, **over}
    hf = transformers.Trainer(
        copy.deepcopy(MODEL),
        arguments(transformers.TrainingArguments, tmp_path / "hf", **over),
        train_dataset=torch_rows(rows()),
    )
    ours = Trainer(copy.deepcopy(MODEL), arguments(TrainingArguments, tmp_path / "ours", **over), train_dataset=rows())
    return hf, ours


def _names(trainer, groups):
    by_id = {id(p): n for n, p in trainer.model.named_parameters()}
    return [[by_id[id(p)] for p in group] for group in groups]


def test_optimizer_groups_and_rates_as_hf(tmp_path):
    hf, ours = _pair(tmp_path)
    for method in ("get_optimizer_group", "get_learning_rates"):
        messages = []
        for trainer in (hf, ours):
            with pytest.raises(ValueError) as error:
                getattr(trainer, method)()
            messages.append(str(error.value))
        assert messages[0] == messages[1]
    for trainer in (hf, ours):
        trainer.create_optimizer()
    assert ours.get_learning_rates() == hf.get_learning_rates() == [0.05, 0.05]  # no scheduler yet: the base rate
    assert _names(ours, ours.get_optimizer_group()) == _names(hf, hf.get_optimizer_group())
    param = ours.model.inner.weight
    group = ours.get_optimizer_group(param)
    assert any(p is param for p in group["params"]) and group["weight_decay"] == 0.1
    assert ours.get_optimizer_group(ours.model.inner.bias)["weight_decay"] == 0.0

    hf, ours = _pair(tmp_path)
    for trainer in (hf, ours):
        trainer.create_optimizer_and_scheduler(num_training_steps=4)
    assert ours.get_learning_rates() == hf.get_learning_rates() == [0.0, 0.0]  # the first update's (warmup)
    hf.train()
    ours.train()
    np.testing.assert_allclose(ours.get_learning_rates(), hf.get_learning_rates(), rtol=1e-12)  # the next one's


def test_native_models_groups_hold_their_variables():
    trainer = Trainer(LlamaForCausalLM.from_config(tiny_llama_config()), short_run_args(), train_dataset=token_rows(8))
    trainer.create_optimizer()
    decayed, plain = trainer.get_optimizer_group()
    assert decayed and plain
    variable = decayed[0]
    assert trainer.get_optimizer_group(variable)["weight_decay"] == trainer.args.weight_decay
    assert trainer.can_return_loss is False and trainer.model_wrapped is trainer.model
    total = sum(int(np.size(v[...])) for v in decayed + plain)
    assert total == trainer.get_num_trainable_parameters()


def _documented_names():
    import os
    import re

    text = open(os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "docs", "training.md")).read()
    section = text.split("## Every public Trainer method and attribute, beside HF's")[1].split("\n## ")[0]
    return set(re.findall(r"`([a-z0-9_]+)`", section))


def test_every_public_method_and_attribute_of_hfs_trainer_is_in_the_table(tmp_path):
    hf, _ = _pair(tmp_path)
    public = {n for n in dir(transformers.Trainer) if not n.startswith("_")} | {
        n for n in vars(hf) if not n.startswith("_")
    }
    assert public - _documented_names() == set()


def test_refused_methods_say_why_in_one_line(tmp_path):
    _, ours = _pair(tmp_path)
    for name in ("training_step", "prediction_step", "get_optimizer_cls_and_kwargs", "get_resumed_dataloader"):
        with pytest.raises(NotImplementedError, match=f"Trainer.{name} is part of transformers.Trainer's torch") as e:
            getattr(ours, name)()
        assert "\n" not in str(e.value)
    assert ours.model_wrapped is ours.model and ours.is_fsdp_enabled is False
    assert ours.can_return_loss == transformers.Trainer(ours.model, transformers.TrainingArguments("o")).can_return_loss
    assert (ours.get_tp_size(), ours.get_cp_size(), ours.get_sp_size()) == (1, 1, 1)


def test_can_return_loss_reads_the_forward_as_hf(tmp_path):
    class ReturnsLoss(Regression):
        def forward(self, x, labels=None, return_loss=True):
            return super().forward(x, labels)

    model = ReturnsLoss()
    hf = transformers.Trainer(model, arguments(transformers.TrainingArguments, tmp_path / "hf"))
    ours = Trainer(copy.deepcopy(model), arguments(TrainingArguments, tmp_path / "ours"))
    assert ours.can_return_loss is hf.can_return_loss is True
