"""No silent fallback in the bridge: where it runs something other than what was asked or expected, it says so
once (or refuses, where the user asked explicitly)."""

import importlib.util
import logging
import tempfile

import numpy as np
import pytest

torch = pytest.importorskip("torch")
if importlib.util.find_spec("torchax") is None:
    pytest.skip("torchax is not installed", allow_module_level=True)
transformers = pytest.importorskip("transformers")

from bridge_zoo import Regression, arguments, rows  # noqa: E402
from conftest import tiny_llama_config  # noqa: E402

from jtrainer import Trainer, TrainingArguments  # noqa: E402
from jtrainer.bridge.module import TorchModel  # noqa: E402
from jtrainer.core.errors import BadInput  # noqa: E402


def _llama_call(model):
    import jax.numpy as jnp

    bridged = TorchModel(model)
    bridged.deterministic = False  # a training call: attention dropout is on
    ids = jnp.asarray(np.arange(16).reshape(2, 8) % 64)
    return bridged(input_ids=ids, labels=ids)


def test_forced_splash_that_a_layer_cannot_take_is_an_error_naming_it(monkeypatch):
    monkeypatch.setenv("JTRAINER_ATTENTION", "splash")
    model = transformers.LlamaForCausalLM(tiny_llama_config(attention_dropout=0.1))
    with pytest.raises(ValueError, match=r"=splash: LlamaAttention \(layer 0\) cannot run .*attention dropout \(0.1\)"):
        _llama_call(model)


def test_the_default_fallback_to_sdpa_warns_once_with_the_reason(monkeypatch, caplog):
    from jtrainer.bridge import attention
    from jtrainer.models.kernels import attention as native_attention

    monkeypatch.setattr(native_attention, "on_tpu", lambda: True)  # where the default routes attention
    monkeypatch.setattr(attention, "_TOLD", set())
    model = transformers.LlamaForCausalLM(tiny_llama_config(attention_dropout=0.1))
    with caplog.at_level(logging.WARNING):
        _llama_call(model)
        _llama_call(model)
    told = [r.message for r in caplog.records if "SDPA attention" in r.message]
    assert told == [
        "LlamaAttention layers run transformers' SDPA attention with a dense [length, length] mask, not the splash "
        "kernel: attention dropout (0.1) in training."
    ]


def test_a_tp_plan_style_the_bridge_does_not_lay_out_is_named(caplog):
    model = Regression()
    model.tp_plan = {"inner": "packed_colwise"}
    with caplog.at_level(logging.WARNING):
        TorchModel(model)
    assert any("inner.weight (packed_colwise), inner.bias (packed_colwise)" in r.message for r in caplog.records)


def test_loading_checkpoint_weights_reports_missing_and_unexpected_keys_as_transformers(tmp_path, caplog):
    import safetensors.torch

    from jtrainer.bridge.resume import TorchModelLayout

    weights = {k: v for k, v in Regression().state_dict().items() if k != "head.bias"} | {"stale": torch.ones(1)}
    safetensors.torch.save_file(weights, str(tmp_path / "model.safetensors"))
    with caplog.at_level(logging.WARNING, logger="transformers.trainer"):
        TorchModelLayout(TorchModel(Regression())).load_weights(str(tmp_path), None, None)
    messages = [r.message for r in caplog.records]
    assert "There were missing keys in the checkpoint model loaded: ['head.bias']." in messages
    assert "There were unexpected keys in the checkpoint model loaded: ['stale']." in messages


def test_scan_layers_with_the_bridge_is_refused_in_one_line():
    from jtrainer.cli.tasks import ModelArguments, _check_model

    with pytest.raises(BadInput, match=r"^scan_layers: transformers' own models \(bridge: true\) run their layers"):
        _check_model(ModelArguments(model_type="llama", bridge=True, scan_layers=True))


def test_a_preprocess_logits_function_on_the_host_warns_once_with_its_cost(caplog):
    def rounded(logits, labels):
        return torch.from_numpy(np.round(logits.numpy(), 1))  # numpy: neither JAX nor torchax can trace it

    trainer = Trainer(
        Regression(),
        arguments(TrainingArguments, tempfile.mkdtemp(), per_device_eval_batch_size=4),
        preprocess_logits_for_metrics=rounded,
    )
    with caplog.at_level(logging.WARNING):
        predictions = trainer.predict(rows(12)).predictions
    told = [r.message for r in caplog.records if "preprocess_logits_for_metrics cannot run" in r.message]
    assert len(told) == 1 and "MiB a batch here" in told[0]
    assert predictions.shape == (12,)


def test_a_fresh_bridged_model_gets_its_widths_or_names_the_defaults(caplog):
    from jtrainer.cli.tasks import ModelArguments, fresh_config

    sizes = dict(model_type="qwen3_moe", bridge=True, hidden_size=32, intermediate_size=64, num_hidden_layers=2)
    with caplog.at_level(logging.WARNING):
        config = fresh_config(ModelArguments(**sizes), 128)
    assert config.moe_intermediate_size == 64
    assert any("num_experts_per_tok=8, num_experts=128 are transformers' defaults" in r.message for r in caplog.records)
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        config = fresh_config(ModelArguments(**sizes, config_overrides="num_experts=4,num_experts_per_tok=2"), 128)
    assert (config.num_experts, config.num_experts_per_tok) == (4, 2)
    assert not [r for r in caplog.records if "transformers' defaults" in r.message]
    with pytest.raises(BadInput, match=r"^config_overrides='bogus_field=1': "):
        fresh_config(ModelArguments(**sizes, config_overrides="bogus_field=1"), 128)
