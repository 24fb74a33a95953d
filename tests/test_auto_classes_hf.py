"""jtrainer.models' auto classes cover every transformers `AutoModel*` class: the native model where jtrainer has
the family, else transformers' own torch model (one info line says so), which the Trainer trains through the
bridge with torch's numbers, so a script that swapped all its imports runs whatever its task."""

import copy
import logging
import re
import sys

import numpy as np
import pytest
import transformers

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from bridge_cases import _bert, _class_rows, assert_same_logs  # noqa: E402
from conftest import tiny_llama_config, torch_rows  # noqa: E402

import jtrainer.models  # noqa: E402


def _transformers_auto_classes() -> list[str]:
    import transformers.models.auto.modeling_auto as modeling_auto

    with open(modeling_auto.__file__) as f:
        return sorted(set(re.findall(r"^class (AutoModel\w*)\(", f.read(), re.MULTILINE)))


def test_every_transformers_auto_class_has_its_namesake():
    names = _transformers_auto_classes()
    assert len(names) > 40 and "AutoModelForQuestionAnswering" in names
    for name in names:
        cls = getattr(jtrainer.models, name)
        assert cls.__name__ == name and hasattr(cls, "from_pretrained") and hasattr(cls, "from_config"), name
    with pytest.raises(AttributeError):
        jtrainer.models.AutoModelForNothing  # noqa: B018


def test_a_native_family_gets_the_native_model_and_another_transformers_own(tmp_path, caplog):
    llama = jtrainer.models.AutoModelForCausalLM.from_config(tiny_llama_config())
    assert type(llama) is jtrainer.models.LlamaForCausalLM

    torch_model = _bert("BertForQuestionAnswering")
    torch_model.save_pretrained(tmp_path / "qa")
    with caplog.at_level(logging.INFO, logger="jtrainer.models.auto"):
        loaded = jtrainer.models.AutoModelForQuestionAnswering.from_pretrained(str(tmp_path / "qa"))
    assert type(loaded) is transformers.BertForQuestionAnswering
    said = [r.getMessage() for r in caplog.records if r.name == "jtrainer.models.auto"]
    assert said == [
        "AutoModelForQuestionAnswering: model_type 'bert' has no native jtrainer QuestionAnswering model: "
        "transformers' own torch model, trained through the torch bridge."
    ]
    want = dict(torch_model.state_dict())
    for name, value in loaded.state_dict().items():
        np.testing.assert_array_equal(value.numpy(), want[name].numpy(), err_msg=name)
    # A family jtrainer has natively, for a task it has no native head for: transformers' own too.
    choice = jtrainer.models.AutoModelForMultipleChoice.from_config(torch_model.config)
    assert type(choice) is transformers.BertForMultipleChoice


def test_a_script_with_every_import_swapped_trains_with_torchs_numbers(tmp_path):
    """run_qa.py's shape of script: the auto class from jtrainer.models, then jtrainer's Trainer, beside
    transformers' own classes on the same folder and rows."""
    import torch

    from jtrainer import Trainer, TrainingArguments

    torch.manual_seed(0)
    _bert("BertForQuestionAnswering").save_pretrained(tmp_path / "qa")

    def positions(rng, n):
        return {"start_positions": np.int64(rng.randint(n)), "end_positions": np.int64(rng.randint(n))}

    rows = _class_rows(16, positions)

    def args(cls, out):
        return cls(
            output_dir=str(out), per_device_train_batch_size=4, max_steps=4, learning_rate=1e-3, logging_steps=1,
            report_to="none", save_strategy="no", seed=0, use_cpu=True,
        )  # fmt: skip

    hf_model = transformers.AutoModelForQuestionAnswering.from_pretrained(tmp_path / "qa")
    hf = transformers.Trainer(model=hf_model, args=args(transformers.TrainingArguments, tmp_path / "hf"),
                              train_dataset=torch_rows(copy.deepcopy(rows)))  # fmt: skip
    hf.train()
    ours_model = jtrainer.models.AutoModelForQuestionAnswering.from_pretrained(str(tmp_path / "qa"))
    ours = Trainer(model=ours_model, args=args(TrainingArguments, tmp_path / "jt"), train_dataset=rows)
    ours.train()
    assert_same_logs(hf, ours, steps=4)
