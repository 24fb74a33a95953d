"""Prediction outputs against transformers.Trainer: tuples, dicts, ignore_keys, several label names and
batch_eval_metrics, on the same weights and rows (a torch nn.Module and its nnx twin)."""

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("accelerate")

from conftest import torch_rows  # noqa: E402
from flax import nnx  # noqa: E402


def _rows(n, seed=0):
    rng = np.random.RandomState(seed)
    return [
        {
            "x": rng.randn(3).astype(np.float32),
            "labels": rng.randn(2).astype(np.float32),
            "aux_labels": rng.randn(2).astype(np.float32),
        }
        for _ in range(n)
    ]


class TorchTwoHeads(torch.nn.Module):
    """Returns (loss, y, tanh(y)) or a dict {"loss", "output", "aux"}; the loss is its own mean (MSE)."""

    main_input_name = "x"

    def __init__(self, dict_output: bool):
        super().__init__()
        torch.manual_seed(0)
        self.lin = torch.nn.Linear(3, 2)
        self.dict_output = dict_output

    def forward(self, x, labels=None, aux_labels=None):
        y = self.lin(x)
        z = torch.tanh(y)
        loss = None
        if labels is not None:
            loss = ((y - labels) ** 2).mean()
            if aux_labels is not None:
                loss = loss + ((z - aux_labels) ** 2).mean()
        if self.dict_output:
            out = {"output": y, "aux": z}
            return out if loss is None else {"loss": loss, **out}
        return (y, z) if loss is None else (loss, y, z)


class NnxTwoHeads(nnx.Module):
    main_input_name = "x"

    def __init__(self, torch_model: TorchTwoHeads):
        self.lin = nnx.Linear(3, 2, rngs=nnx.Rngs(0))
        self.lin.kernel[...] = torch_model.lin.weight.detach().numpy().T.copy()
        self.lin.bias[...] = torch_model.lin.bias.detach().numpy().copy()
        self.dict_output = torch_model.dict_output

    def __call__(self, x, labels=None, aux_labels=None):
        import jax.numpy as jnp

        y = self.lin(x)
        z = jnp.tanh(y)
        loss = None
        if labels is not None:
            loss = jnp.mean((y - labels) ** 2)
            if aux_labels is not None:
                loss = loss + jnp.mean((z - aux_labels) ** 2)
        if self.dict_output:
            out = {"output": y, "aux": z}
            return out if loss is None else {"loss": loss, **out}
        return (y, z) if loss is None else (loss, y, z)


class MetricCalls:
    """compute_metrics that records what it was given (and returns the mean prediction)."""

    def __init__(self):
        self.calls = []

    def __call__(self, pred, compute_result=None):
        preds = pred.predictions
        first = preds[0] if isinstance(preds, tuple) else preds
        labels = pred.label_ids
        self.calls.append(
            {
                "compute_result": compute_result,
                "preds": [np.asarray(p) for p in (preds if isinstance(preds, tuple) else (preds,))],
                "labels": [np.asarray(v) for v in (labels if isinstance(labels, tuple) else (labels,))],
                "inputs": None if pred.inputs is None else {k: np.asarray(v) for k, v in pred.inputs.items()},
                "losses": None if pred.losses is None else np.asarray(pred.losses),
            }
        )
        return {"mean_prediction": float(np.mean(np.asarray(first)))}


def _both(tmp_path, dict_output, rows, **over):
    import transformers

    from jtrainer import Trainer, TrainingArguments

    kw = dict(per_device_eval_batch_size=8, report_to="none", disable_tqdm=True, use_cpu=True)
    kw.update(over)
    torch_model = TorchTwoHeads(dict_output)
    hf_metrics, jt_metrics = MetricCalls(), MetricCalls()
    hf = transformers.Trainer(
        model=torch_model,
        args=transformers.TrainingArguments(output_dir=str(tmp_path / "hf"), **kw),
        compute_metrics=hf_metrics,
    )
    ours = Trainer(
        model=NnxTwoHeads(torch_model),
        args=TrainingArguments(output_dir=str(tmp_path / "jt"), **kw),
        compute_metrics=jt_metrics,
    )
    return (hf, hf_metrics), (ours, jt_metrics), torch_rows(rows)


