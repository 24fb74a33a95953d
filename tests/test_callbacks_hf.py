"""Stateful callbacks (`ExportableState`, `restore_callback_states_from_checkpoint`) beside transformers.Trainer:
the same callbacks saved in a checkpoint and restored on resume give the same trainer_state.json entries, the same
callback list (rebuilt ones re-added at the end, per instance) and HF's warning for a saved class not passed."""

import copy
import importlib.util
import json
import logging
import os

import pytest

torch = pytest.importorskip("torch")
if importlib.util.find_spec("torchax") is None:
    pytest.skip("torchax is not installed", allow_module_level=True)
transformers = pytest.importorskip("transformers")

from bridge_zoo import Regression, arguments, rows  # noqa: E402
from conftest import torch_rows  # noqa: E402
from transformers.trainer_callback import ExportableState  # noqa: E402

from jtrainer import Trainer, TrainerCallback, TrainingArguments  # noqa: E402


class Counting(TrainerCallback, ExportableState):
    """Its constructor argument and an attribute that changes every step are its saved state."""

    def __init__(self, label="first", steps_seen=0):
        self.label = label
        self.steps_seen = steps_seen

    def on_step_end(self, args, state, control, **kwargs):
        self.steps_seen += 1

    def state(self) -> dict:
        return {"args": {"label": self.label}, "attributes": {"steps_seen": self.steps_seen}}


class SavedOnly(Counting):
    """Passed when saving only: the resume names it in HF's warning."""


def _run(trainer_cls, args_cls, out, callbacks, data, **over):
    args = arguments(args_cls, out, max_steps=2, save_strategy="steps", save_steps=2, **over)
    return trainer_cls(model=copy.deepcopy(MODEL), args=args, train_dataset=data, callbacks=callbacks)


torch.manual_seed(0)
MODEL = Regression()


def _described(trainer):
    """The callback list as names with each stateful one's state."""
    return [
        (type(cb).__name__, cb.state() if isinstance(cb, ExportableState) else None)
        for cb in trainer.callback_handler.callbacks
    ]


@pytest.mark.parametrize("restore", [True, False])
def test_stateful_callbacks_are_saved_and_restored_as_hf(tmp_path, caplog, restore):
    results = {}
    for name, trainer_cls, args_cls, data in (
        ("hf", transformers.Trainer, transformers.TrainingArguments, torch_rows(rows())),
        ("ours", Trainer, TrainingArguments, rows()),
    ):
        out = tmp_path / name
        first = _run(trainer_cls, args_cls, out, [Counting("first"), Counting("second"), SavedOnly("x")], data)
        first.train()
        saved = json.loads((out / "checkpoint-2" / "trainer_state.json").read_text())["stateful_callbacks"]
        resumed = _run(
            trainer_cls,
            args_cls,
            out,
            [Counting("other"), Counting("another")],
            data,
            restore_callback_states_from_checkpoint=restore,
        )
        caplog.clear()
        with caplog.at_level(logging.INFO):
            resumed.train(resume_from_checkpoint=str(out / "checkpoint-2"))
        warned = [r.getMessage() for r in caplog.records if "not included in current configuration" in r.getMessage()]
        results[name] = saved, _described(resumed), warned
    assert results["ours"][0] == results["hf"][0]
    assert results["ours"][0]["Counting"] == [
        {"args": {"label": "first"}, "attributes": {"steps_seen": 0}},
        {"args": {"label": "second"}, "attributes": {"steps_seen": 0}},
        {"args": {"label": "first"}, "attributes": {"steps_seen": 2}},
        {"args": {"label": "second"}, "attributes": {"steps_seen": 2}},
    ]  # HF's lists grow at each save; the restore reads the first entries (an instance each)
    assert results["ours"][1] == results["hf"][1]
    assert (
        results["ours"][2]
        == results["hf"][2]
        == (
            ["Checkpoint included callbacks not included in current configuration. Ignoring. (SavedOnly)"]
            if restore
            else []
        )
    )
    labels = [state["args"]["label"] for name, state in results["ours"][1] if name == "Counting"]
    assert labels == (["first", "second"] if restore else ["other", "another"])
    assert os.path.isdir(tmp_path / "ours" / "checkpoint-2")
