"""TrainingArguments: HF's field set, defaults, derived values and validation errors."""

import dataclasses
import json

import pytest
import transformers

from jtrainer import TrainingArguments
from jtrainer.trainer.args import IGNORED_FIELDS, warn_ignored_fields

# jtrainer's own fields, and HF defaults that legitimately differ here (with the reason).
JAX_ONLY_FIELDS = {
    "jax_compilation_cache_dir",
    "default_bf16",
    "log_throughput",
    "prefetch_batches",
    "mesh_shape",
    "logical_axis_rules",
    "nan_inf_policy",
    "async_checkpointing",
    "loss_chunk_size",
}
DEFAULT_EXCEPTIONS = {
    # HF picks adamw_torch_fused when torch >= 2.8 is importable; both names mean AdamW here.
    "optim": {"adamw_torch", "adamw_torch_fused"},
}


def _default(f):
    return f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default


def test_every_hf_field_with_hf_default():
    ours = {f.name: f for f in dataclasses.fields(TrainingArguments)}
    theirs = {f.name: f for f in dataclasses.fields(transformers.TrainingArguments)}
    assert set(ours) - set(theirs) == JAX_ONLY_FIELDS
    assert set(theirs) <= set(ours)
    for name, f in theirs.items():
        if name in DEFAULT_EXCEPTIONS:
            assert _default(ours[name]) in DEFAULT_EXCEPTIONS[name]
        else:
            assert _default(ours[name]) == _default(f), name
    assert isinstance(TrainingArguments("o"), transformers.TrainingArguments)


def test_derived_values_match_hf():
    a = TrainingArguments(
        "o",
        eval_strategy="steps",
        logging_steps=7,
        load_best_model_at_end=True,
        save_steps=14,
        report_to="none",
        lr_scheduler_kwargs='{"num_cycles": "2"}',
    )
    assert a.do_eval and a.eval_steps == 7
    assert a.metric_for_best_model == "loss" and a.greater_is_better is False
    assert a.report_to == []
    assert a.lr_scheduler_kwargs == {"num_cycles": 2}
    assert TrainingArguments("o", report_to="tensorboard").report_to == ["tensorboard"]
    assert TrainingArguments("o", metric_for_best_model="accuracy").greater_is_better is True
    assert TrainingArguments("o", logging_steps=0.25).logging_steps == 0.25
    d = json.loads(a.to_json_string())
    assert d["eval_strategy"] == "steps" and d["hub_token"] == "<HUB_TOKEN>"


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(fp16=True, bf16=True), "At most one of fp16 and bf16"),
        (dict(eval_strategy="steps", save_strategy="epoch", load_best_model_at_end=True), "requires the save and eval"),
        (dict(eval_strategy="steps", eval_steps=3, save_steps=10, load_best_model_at_end=True), "round multiple"),
        (dict(lr_scheduler_type="reduce_lr_on_plateau"), "requires an eval strategy"),
        (dict(warmup_steps=-1), "warmup_steps >= 0"),
        (dict(logging_steps=2.5), "--logging_steps must be an integer"),
        (dict(optim="not_an_optimizer"), "not_an_optimizer"),
        (dict(lr_scheduler_type="nope"), "nope"),
        (dict(gradient_accumulation_steps=0), "--gradient_accumulation_steps"),
    ],
)
def test_validation_errors(kwargs, message):
    with pytest.raises(ValueError, match=message):
        TrainingArguments("o", **kwargs)


def test_set_builders_and_parser(tmp_path):
    a = TrainingArguments("o").set_training(learning_rate=1e-3, batch_size=4, num_epochs=2)
    assert (a.learning_rate, a.per_device_train_batch_size, a.num_train_epochs) == (1e-3, 4, 2)
    parser = transformers.HfArgumentParser(TrainingArguments)
    (parsed,) = parser.parse_args_into_dataclasses(["--output_dir", "x", "--learning_rate", "0.1", "--bf16"])
    assert parsed.learning_rate == 0.1 and parsed.bf16
    yaml_file = tmp_path / "a.yaml"
    yaml_file.write_text("output_dir: y\nmax_steps: 5\nprefetch_batches: 0\n")
    (from_yaml,) = parser.parse_yaml_file(str(yaml_file))
    assert from_yaml.max_steps == 5 and from_yaml.prefetch_batches == 0
    with pytest.raises(SystemExit):
        parser.parse_args_into_dataclasses(["--output_dir", "x", "--learning_rate", "fast"])


