"""The shuffled order of each epoch is transformers.Trainer's: accelerate's seedable sampler (torch's randperm
seeded with data_seed or seed, plus the epoch), read from transformers.Trainer's own train dataloader; and the same
without torch (jtrainer's MT19937 reproduction of torch's randperm)."""

import json
import subprocess
import sys

import numpy as np
import pytest
from flax import nnx

torch = pytest.importorskip("torch")
pytest.importorskip("accelerate")

from jtrainer.core.host_rng import randperm  # noqa: E402


def _rows(n):
    lengths = np.random.RandomState(0).randint(1, 40, n)
    return [{"idx": i, "input_ids": list(range(int(length)))} for i, length in enumerate(lengths)]


def _hf_order(tmp_path, n, epoch, split="train", **seeds):
    import transformers

    rows = _rows(n)
    trainer = transformers.Trainer(
        model=torch.nn.Linear(1, 1),
        args=transformers.TrainingArguments(
            output_dir=str(tmp_path / "hf"),
            per_device_train_batch_size=4,
            report_to="none",
            use_cpu=True,
            remove_unused_columns=False,
            **seeds,
        ),
        train_dataset=rows,
        eval_dataset=rows,
        data_collator=lambda features: {"idx": torch.tensor([f["idx"] for f in features])},
    )
    loader = trainer.get_train_dataloader() if split == "train" else trainer.get_eval_dataloader()
    loader.set_epoch(epoch)
    return np.concatenate([batch["idx"].numpy() for batch in loader])


def _jtrainer_order(tmp_path, n, epoch, split="train", **seeds):
    from jtrainer import Trainer, TrainingArguments

    trainer = Trainer(
        model=nnx.Linear(1, 1, rngs=nnx.Rngs(0)),
        args=TrainingArguments(
            output_dir=str(tmp_path / "jt"),
            per_device_train_batch_size=4,
            report_to="none",
            remove_unused_columns=False,
            **seeds,
        ),
        train_dataset=_rows(n),
        eval_dataset=_rows(n),
        data_collator=lambda features: {"idx": np.asarray([f["idx"] for f in features])},
    )
    loader = trainer.get_train_dataloader() if split == "train" else trainer.get_eval_dataloader()
    loader.set_epoch(epoch)
    return np.concatenate([batch["idx"] for batch, _ in loader])


@pytest.mark.parametrize("seeds", [{"seed": 42}, {"seed": 3, "data_seed": 7}], ids=["seed", "data_seed"])
@pytest.mark.parametrize("epoch", [0, 2])
def test_each_epoch_is_shuffled_as_transformers_trainer(tmp_path, seeds, epoch):
    expected = _hf_order(tmp_path, 37, epoch, **seeds)
    np.testing.assert_array_equal(_jtrainer_order(tmp_path, 37, epoch, **seeds), expected)


@pytest.mark.parametrize("split", ["train", "eval"])
def test_group_by_length_orders_as_transformers_trainer(tmp_path, split):
    """HF's LengthGroupedSampler: training shuffles with torch's global generator (here as the script left it
    after the Trainer seeded it), evaluation with a generator seeded by seed; both then group in HF's
    mega-batches, longest row first."""
    over = {"train_sampling_strategy": "group_by_length", "gradient_accumulation_steps": 2, "seed": 5}
    expected = _hf_order(tmp_path, 230, 0, split, **over)
    np.testing.assert_array_equal(_jtrainer_order(tmp_path, 230, 0, split, **over), expected)


CASES = [(0, 1), (1, 5), (10, 42), (1000, 0), (5003, 2**32 - 1), (7, 2**32 + 9)]


def test_the_permutation_without_torch_is_torchs():
    code = (
        "import json, sys; sys.modules['torch'] = None\n"
        "from jtrainer.core.host_rng import randperm\n"
        f"print(json.dumps([randperm(n, seed).tolist() for n, seed in {CASES}]))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    for (n, seed), without_torch in zip(CASES, json.loads(done.stdout.splitlines()[-1]), strict=True):
        generator = torch.Generator()
        generator.manual_seed(seed)
        np.testing.assert_array_equal(without_torch, torch.randperm(n, generator=generator).numpy())
        np.testing.assert_array_equal(randperm(n, seed), torch.randperm(n, generator=generator.manual_seed(seed)))


class _TorchIdx(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.ones(1))

    def forward(self, idx, labels=None):
        return {"loss": (self.w * idx.float()).mean() * 0.0 + self.w.sum()}


class _NnxIdx(nnx.Module):
    def __init__(self):
        self.w = nnx.Param(np.ones(1, np.float32))

    def __call__(self, idx, labels=None):
        return {"loss": (self.w[...] * idx).mean() * 0.0 + self.w[...].sum()}


@pytest.mark.parametrize("eval_on_start", [False, True])
def test_group_by_length_epochs_after_evaluations_follow_transformers_trainer(tmp_path, eval_on_start):
    """Evaluations during training (and on start) draw their loader seed from torch's global generator, as the
    training epochs' length-grouped permutations do: every epoch's order is HF's."""
    import transformers

    from jtrainer import Trainer, TrainingArguments

    kw = dict(
        per_device_train_batch_size=4,
        per_device_eval_batch_size=4,
        num_train_epochs=2,
        eval_strategy="steps",
        eval_steps=3,
        train_sampling_strategy="group_by_length",
        save_strategy="no",
        report_to="none",
        disable_tqdm=True,
        remove_unused_columns=False,
        seed=5,
        eval_on_start=eval_on_start,
    )
    orders = {}
    for name, trainer_class, args_class, model in (
        ("hf", transformers.Trainer, transformers.TrainingArguments, _TorchIdx()),
        ("jtrainer", Trainer, TrainingArguments, _NnxIdx()),
    ):
        seen = []

        def collate(features, to=torch.tensor if name == "hf" else np.asarray, seen=seen):
            ids = [f["idx"] for f in features]
            if ids[0] < 1000:  # a training batch
                seen.extend(ids)
            return {"idx": to(ids), "labels": to([0] * len(ids))}

        trainer = trainer_class(
            model=model,
            args=args_class(output_dir=str(tmp_path / name), **kw, **({"use_cpu": True} if name == "hf" else {})),
            train_dataset=_rows(40),
            eval_dataset=[{**row, "idx": 1000 + row["idx"]} for row in _rows(12)],
            data_collator=collate,
        )
        trainer.train()
        orders[name] = seen
    if eval_on_start:  # jtrainer collates the first batch once before that evaluation (its step's probe)
        orders["jtrainer"] = orders["jtrainer"][4:]
    assert len(orders["hf"]) == 80
    assert orders["jtrainer"] == orders["hf"]
