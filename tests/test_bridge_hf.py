"""The torch bridge against transformers.Trainer: transformers' own PyTorch models, trained by jtrainer's step
(through torchax) and by transformers.Trainer (torch), from the same weights, rows and hyperparameters.

Each model is tiny and built with torch; dropout is 0 (torch's dropout masks come from torch's generator, the
bridge's from JAX keys: see test_bridge.py for dropout on)."""

import copy
import importlib.util

import numpy as np
import pytest

torch = pytest.importorskip("torch")
if importlib.util.find_spec("torchax") is None:  # imported by jtrainer.bridge, with its fixes for torch 2.13
    pytest.skip("torchax is not installed", allow_module_level=True)
transformers = pytest.importorskip("transformers")

from bridge_cases import _case, assert_same_logs  # noqa: E402
from conftest import side_by_side_args as _args  # noqa: E402
from conftest import torch_rows  # noqa: E402

CASES = [
    "llama", "qwen3", "gemma3", "phi3", "gpt2", "mixtral", "qwen3-moe",
    "bert-sequence", "bert-token", "bert-qa", "bert-choice", "vit",
    "t5", "whisper",
]  # fmt: skip


def _without_gradient(model, rows) -> set[str]:
    """Parameters whose true gradient is 0 (float64, all rows): a QA head's logits do not change when the last
    LayerNorm's bias adds the same to every position, attention scores not with a key bias. Their updates are
    AdamW's normalisation of rounding noise in either framework, not a result to compare."""
    exact = copy.deepcopy(model).double()
    if getattr(exact.config, "_experts_implementation", None) == "grouped_mm":  # torch's has no float64 kernel
        exact.set_experts_implementation("batched_mm")
    batch = {k: torch.tensor(np.stack([r[k] for r in rows])) for k in rows[0]}
    batch = {k: v.double() if v.is_floating_point() else v for k, v in batch.items()}
    exact(**batch).loss.backward()
    return {n for n, p in exact.named_parameters() if p.grad is None or float(p.grad.abs().max()) < 1e-12}


@pytest.mark.parametrize("name", CASES)
def test_same_run_as_transformers_trainer(tmp_path, name):
    from jtrainer import Trainer, TrainingArguments

    torch.manual_seed(0)
    model, rows = _case(name)
    ours_model = copy.deepcopy(model)
    noise_only = _without_gradient(model, rows)
    hf = transformers.Trainer(
        model=model, args=_args(transformers.TrainingArguments, tmp_path / "hf"), train_dataset=torch_rows(rows)
    )
    hf_out = hf.train()
    ours = Trainer(model=ours_model, args=_args(TrainingArguments, tmp_path / "jt"), train_dataset=rows)
    jt_out = ours.train()

    assert_same_logs(hf, ours, steps=8)
    assert jt_out.global_step == hf_out.global_step
    assert ours.model is ours_model  # HF's trainer.model: the model given, holding the trained weights
    trained = dict(hf.model.named_parameters())
    for key, value in ours_model.named_parameters():
        if key in noise_only:
            continue
        np.testing.assert_allclose(value.detach().numpy(), trained[key].detach().numpy(), atol=1e-5, err_msg=key)
    assert ours.state.total_flos == pytest.approx(hf.state.total_flos, rel=1e-6)
