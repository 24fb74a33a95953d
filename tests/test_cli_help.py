"""What `jtrainer --help`, `jtrainer train|check --help` and `--help-all` print: a page a person reads, HF's full
list behind --help-all with each TrainingArguments field marked as `jtrainer check` reports it."""

import dataclasses
import re

import pytest

from jtrainer.cli import help_pages, main


def _printed(capsys, argv) -> list[str]:
    try:
        code = main(argv)
    except SystemExit as e:  # argparse's way out of a help page
        code = e.code
    assert code == 0
    return capsys.readouterr().out.splitlines()


def test_the_command_help_says_what_each_command_does(capsys):
    lines = _printed(capsys, ["--help"])
    text = "\n".join(lines)
    assert lines[0].startswith("usage: jtrainer {train,check,launch}")
    for command in ("train", "check", "launch"):
        assert re.search(rf"^  {command} +\S", text, re.MULTILINE), command
    assert "processes" in text and "multi-host" in text  # what launch does


@pytest.mark.parametrize("command", ["train", "check"])
def test_a_command_help_is_one_short_grouped_page(capsys, command):
    lines = _printed(capsys, [command, "--help"])
    assert lines[0] == f"usage: jtrainer {command} [CONFIG.yaml] [--field value ...]"
    assert len(lines) < 60
    for group in ("model:", "data:", "checkpoints:", "mesh and memory:"):
        assert group in lines
    assert all(len(line) <= help_pages.WIDTH for line in lines)
    flags = {line.split()[0] for line in lines if line.startswith("  --")}
    assert {"--model_name_or_path", "--learning_rate", "--per_device_train_batch_size", "--mesh_shape"} <= flags
    assert ("--target" in flags) == (command == "check")  # check's own flags only under check
    assert "  --learning_rate                [5e-05]" in lines  # the field's default


def test_every_field_on_the_short_page_is_a_field():
    from jtrainer import Seq2SeqTrainingArguments
    from jtrainer.cli.config import RunArguments
    from jtrainer.cli.tasks import DataArguments, ModelArguments

    fields = {
        f.name
        for cls in (ModelArguments, DataArguments, Seq2SeqTrainingArguments, RunArguments)
        for f in dataclasses.fields(cls)
    }
    listed = [name for _, group in (*help_pages.SHORT_FIELDS, help_pages.CHECK_FIELDS) for name, _ in group]
    assert set(listed) <= fields, set(listed) - fields


def _flag_help(lines: list[str], flag: str) -> str:
    """The help text of one flag in argparse's layout (the flag's line, then its indented help lines)."""
    start = next(i for i, line in enumerate(lines) if re.match(rf"\s+{flag}( |$)", line))
    body = [lines[start]]
    for line in lines[start + 1 :]:
        if line.startswith("  --") or not line.startswith(" "):
            break
        body.append(line)
    return " ".join(" ".join(body).split())


def test_help_all_marks_each_training_field(capsys):
    lines = _printed(capsys, ["train", "--help-all"])
    assert lines[0] == "usage: jtrainer train [CONFIG.yaml] [--field value ...]"
    assert "[ignored: there is no DeepSpeed" in _flag_help(lines, "--deepspeed")
    assert "[ignored: collectives are XLA's]" in _flag_help(lines, "--ddp_backend")
    assert "[emulated: the step is always compiled by XLA]" in _flag_help(lines, "--torch_compile")
    assert "[honoured]" in _flag_help(lines, "--learning_rate")
    assert "[jtrainer]" in _flag_help(lines, "--mesh_shape")
    assert not any(re.match(r"\s+--target ", line) for line in lines)
    check = _printed(capsys, ["check", "--help-all"])
    assert any(re.match(r"\s+--target ", line) for line in check)
