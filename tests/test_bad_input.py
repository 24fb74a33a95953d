"""Bad input is refused before any work: each case of `jtrainer train` returns exit code 1 within seconds, with one
line naming the field or file and the fix, and writes nothing to output_dir."""

import json
import os
import subprocess
import sys
import time

import numpy as np
import pytest

from jtrainer.cli import main

SMALL = [
    "--hidden_size",
    "32",
    "--intermediate_size",
    "64",
    "--num_hidden_layers",
    "1",
    "--num_attention_heads",
    "2",
    "--num_key_value_heads",
    "1",
    "--block_size",
    "16",
    "--tokenizer_vocab_size",
    "300",
    "--max_steps",
    "2",
    "--max_chars",
    "20000",
    "--disable_tqdm",
    "true",
]


def _text_dir(root, files=4):
    folder = root / f"text{files}"
    folder.mkdir(exist_ok=True)
    for i in range(files):
        (folder / f"f{i}.txt").write_text(" ".join(f"w{(i + j) % 30}" for j in range(400)))
    return str(folder)


def _model_dir(root, damage):
    from conftest import tiny_llama_config
    from safetensors.numpy import load_file, save_file

    from jtrainer.cli.tasks import train_tokenizer
    from jtrainer.models.llama import LlamaForCausalLM

    folder = root / "model"
    if damage == "empty":
        folder.mkdir()
        return str(folder)
    LlamaForCausalLM.from_config(tiny_llama_config()).save_pretrained(str(folder))
    train_tokenizer(["some words to learn from"], 300).save_pretrained(str(folder))
    weights = folder / "model.safetensors"
    config = folder / "config.json"
    if damage == "not_json":
        config.write_text(config.read_text()[:40])
    elif damage == "custom_code":
        config.write_text(json.dumps({**json.loads(config.read_text()), "auto_map": {"AutoModel": "x.X"}}))
    elif damage == "other_family":
        config.write_text(json.dumps({**json.loads(config.read_text()), "model_type": "mixtral"}))
    elif damage == "no_weights":
        weights.unlink()
    elif damage == "no_tokenizer":
        for name in ("tokenizer.json", "tokenizer_config.json"):
            (folder / name).unlink()
    elif damage == "truncated":
        with open(weights, "r+b") as f:
            f.truncate(weights.stat().st_size // 2)
    else:
        tensors = load_file(str(weights))
        name = next(n for n in tensors if n.endswith("q_proj.weight"))
        tensors[name] = tensors[name].astype(np.int32)
        save_file(tensors, str(weights))
    return str(folder)


# name: (config file text or None, extra arguments, expected in the message); {tmp} is the test's folder
CASES = {
    "config_is_a_list": ("- learning_rate\n- 0.1\n", [], "must be a mapping of field: value, not a list"),
    "config_is_a_string": ("just some words\n", [], "must be a mapping of field: value, not a str"),
    "config_repeats_a_key": (
        "learning_rate: 0.1\nseed: 1\nlearning_rate: 0.2\n",
        [],
        "duplicate key 'learning_rate' (lines 1 and 3)",
    ),
    "config_not_yaml": ("learning_rate: [0.1\n", [], "is not valid YAML at line"),
    "config_unknown_field": ("lerning_rate: 0.1\n", [], "unknown field(s) ['lerning_rate']"),
    "config_missing": (None, ["{tmp}/missing.yaml"], "config file '{tmp}/missing.yaml' not found"),
    "batch_size_not_int": ("per_device_train_batch_size: 8.5\n", [], "per_device_train_batch_size: 8.5 is not a valid"),
    "learning_rate_a_list": ("learning_rate: [0.1]\n", [], "learning_rate: [0.1] is not a valid value"),
    "learning_rate_negative": ("learning_rate: -1\n", [], "Invalid learning rate: -1"),
    "nothing_to_train": (None, ["--max_steps", "0", "--num_train_epochs", "0"], "nothing would be trained"),
    "output_dir_a_file": (None, ["--output_dir", "{tmp}/a_file"], "is a file, not a folder"),
    "output_dir_unwritable": (None, ["--output_dir", "{tmp}/a_file/run"], "is not writable"),
    "block_size_over_positions": (
        None,
        ["--block_size", "4096", "--max_position_embeddings", "64"],
        "block_size=4096 exceeds the model's 64 positions (--max_position_embeddings)",
    ),
    "block_size_over_data": (
        None,
        ["--block_size", "50000", "--max_position_embeddings", "65536"],
        "block_size=50000: the training text is",
    ),
    "eval_fraction_all": (None, ["--eval_fraction", "1.0"], "eval_fraction=1.0"),
    "text_dir_one_file": (None, ["--text_dir", "TEXT1"], "holds out whole files"),
    "text_dir_missing": (None, ["--text_dir", "{tmp}/nowhere"], "text_dir='{tmp}/nowhere' is not a folder"),
    "train_file_empty": (None, ["--train_file", "{tmp}/empty.jsonl"], "train_file='{tmp}/empty.jsonl' is empty"),
    "train_file_missing": (None, ["--train_file", "{tmp}/none.jsonl"], "train_file='{tmp}/none.jsonl' not found"),
    "labels_not_finite": (
        None,
        [
            "--task",
            "sequence_classification",
            "--model_type",
            "bert",
            "--train_file",
            "{tmp}/labels.csv",
            "--eval_fraction",
            "0.25",
        ],
        "split has None, not a class id",
    ),
    "weights_truncated": (None, ["--model_name_or_path", "MODEL:truncated"], "model.safetensors is not a readable"),
    "model_folder_empty": (None, ["--model_name_or_path", "MODEL:empty"], "has no config.json"),
    "model_config_not_json": (None, ["--model_name_or_path", "MODEL:not_json"], "config.json is not valid JSON"),
    "model_custom_code": (None, ["--model_name_or_path", "MODEL:custom_code"], "names custom code (auto_map)"),
    "model_of_another_family": (
        None,
        ["--model_name_or_path", "MODEL:other_family"],
        "is a 'mixtral' model, which jtrainer has no native causal_lm model for: set bridge: true",
    ),
    "remat_policy_unknown": (
        None,
        ["--activation_checkpointing", "true", "--activation_checkpointing_kwargs", '{"policy": "keep_some"}'],
        "policy='keep_some' is neither one of",
    ),
    "best_metric_never_reported": (
        None,
        ["--metric_for_best_model", "rouge1", "--load_best_model_at_end", "true", "--eval_strategy", "steps"],
        "metric_for_best_model='rouge1': the causal_lm job's evaluation reports eval_loss; name one of those.",
    ),
    "lora_target_the_model_lacks": (
        None,
        ["--bridge", "true", "--use_peft", "true", "--lora_target_modules", "qkv_proj"],
        "lora_target_modules=['qkv_proj']: Target modules {'qkv_proj'} not found in the base model.",
    ),
    "experts_fewer_than_top_k": (
        None,
        [
            "--bridge",
            "true",
            "--model_type",
            "mixtral",
            "--config_overrides",
            "num_local_experts=2,num_experts_per_tok=4",
        ],
        "num_experts_per_tok=4 exceeds the 2 experts (config_overrides)",
    ),
    "model_without_weights": (None, ["--model_name_or_path", "MODEL:no_weights"], "has no model.safetensors"),
    "model_without_tokenizer": (None, ["--model_name_or_path", "MODEL:no_tokenizer"], "holds no tokenizer"),
    "learning_rate_nan": ("learning_rate: .nan\n", [], "--learning_rate must be a finite number, got nan"),
    "learning_rate_inf": ("learning_rate: .inf\n", [], "--learning_rate must be a finite number, got inf"),
    "weight_decay_nan": ("weight_decay: .nan\n", [], "--weight_decay must be a finite number, got nan"),
    "epochs_inf": (None, ["--max_steps", "-1", "--num_train_epochs", "inf"], "--num_train_epochs must be a finite"),
    "seed_too_large": (None, ["--seed", str(10**23)], "--seed must be a whole number in [0, 2**32 - 1]"),
    "heads_zero": (None, ["--num_attention_heads", "0"], "num_attention_heads=0: it must be at least 1"),
    "width_zero": (None, ["--hidden_size", "0"], "hidden_size=0: it must be at least 1"),
    "layers_zero": (None, ["--num_hidden_layers", "0"], "num_hidden_layers=0: it must be at least 1"),
    "positions_zero": (None, ["--max_position_embeddings", "0"], "max_position_embeddings=0: it must be at least 1"),
    "kv_heads_not_dividing": (
        None,
        ["--num_attention_heads", "4", "--num_key_value_heads", "3"],
        "num_key_value_heads=3 does not divide num_attention_heads=4",
    ),
    "weight_decay_negative": (None, ["--weight_decay", "-1"], "Invalid weight_decay value: -1.0"),
    "beta_over_one": (None, ["--adam_beta1", "1.5"], "Invalid beta parameter at index 0: 1.5"),
    "epsilon_negative": (None, ["--adam_epsilon", "-1"], "Invalid epsilon value: -1.0"),
    "sample_tokens_negative": (None, ["--sample_tokens", "-5"], "sample_tokens=-5: it must be at least 0"),
    "mesh_over_devices": ("mesh_shape: '{\"data\": 64}'\n", [], "needs 64 devices but there are"),
    "keys_of_mixed_types": ("1: 2\nfoo: 3\n", [], "unknown field(s) [1, 'foo']"),
    "label_names_nested": ("label_names: [[a]]\n", [], "label_names: [['a']] is not a valid value"),
    "train_file_not_utf8": (None, ["--train_file", "{tmp}/latin1.jsonl"], "line 2 is not UTF-8"),
    "train_file_null_row": (None, ["--train_file", "{tmp}/nulls.jsonl"], "row 3 of column 'text' is None, not text"),
    "train_file_numbers": (None, ["--train_file", "{tmp}/numbers.jsonl"], "row 0 of column 'text' is 0, not text"),
    "weights_integer": (None, ["--model_name_or_path", "MODEL:integer"], "is stored as integers"),
}


@pytest.mark.parametrize("case", CASES)
def test_bad_input_is_refused_before_any_work(tmp_path, capsys, case):
    text, extra, expected = CASES[case]
    tmp = str(tmp_path)
    (tmp_path / "a_file").write_text("keep me")
    (tmp_path / "empty.jsonl").write_text("\n")
    rows = [json.dumps({"text": f"w{i} w{i + 1}"}) for i in range(8)]
    (tmp_path / "latin1.jsonl").write_bytes("\n".join([rows[0], '{"text": "caf\xe9"}', *rows[1:]]).encode("latin-1"))
    (tmp_path / "nulls.jsonl").write_text("\n".join([*rows[:3], json.dumps({"text": None}), *rows[3:]]))
    (tmp_path / "numbers.jsonl").write_text("\n".join(json.dumps({"text": i}) for i in range(8)))
    (tmp_path / "labels.csv").write_text(
        "text,label\n" + "".join(f"w{i} w{i + 1},{'nan' if i == 1 else i % 2}\n" for i in range(8))
    )
    extra = [a.replace("{tmp}", tmp) for a in extra]
    extra = [_text_dir(tmp_path, 1) if a == "TEXT1" else a for a in extra]
    extra = [_model_dir(tmp_path, a.split(":")[1]) if a.startswith("MODEL:") else a for a in extra]
    argv = ["train"]
    if text is not None:
        (tmp_path / "config.yaml").write_text(text)
        argv.append(str(tmp_path / "config.yaml"))
    elif extra and extra[0].endswith(".yaml"):
        argv.append(extra.pop(0))
    if "--text_dir" not in extra:
        extra += ["--text_dir", _text_dir(tmp_path)]
    if "--output_dir" not in extra:
        extra += ["--output_dir", tmp + "/out"]
    capsys.readouterr()
    started = time.monotonic()
    assert main(argv + SMALL + extra) == 1
    assert time.monotonic() - started < 20
    output = capsys.readouterr()
    err = output.err.strip().splitlines()[-1]  # (after any progress bar of `datasets`)
    assert err.startswith("jtrainer train: ") and expected.replace("{tmp}", tmp) in err, err
    assert "Traceback" not in output.err + output.out
    assert (output.err + output.out).count("jtrainer train: ") == 1
    assert not os.path.exists(tmp + "/out")  # nothing written
    assert (tmp_path / "a_file").read_text() == "keep me"


def test_the_process_exits_with_code_1(tmp_path):
    (tmp_path / "config.yaml").write_text("seed: 1\nseed: 2\n")
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "jtrainer.cli",
            "train",
            str(tmp_path / "config.yaml"),
            "--output_dir",
            str(tmp_path / "out"),
        ],
        capture_output=True,
        text=True,
        timeout=120,
        env=dict(os.environ, JAX_PLATFORMS="cpu"),
    )
    assert done.returncode == 1
    assert done.stderr.strip().splitlines()[-1].startswith("jtrainer train: config file")
    assert "duplicate key 'seed'" in done.stderr and not (tmp_path / "out").exists()