def _assert_tree_close(got, ref):
    if isinstance(ref, tuple):
        assert isinstance(got, tuple) and len(got) == len(ref), (type(got), type(ref))
        for g, r in zip(got, ref):
            _assert_tree_close(g, r)
    else:
        assert not isinstance(got, tuple)
        np.testing.assert_allclose(np.asarray(got), np.asarray(ref), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(
    "dict_output, label_names, ignore_keys",
    [(False, ["labels"], None), (True, None, None), (True, None, ["aux"]), (False, None, None)],
    ids=["tuple-one-label", "dict", "dict-ignore-aux", "tuple-two-labels"],
)
def test_predict_outputs_as_transformers(tmp_path, dict_output, label_names, ignore_keys):
    rows = _rows(32)
    over = {} if label_names is None else {"label_names": label_names}
    (hf, _), (ours, _), torch_data = _both(tmp_path, dict_output, rows, **over)
    ref = hf.predict(torch_data, ignore_keys=ignore_keys)
    got = ours.predict(rows, ignore_keys=ignore_keys)
    _assert_tree_close(got.predictions, ref.predictions)
    _assert_tree_close(got.label_ids, ref.label_ids)
    assert set(got.metrics) - {"test_model_preparation_time"} >= {"test_loss", "test_mean_prediction"}
    for key in ("test_loss", "test_mean_prediction"):
        np.testing.assert_allclose(got.metrics[key], ref.metrics[key], rtol=1e-5, err_msg=key)


@pytest.mark.parametrize("include", [[], ["inputs", "loss"]], ids=["plain", "with-inputs-and-losses"])
@pytest.mark.parametrize("description", ["evaluate", "predict"])
def test_batch_eval_metrics_calls_as_transformers(tmp_path, description, include):
    """Each batch computes metrics with compute_result=False and the last with True and that batch's values
    (with include_for_metrics, its inputs and losses too); evaluate returns the last call's metrics, predict still
    keeps every prediction."""
    rows = _rows(40)
    (hf, hf_calls), (ours, jt_calls), torch_data = _both(
        tmp_path, False, rows, batch_eval_metrics=True, include_for_metrics=include
    )
    if description == "evaluate":
        ref, got = hf.evaluate(torch_data), ours.evaluate(rows)
    else:
        ref_out, got_out = hf.predict(torch_data), ours.predict(rows)
        _assert_tree_close(got_out.predictions, ref_out.predictions)
        ref, got = ref_out.metrics, got_out.metrics
    assert [c["compute_result"] for c in jt_calls.calls] == [c["compute_result"] for c in hf_calls.calls]
    assert [c["compute_result"] for c in jt_calls.calls] == [False] * 4 + [True]
    for mine, theirs in zip(jt_calls.calls, hf_calls.calls):
        for key in ("preds", "labels"):
            for g, r in zip(mine[key], theirs[key]):
                np.testing.assert_allclose(g, r, rtol=1e-5, atol=1e-6)
        assert (mine["inputs"] is None) == (theirs["inputs"] is None)
        if theirs["inputs"] is not None:  # HF hands over the batch's whole input dict
            assert sorted(mine["inputs"]) == sorted(theirs["inputs"])
            for name, value in theirs["inputs"].items():
                np.testing.assert_allclose(mine["inputs"][name], value, rtol=1e-6)
        assert (mine["losses"] is None) == (theirs["losses"] is None)
        if theirs["losses"] is not None:  # the batch's mean loss, once per row
            assert mine["losses"].shape == theirs["losses"].shape
            np.testing.assert_allclose(mine["losses"], theirs["losses"], rtol=1e-5)
    prefix = "eval" if description == "evaluate" else "test"
    np.testing.assert_allclose(got[f"{prefix}_mean_prediction"], ref[f"{prefix}_mean_prediction"], rtol=1e-5)
    np.testing.assert_allclose(got[f"{prefix}_loss"], ref[f"{prefix}_loss"], rtol=1e-5)


def test_batch_eval_metrics_hands_a_torch_model_torch_tensors_as_hf(tmp_path):
    """For a torch model (the bridge) HF's batch metrics get torch tensors (HF's own test calls torch.abs on
    them); a native model's get numpy (the test above)."""
    import copy
    import importlib.util

    import transformers

    from jtrainer import Trainer, TrainingArguments

    if importlib.util.find_spec("torchax") is None:
        pytest.skip("torchax is not installed")
    seen = {"hf": [], "ours": []}

    def metrics_of(name):
        def compute_metrics(pred, compute_result=False):
            values = (pred.predictions, pred.label_ids, pred.losses, *pred.inputs.values())
            seen[name].append([type(v) for v in values])
            return {"mean_abs": float(torch.abs(pred.predictions[0]).mean())}

        return compute_metrics

    kw = dict(
        per_device_eval_batch_size=8,
        report_to="none",
        disable_tqdm=True,
        use_cpu=True,
        batch_eval_metrics=True,
        include_for_metrics=["inputs", "loss"],
    )
    model, rows = TorchTwoHeads(False), _rows(16)
    hf = transformers.Trainer(
        model=model,
        args=transformers.TrainingArguments(output_dir=str(tmp_path / "hf"), **kw),
        compute_metrics=metrics_of("hf"),
    )
    ours = Trainer(
        model=copy.deepcopy(model),
        args=TrainingArguments(output_dir=str(tmp_path / "jt"), **kw),
        compute_metrics=metrics_of("ours"),
    )
    expected, got = hf.evaluate(torch_rows(rows)), ours.evaluate(rows)
    assert seen["ours"] == seen["hf"] and seen["hf"][0][0] is tuple
    assert seen["hf"][0] == [tuple, tuple] + [torch.Tensor] * 4  # (y, z), both label names, losses, 3 inputs
    np.testing.assert_allclose(got["eval_mean_abs"], expected["eval_mean_abs"], rtol=1e-6)
