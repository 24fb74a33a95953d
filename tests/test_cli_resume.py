"""`jtrainer train` run again continues from the last committed checkpoint in output_dir (a preempted job is
re-run as it was); `--resume_from_checkpoint PATH` resumes from PATH; `--overwrite_output_dir` starts afresh; an
output_dir with other files and no checkpoint is refused before any work."""

import json
import os
import re

from jtrainer.cli import main


def _job(tmp_path, out, *extra):
    text = tmp_path / "text"
    if not text.exists():
        text.mkdir()
        for i in range(6):
            (text / f"f{i}.txt").write_text(" ".join(f"word{(i * 7 + j) % 40} value{j % 9}" for j in range(300)))
    return main(
        [
            "train",
            "--text_dir",
            str(text),
            "--max_chars",
            "100000",
            "--hidden_size",
            "32",
            "--intermediate_size",
            "64",
            "--num_hidden_layers",
            "1",
            "--block_size",
            "32",
            "--tokenizer_vocab_size",
            "300",
            "--per_device_train_batch_size",
            "4",
            "--logging_steps",
            "1",
            "--save_steps",
            "2",
            "--save_total_limit",
            "0",
            "--warmup_steps",
            "0",
            "--sample_tokens",
            "2",
            "--disable_tqdm",
            "true",
            "--output_dir",
            str(out),
            *extra,
        ]
    )


def _history(folder):
    with open(os.path.join(folder, "trainer_state.json")) as f:
        return {h["step"]: h["loss"] for h in json.load(f)["log_history"] if "loss" in h}


def test_rerun_continues_resume_from_a_path_and_overwrite(tmp_path, capsys):
    out = tmp_path / "run"
    assert _job(tmp_path, out, "--max_steps", "4") == 0
    first = _history(out / "checkpoint-4")
    assert sorted(first) == [1, 2, 3, 4]

    _job(tmp_path, out, "--max_steps", "6")  # the same command, a longer run: continues
    assert f"resuming from {out / 'checkpoint-4'}" in capsys.readouterr().out
    continued = _history(out / "checkpoint-6")
    assert sorted(continued) == [1, 2, 3, 4, 5, 6]
    assert {s: continued[s] for s in first} == first  # the first run's steps are kept as they were

    other = tmp_path / "other"
    _job(tmp_path, other, "--max_steps", "4", "--resume_from_checkpoint", str(out / "checkpoint-2"))
    resumed = _history(other / "checkpoint-4")
    assert sorted(resumed) == [1, 2, 3, 4]
    assert resumed[3] == first[3]  # exact: the same weights and batch at step 3
    capsys.readouterr()
    wider = ("--max_steps", "4", "--hidden_size", "48", "--resume_from_checkpoint", str(out / "checkpoint-2"))
    assert _job(tmp_path, tmp_path / "wider", *wider) == 1  # another model's checkpoint: one line, no traceback
    err = capsys.readouterr().err
    assert err.strip().splitlines()[-1].startswith("jtrainer train: Checkpoint ") and "has shape" in err, err
    assert "Traceback" not in err

    _job(tmp_path, out, "--max_steps", "2", "--overwrite_output_dir", "true")
    assert "removed 3 checkpoint(s) of an earlier run" in capsys.readouterr().out
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-2"]
    assert sorted(_history(out / "checkpoint-2")) == [1, 2]


def test_refused_before_any_work(tmp_path, capsys):
    used = tmp_path / "used"
    used.mkdir()
    (used / "notes.txt").write_text("mine")
    assert _job(tmp_path, used, "--max_steps", "2") == 1
    assert re.search(
        r"output_dir .*used' is not empty \(notes.txt\) .* --overwrite_output_dir", capsys.readouterr().err
    )
    assert sorted(os.listdir(used)) == ["notes.txt"]
    assert (
        _job(tmp_path, tmp_path / "fresh", "--max_steps", "2", "--resume_from_checkpoint", str(tmp_path / "nowhere"))
        == 1
    )
    assert re.search(r"--resume_from_checkpoint .*nowhere.* does not exist", capsys.readouterr().err)
    (tmp_path / "a_file").write_text("x")
    (tmp_path / "empty").mkdir()
    for path, what in ((tmp_path / "a_file", "is a file"), (tmp_path / "empty", "is an empty folder")):
        assert _job(tmp_path, tmp_path / "fresh", "--max_steps", "2", "--resume_from_checkpoint", str(path)) == 1
        err = capsys.readouterr().err
        assert what in err and len(err.strip().splitlines()) == 1, err
    assert _job(tmp_path, tmp_path / "fresh", "--resume_from_checkpoint", "x", "--overwrite_output_dir", "true") == 1
    assert "contradict" in capsys.readouterr().err
    assert not (tmp_path / "fresh").exists()
