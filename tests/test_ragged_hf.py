"""Ragged last batches against transformers.Trainer, with a loss the model averages over its rows (MSE), where
padding rows would count: 66 rows, batch 8. One data shard gives HF's single-device run; eight data shards give
HF's distributed rule (the last batch completed with the epoch's first rows, as its distributed sampler does)."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("accelerate")

from conftest import torch_rows  # noqa: E402
from flax import nnx  # noqa: E402

HERE = os.path.dirname(__file__)


def regression_rows(n, seed=0):
    rng = np.random.RandomState(seed)
    return [{"x": rng.randn(3).astype(np.float32), "labels": rng.randn(1).astype(np.float32)} for _ in range(n)]


class TorchRegression(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.lin = torch.nn.Linear(3, 1)

    def forward(self, x, labels=None):
        y = self.lin(x)
        return (y,) if labels is None else (((y - labels) ** 2).mean(), y)


class NnxRegression(nnx.Module):
    """The twin: a mean over rows of its own, no num_items_in_batch."""

    def __init__(self, weight, bias):
        self.lin = nnx.Linear(3, 1, rngs=nnx.Rngs(0))
        self.lin.kernel[...] = np.asarray(weight).T.copy()
        self.lin.bias[...] = np.asarray(bias).copy()

    def __call__(self, x, labels=None):
        import jax.numpy as jnp

        y = self.lin(x)
        return (y,) if labels is None else (jnp.mean((y - labels) ** 2), y)


def run_args(out, **over):
    kw = dict(
        output_dir=str(out),
        per_device_train_batch_size=8,
        per_device_eval_batch_size=8,
        learning_rate=1e-2,
        weight_decay=0.1,
        max_grad_norm=1.0,
        num_train_epochs=2,
        logging_steps=1,
        optim="adamw_torch",
        train_sampling_strategy="sequential",
        save_strategy="no",
        eval_strategy="epoch",
        report_to="none",
        disable_tqdm=True,
        seed=0,
    )
    kw.update(over)
    return kw


def _hf_run(tmp_path, train_rows, eval_rows, **over):
    import transformers

    model = TorchRegression()
    init = (model.lin.weight.detach().numpy().copy(), model.lin.bias.detach().numpy().copy())
    hf = transformers.Trainer(
        model=model,
        args=transformers.TrainingArguments(**run_args(tmp_path / "hf", **over)),
        train_dataset=torch_rows(train_rows),
        eval_dataset=torch_rows(eval_rows),
    )
    hf.train()
    predictions = hf.predict(torch_rows(eval_rows))
    return hf, init, predictions


def _logged(history, key):
    return [h[key] for h in history if key in h]


@pytest.mark.parametrize("accumulation", [1, 2])
def test_ragged_batches_on_one_device_as_transformers(tmp_path, accumulation):
    from jtrainer import Trainer, TrainingArguments

    rows = regression_rows(66)
    hf, init, ref_pred = _hf_run(tmp_path, rows, rows, gradient_accumulation_steps=accumulation)
    ours = Trainer(
        model=NnxRegression(*init),
        args=TrainingArguments(**run_args(tmp_path / "jt", gradient_accumulation_steps=accumulation)),
        train_dataset=rows,
        eval_dataset=rows,
    )
    ours.train()
    got_pred = ours.predict(rows)

    for key in ("loss", "eval_loss"):
        ref, got = _logged(hf.state.log_history, key), _logged(ours.state.log_history, key)
        assert len(got) == len(ref) > 0
        np.testing.assert_allclose(got, ref, rtol=1e-5, err_msg=key)
    np.testing.assert_allclose(got_pred.predictions, ref_pred.predictions, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(got_pred.metrics["test_loss"], ref_pred.metrics["test_loss"], rtol=1e-5)
    np.testing.assert_allclose(
        np.asarray(ours.model.lin.kernel[...]).T, hf.model.lin.weight.detach().numpy(), rtol=1e-5, atol=1e-6
    )
    np.testing.assert_allclose(
        np.asarray(ours.model.lin.bias[...]), hf.model.lin.bias.detach().numpy(), rtol=1e-5, atol=1e-6
    )


EIGHT_SHARDS = r"""
import json, os, sys
sys.path.insert(0, sys.argv[2])
import numpy as np
from test_ragged_hf import NnxRegression, regression_rows, run_args
from jtrainer import Trainer, TrainingArguments
weight, bias = json.loads(open(sys.argv[3]).read())
rows = regression_rows(66)
trainer = Trainer(model=NnxRegression(np.asarray(weight, np.float32), np.asarray(bias, np.float32)),
                  args=TrainingArguments(**run_args(sys.argv[1], per_device_train_batch_size=4,
                                                    per_device_eval_batch_size=4, mesh_shape={"data": 8})),
                  train_dataset=rows, eval_dataset=rows)
trainer.train()
out = trainer.predict(rows)
os.makedirs(sys.argv[1], exist_ok=True)
json.dump({"losses": [h["loss"] for h in trainer.state.log_history if "loss" in h],
           "eval_losses": [h["eval_loss"] for h in trainer.state.log_history if "eval_loss" in h],
           "kernel": np.asarray(trainer.model.lin.kernel[...]).tolist(),
           "bias": np.asarray(trainer.model.lin.bias[...]).tolist(),
           "predictions": np.asarray(out.predictions).tolist(),
           "test_loss": out.metrics["test_loss"]}, open(os.path.join(sys.argv[1], "out.json"), "w"))