def test_max_chars_is_exact(tmp_path):
    from jtrainer.cli.tasks import read_text_files

    texts = read_text_files(_text_dir(tmp_path), 3000)
    assert sum(map(len, texts)) == 3000
    assert json.dumps(texts)  # plain strings


@pytest.mark.parametrize("bad", [{"weight_decay": -1.0}, {"betas": (1.5, 0.999)}, {"eps": -1.0}])
def test_torch_refuses_those_optimizer_values_too(bad):
    torch = pytest.importorskip("torch")
    with pytest.raises(ValueError, match="Invalid"):
        torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], **bad)


def test_a_bad_flag_is_one_line_without_the_usage(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["train", "--eval_fraction", "half", "--output_dir", str(tmp_path / "out")])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("jtrainer train: error: argument --eval_fraction"), err


@pytest.mark.parametrize(
    "extra, expected",
    [
        (["--block_size", "0"], "block_size=0: it must be at least 1"),
        (["--mesh_shape", '{"data": 64}'], "needs 64 devices but there are"),
        (["--num_attention_heads", "0"], "num_attention_heads=0: it must be at least 1"),
        (["--model_name_or_path", "MODEL:other_family"], "is a 'mixtral' model, which jtrainer has no native"),
        (
            ["--target", "v5litepod-16", "--mesh_shape", '{"fsdp": 8, "sequence": 2}', "--block_size", "15"],
            "block_size=15 cannot be split over the 2-way `sequence` mesh axis",
        ),
        (["--activation_checkpointing", "true", "--activation_checkpointing_kwargs", '{"policy": "x"}'], "policy='x'"),
        (
            [
                "--bridge",
                "true",
                "--activation_checkpointing",
                "true",
                "--activation_checkpointing_kwargs",
                '{"policy": "save_dots_except_mlp"}',
            ],
            "this model names none",
        ),
        (["JTRAINER_ATTENTION=bogus"], "JTRAINER_ATTENTION='bogus' is not one of"),
    ],
    ids=["block_size", "mesh", "heads", "other_family", "sequence_axis", "remat_policy", "bridge_remat", "attention"],
)
def test_jtrainer_check_refuses_the_same_in_one_line(tmp_path, capsys, monkeypatch, extra, expected):
    extra = list(extra)
    for setting in [a for a in extra if a.startswith("JTRAINER_")]:  # an environment setting
        monkeypatch.setenv(*setting.split("=", 1))
        extra.remove(setting)
    extra = [_model_dir(tmp_path, a.split(":")[1]) if a.startswith("MODEL:") else a for a in extra]
    capsys.readouterr()
    assert main(["check", *SMALL, "--output_dir", str(tmp_path / "out"), *extra]) == 1
    output = capsys.readouterr()
    said = [line for line in output.err.splitlines() if line.startswith("jtrainer check: ")]
    assert len(said) == 1 and expected in said[0], output.err[-3000:]
    assert "Traceback" not in output.err + output.out
