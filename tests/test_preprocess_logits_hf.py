"""preprocess_logits_for_metrics written for torch (run_clm's `logits.argmax(dim=-1)`) works unedited: JAX cannot
trace it, so it runs inside the eval step through torchax (the torch bridge); one that torchax cannot run either (a
host conversion) runs on the host with torch tensors, as HF calls it; one JAX can trace runs inside the eval step.
All give HF's metrics on the same model and data."""

import numpy as np
import pytest
import torch
import transformers
from conftest import scratch_dir, tiny_llama_config, token_rows, torch_rows

from jtrainer import Trainer, TrainingArguments
from jtrainer.models import AutoModelForCausalLM


def torch_style(logits, labels):  # run_clm's, verbatim
    if isinstance(logits, tuple):
        logits = logits[0]
    return logits.argmax(dim=-1)


def host_only(logits, labels):  # a numpy round trip: neither JAX nor torchax can trace it
    if isinstance(logits, tuple):
        logits = logits[0]
    return torch.from_numpy(logits.numpy()).argmax(dim=-1)


def jax_style(logits, labels):
    return logits.argmax(axis=-1)


def accuracy(p):
    preds, labels = p.predictions[:, :-1].reshape(-1), p.label_ids[:, 1:].reshape(-1)
    keep = labels != -100
    return {"accuracy": float((preds[keep] == labels[keep]).mean())}


def test_a_torch_style_preprocess_runs_in_the_step_and_gives_hfs_metrics(tmp_path):
    torch.manual_seed(0)
    reference = transformers.LlamaForCausalLM(tiny_llama_config())
    reference.save_pretrained(tmp_path / "ref")
    rows = token_rows(10, length=12, seed=4)
    hf = transformers.Trainer(
        model=reference,
        args=transformers.TrainingArguments(
            output_dir=str(tmp_path / "hf"), report_to="none", per_device_eval_batch_size=4, use_cpu=True
        ),
        eval_dataset=torch_rows(rows),
        compute_metrics=accuracy,
        preprocess_logits_for_metrics=torch_style,
    )
    expected = hf.evaluate()
    results = {}
    for name, function in (("torch", torch_style), ("host", host_only), ("jax", jax_style)):
        trainer = Trainer(
            model=AutoModelForCausalLM.from_pretrained(str(tmp_path / "ref")),
            args=TrainingArguments(output_dir=scratch_dir(), report_to="none", per_device_eval_batch_size=4),
            eval_dataset=rows,
            compute_metrics=accuracy,
            preprocess_logits_for_metrics=function,
        )
        results[name] = trainer.evaluate()
        assert trainer._preprocess_placement.on_host == (name == "host")
    for result in results.values():
        assert result["eval_accuracy"] == expected["eval_accuracy"]
        np.testing.assert_allclose(result["eval_loss"], expected["eval_loss"], rtol=1e-5)


def test_a_bug_in_preprocess_is_raised_not_moved_to_the_host(tmp_path):
    """Only code JAX cannot trace (a TypeError or AttributeError, torch's methods) runs on the host; any other
    exception is the function's own and reaches the caller, as under transformers.Trainer."""

    def buggy(logits, labels):
        raise ValueError("a bug in the user's function")

    trainer = Trainer(
        model=AutoModelForCausalLM.from_config(tiny_llama_config()),
        args=TrainingArguments(output_dir=scratch_dir(), report_to="none", per_device_eval_batch_size=4),
        eval_dataset=token_rows(4, length=12, seed=4),
        compute_metrics=accuracy,
        preprocess_logits_for_metrics=buggy,
    )
    with pytest.raises(ValueError, match="a bug in the user's function"):
        trainer.evaluate()