"""


def _hf_distributed_eval_loss(model, rows, processes, per_process):
    """HF's eval_loss on `processes` processes of `per_process` rows, computed with the torch model: the last
    batch completed with the first rows, each process's mean repeated over its rows, the first N kept."""
    n, total = len(rows), processes * per_process
    order = list(range(n)) + list(range(-n % total))
    losses = []
    for start in range(0, len(order), per_process):
        shard = [rows[i] for i in order[start : start + per_process]]
        x = torch.tensor(np.stack([r["x"] for r in shard]))
        labels = torch.tensor(np.stack([r["labels"] for r in shard]))
        with torch.no_grad():
            losses += [float(model(x, labels)[0])] * per_process
    return float(np.mean(np.asarray(losses[:n], np.float64)))


def test_ragged_batches_on_eight_data_shards_follow_the_distributed_rule(tmp_path):
    """HF on 8 processes of 4 rows: the last batch of each epoch is rows 64, 65 and then rows 0..29 again (its
    distributed sampler completes it from the start). The training reference is HF's single-device run on
    exactly those batches; predictions leave the completing rows out; eval_loss is HF's per-process rule."""
    rows = regression_rows(66)
    hf, init, ref_pred = _hf_run(tmp_path, rows + rows[:30], rows, eval_strategy="no", per_device_train_batch_size=32)
    (tmp_path / "init.json").write_text(json.dumps([init[0].tolist(), init[1].tolist()]))
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="--xla_force_host_platform_device_count=8")
    result = subprocess.run(
        [sys.executable, "-c", EIGHT_SHARDS, str(tmp_path / "jt"), HERE, str(tmp_path / "init.json")],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    got = json.loads((tmp_path / "jt" / "out.json").read_text())
    np.testing.assert_allclose(got["losses"], _logged(hf.state.log_history, "loss"), rtol=1e-5)
    np.testing.assert_allclose(np.asarray(got["kernel"]).T, hf.model.lin.weight.detach().numpy(), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(got["predictions"], ref_pred.predictions, rtol=1e-5, atol=1e-6)
    expected = _hf_distributed_eval_loss(hf.model, rows, processes=8, per_process=4)
    assert (
        abs(
            expected
            - float(np.mean([(p - r["labels"][0]) ** 2 for p, r in zip(np.asarray(got["predictions"])[:, 0], rows)]))
        )
        > 1e-4
    )  # the rule shows
    np.testing.assert_allclose(got["test_loss"], expected, rtol=1e-5)
    np.testing.assert_allclose(got["eval_losses"][-1], expected, rtol=1e-5)


EIGHT_SHARDS_LM = r"""
import json, sys
sys.path.insert(0, sys.argv[2])
from conftest import token_rows
from jtrainer import Trainer, TrainingArguments
from jtrainer.models.llama import LlamaForCausalLM
trainer = Trainer(LlamaForCausalLM.from_pretrained(sys.argv[3]),
                  TrainingArguments(output_dir=sys.argv[1], mesh_shape={"data": 8}, per_device_eval_batch_size=2,
                                    report_to="none", disable_tqdm=True),
                  eval_dataset=token_rows(21, ragged_labels=True))
print("EVAL_LOSS", json.dumps(trainer.evaluate()["eval_loss"]))
"""


def test_token_loss_eval_on_eight_data_shards_follows_the_distributed_rule(tmp_path):
    """A causal LM's own loss (sum / num_items_in_batch) on 8 processes of 2 rows, 21 rows: each process's loss is
    its token sum over the count of all processes' tokens, times 8 (average_tokens_across_devices); the last batch
    is completed from the first rows and only its first 5 entries are kept. Computed with the torch model."""
    import transformers
    from conftest import tiny_llama_config, token_rows

    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(tiny_llama_config()).eval()
    model.save_pretrained(tmp_path / "init")
    rows = token_rows(21, ragged_labels=True)
    processes, per_process = 8, 2
    total = processes * per_process
    order = list(range(21)) + list(range(-21 % total))
    losses = []
    for start in range(0, len(order), total):
        batch = [rows[i] for i in order[start : start + total]]
        labels = torch.tensor(np.stack([r["labels"] for r in batch]))
        num_items = int((labels[:, 1:] != -100).sum())
        for p in range(processes):
            shard = batch[p * per_process : (p + 1) * per_process]
            with torch.no_grad():
                out = model(
                    input_ids=torch.tensor(np.stack([r["input_ids"] for r in shard])),
                    attention_mask=torch.tensor(np.stack([r["attention_mask"] for r in shard])),
                    labels=torch.tensor(np.stack([r["labels"] for r in shard])),
                    num_items_in_batch=torch.tensor(num_items),
                )
            losses += [float(out.loss) * processes] * per_process
    expected = float(np.mean(np.asarray(losses[:21], np.float64)))

    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="--xla_force_host_platform_device_count=8")
    result = subprocess.run(
        [sys.executable, "-c", EIGHT_SHARDS_LM, str(tmp_path / "jt"), HERE, str(tmp_path / "init")],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    got = json.loads(next(line for line in result.stdout.splitlines() if line.startswith("EVAL_LOSS")).split(" ", 1)[1])
    np.testing.assert_allclose(got, expected, rtol=1e-5)
