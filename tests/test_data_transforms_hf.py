"""Datasets read as HF's DataLoader reads them, beside transformers.Trainer.

The image-classification task guide's pattern: a `datasets.Dataset` of PIL images with `with_transform(fn)` making
`pixel_values` (with a random flip drawn from torch's generator, as torchvision's augmentations draw),
`remove_unused_columns=False`, and a collator stacking `x["pixel_values"]`; a ViT through the bridge. Losses,
evaluation and parameters agree with torch's. Then loaders: HF's DataLoader attributes, and any iterable of
batches from an overridden `get_train_dataloader`."""

import copy
import importlib.util
import tempfile

import numpy as np
import pytest

torch = pytest.importorskip("torch")
if importlib.util.find_spec("torchax") is None:
    pytest.skip("torchax is not installed", allow_module_level=True)
transformers = pytest.importorskip("transformers")
datasets = pytest.importorskip("datasets")
PIL = pytest.importorskip("PIL.Image")

from bridge_zoo import Regression, arguments, rows  # noqa: E402

from jtrainer import Trainer, TrainingArguments  # noqa: E402

SIZE = 8


def _images(n, seed):
    rng = np.random.RandomState(seed)
    pixels = rng.randint(0, 256, (n, SIZE, SIZE, 3)).astype(np.uint8)
    return datasets.Dataset.from_dict(
        {"image": [PIL.fromarray(p) for p in pixels], "label": rng.randint(0, 3, n).tolist()},
        features=datasets.Features({"image": datasets.Image(), "label": datasets.ClassLabel(num_classes=3)}),
    )


def _transforms(examples):
    """The guide's transform, with torch ops for torchvision's: to a normalised CHW tensor, flipped at random."""
    values = []
    for image in examples["image"]:
        x = torch.tensor(np.asarray(image.convert("RGB")), dtype=torch.float32).permute(2, 0, 1) / 255.0
        if torch.rand(()) < 0.5:  # RandomHorizontalFlip: one draw from torch's generator per image
            x = x.flip(-1)
        values.append((x - 0.5) / 0.5)
    examples["pixel_values"] = values
    del examples["image"]
    return examples


def _collate(examples):
    return {
        "pixel_values": torch.stack([example["pixel_values"] for example in examples]),
        "labels": torch.tensor([example["label"] for example in examples]),
    }


def _vit():
    config = transformers.ViTConfig(
        image_size=SIZE,
        patch_size=4,
        num_channels=3,
        hidden_size=16,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=32,
        num_labels=3,
    )
    torch.manual_seed(0)
    return transformers.ViTForImageClassification(config)


def _guide_args(cls):
    return cls(
        tempfile.mkdtemp(),
        remove_unused_columns=False,
        per_device_train_batch_size=4,
        per_device_eval_batch_size=4,
        max_steps=4,
        learning_rate=5e-3,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        disable_tqdm=True,
        use_cpu=True,
        seed=42,
    )


def test_the_image_classification_guide_runs_with_torchs_numbers():
    model = _vit()
    train, held_out = _images(12, 0).with_transform(_transforms), _images(6, 1).with_transform(_transforms)
    runs = {}
    for name, trainer_cls, args_cls in (
        ("hf", transformers.Trainer, transformers.TrainingArguments),
        ("ours", Trainer, TrainingArguments),
    ):
        trainer = trainer_cls(
            model=copy.deepcopy(model),
            args=_guide_args(args_cls),
            data_collator=_collate,
            train_dataset=train,
            eval_dataset=held_out,
        )
        trainer.train()
        losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
        runs[name] = losses, trainer.evaluate()["eval_loss"], trainer.model.state_dict()
    np.testing.assert_allclose(runs["ours"][0], runs["hf"][0], rtol=1e-5)
    assert runs["ours"][1] == pytest.approx(runs["hf"][1], rel=1e-5)
    for key, value in runs["hf"][2].items():
        torch.testing.assert_close(runs["ours"][2][key], value, rtol=1e-4, atol=1e-5, msg=key)


def test_loaders_carry_hfs_dataloader_attributes():
    trainer = Trainer(Regression(), arguments(TrainingArguments, tempfile.mkdtemp()), train_dataset=rows(10))
    loader = trainer.get_train_dataloader()
    assert (loader.batch_size, loader.total_batch_size, len(loader)) == (4, 4, 3)
    assert len(loader.dataset) == 10 and trainer.num_examples(loader) == 10
    assert trainer.get_total_train_batch_size(trainer.args) == 4


class TorchLoaderTrainer(Trainer):
    """HF scripts override get_train_dataloader with a torch DataLoader (or any iterable of batches)."""

    def get_train_dataloader(self):
        from conftest import torch_rows

        return torch.utils.data.DataLoader(torch_rows(self.train_dataset), batch_size=4, shuffle=False)


def test_any_iterable_of_batches_from_an_overridden_loader_trains_as_hf():
    data = rows(12)
    torch.manual_seed(0)
    model = Regression()
    ours = TorchLoaderTrainer(
        copy.deepcopy(model), arguments(TrainingArguments, tempfile.mkdtemp(), max_steps=6), train_dataset=data
    )
    ours.train()

    class HFTorchLoader(transformers.Trainer):
        get_train_dataloader = TorchLoaderTrainer.get_train_dataloader

    hf = HFTorchLoader(
        copy.deepcopy(model),
        arguments(transformers.TrainingArguments, tempfile.mkdtemp(), max_steps=6),
        train_dataset=data,
    )
    hf.train()
    losses = [[h["loss"] for h in t.state.log_history if "loss" in h] for t in (hf, ours)]
    np.testing.assert_allclose(losses[1], losses[0], rtol=1e-5)
    assert ours.state.epoch == hf.state.epoch == 2.0

    def generated():
        for i in range(0, 12, 4):
            yield {k: np.stack([r[k] for r in data[i : i + 4]]) for k in data[0]}

    class GeneratorTrainer(Trainer):
        def get_train_dataloader(self):
            return generated()

    one_pass = GeneratorTrainer(
        copy.deepcopy(model), arguments(TrainingArguments, tempfile.mkdtemp(), max_steps=3), train_dataset=data
    )
    one_pass.train()
    assert [h["loss"] for h in one_pass.state.log_history if "loss" in h] == pytest.approx(losses[1][:3], rel=1e-6)


def test_an_overridden_eval_dataloader_evaluates_as_hf():
    """HF repeats each batch's loss eval_batch_size times and, its loader not being accelerate's, keeps them all:
    with a DataLoader of 4 rows a batch (10 rows) and eval_batch_size 8, eval_loss is the batches' plain mean."""
    from conftest import torch_rows

    class EvalLoader(Trainer):
        def get_eval_dataloader(self, eval_dataset=None):
            return torch.utils.data.DataLoader(torch_rows(rows(10, seed=1)), batch_size=4)

    class HFEvalLoader(transformers.Trainer):
        get_eval_dataloader = EvalLoader.get_eval_dataloader

    torch.manual_seed(0)
    model = Regression()
    ours = EvalLoader(copy.deepcopy(model), arguments(TrainingArguments, tempfile.mkdtemp()), train_dataset=rows())
    hf = HFEvalLoader(
        copy.deepcopy(model), arguments(transformers.TrainingArguments, tempfile.mkdtemp()), train_dataset=rows()
    )
    assert ours.evaluate()["eval_loss"] == pytest.approx(hf.evaluate()["eval_loss"], rel=1e-6)