def test_fields_without_jax_meaning_warn_once(caplog):
    a = TrainingArguments("o", ddp_backend="nccl", dataloader_num_workers=2)
    assert set(warn_ignored_fields(a)) == {"ddp_backend", "dataloader_num_workers"}
    assert warn_ignored_fields(TrainingArguments("o")) == []
    assert set(IGNORED_FIELDS) <= {f.name for f in dataclasses.fields(transformers.TrainingArguments)}


def test_an_older_transformers_is_refused_at_import_with_the_fix():
    import subprocess
    import sys

    code = "import transformers; transformers.__version__ = '5.17.0'; import jtrainer"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode != 0
    assert "jtrainer needs transformers>=5.23,<6 (found 5.17.0): pip install -U" in out.stderr


# Fields whose value here differs from HF's on purpose: accelerate's config object (jtrainer has no accelerate).
SERIALISED_EXCEPTIONS = {"accelerator_config"}


@pytest.mark.parametrize(
    "kwargs, environ",
    [
        (dict(use_cpu=True), {}),
        (dict(use_cpu=True, report_to="none"), {"KUBEFLOW_TRAINER_SERVER_URL": "http://127.0.0.1:1"}),
        (dict(use_cpu=True, report_to="tensorboard"), {"KUBEFLOW_TRAINER_SERVER_URL": "http://127.0.0.1:1"}),
        (
            dict(
                use_cpu=True,
                eval_strategy="steps",
                logging_steps=3,
                save_steps=3,
                load_best_model_at_end=True,
                bf16=True,
                lr_scheduler_kwargs='{"num_cycles": 2}',
                fsdp_config={"dtype": "torch-dtype"},
                hub_token="secret",
            ),
            {"DISABLE_KUBEFLOW_INTEGRATION": "true", "KUBEFLOW_TRAINER_SERVER_URL": "http://127.0.0.1:1"},
        ),
    ],
)
def test_serialisation_and_post_init_side_effects_equal_hfs_class(kwargs, environ, monkeypatch):
    """to_dict / to_json_string / to_sanitized_dict and __post_init__'s side effects (report_to's kubeflow,
    use_cpu's pin memory, precision, dtype names), beside transformers' own TrainingArguments."""
    torch = pytest.importorskip("torch")
    for name, value in environ.items():
        monkeypatch.setenv(name, value)
    if "fsdp_config" in kwargs:
        kwargs = {**kwargs, "fsdp_config": {"dtype": torch.bfloat16}}
    theirs = transformers.TrainingArguments("o", **kwargs)
    ours = TrainingArguments("o", **kwargs)
    for attribute in ("report_to", "dataloader_pin_memory", "bf16", "fp16", "mixed_precision"):
        assert getattr(ours, attribute) == getattr(theirs, attribute), attribute
    for method in ("to_dict", "to_sanitized_dict"):
        hf, jt = getattr(theirs, method)(), getattr(ours, method)()
        assert set(jt) - set(hf) == JAX_ONLY_FIELDS
        differing = {k for k in hf if hf[k] != jt[k]} - SERIALISED_EXCEPTIONS
        assert differing <= set(DEFAULT_EXCEPTIONS), {k: (hf[k], jt[k]) for k in differing}
    hf_json, jt_json = json.loads(theirs.to_json_string()), json.loads(ours.to_json_string())
    assert {k: v for k, v in jt_json.items() if k in hf_json and k not in SERIALISED_EXCEPTIONS} == {
        k: v for k, v in hf_json.items() if k not in SERIALISED_EXCEPTIONS
    } | {k: jt_json[k] for k in DEFAULT_EXCEPTIONS}


def test_save_strategy_best_without_a_metric_has_hfs_words():
    transformers_trainer = pytest.importorskip("torch") and transformers.Trainer
    with pytest.raises(ValueError) as hf_error:
        transformers_trainer(
            torch_linear(), transformers.TrainingArguments("o", save_strategy="best", use_cpu=True, report_to="none")
        )
    with pytest.raises(ValueError) as ours:
        TrainingArguments("o", save_strategy="best", report_to="none")
    assert str(ours.value) == str(hf_error.value)


def torch_linear():
    import torch

    return torch.nn.Linear(2, 1)
