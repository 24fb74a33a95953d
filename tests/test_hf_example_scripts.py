"""transformers' own run_glue.py (../shared/hf_examples, unmodified) as a client: its `from transformers import`
lines for Trainer, TrainingArguments and AutoModelFor* are pointed at jtrainer by a mechanical rewrite at test
time (nothing else changes), and it runs beside the original under torch on the same tiny local model and data,
offline (a local accuracy metric folder, sequential sampling)."""

import json
import os
import random
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLES = os.environ.get("JTRAINER_HF_EXAMPLES", os.path.join(ROOT, "..", "shared", "hf_examples"))
JTRAINER_NAMES = {"Trainer", "TrainingArguments", "Seq2SeqTrainer", "Seq2SeqTrainingArguments"}

pytestmark = pytest.mark.skipif(not os.path.isdir(EXAMPLES), reason=f"HF's example scripts are not at {EXAMPLES}")

ACCURACY = """
import datasets
import evaluate


class Accuracy(evaluate.Metric):
    def _info(self):
        features = datasets.Features({"predictions": datasets.Value("int32"), "references": datasets.Value("int32")})
        return evaluate.MetricInfo(description="accuracy", citation="", inputs_description="", features=features)

    def _compute(self, predictions, references):
        return {"accuracy": float(sum(int(p == r) for p, r in zip(predictions, references)) / len(references))}
"""


def rewrite_imports(source: str, models: bool = True) -> str:
    """The script with Trainer, TrainingArguments, Seq2Seq* and AutoModelFor* taken from jtrainer instead of
    transformers: those names leave its `from transformers import (...)` block, two import lines follow it.
    `models=False`: only the Trainer names move; the models stay transformers' PyTorch ones (the torch bridge)."""
    out, moved, inside = [], [], False
    for line in source.splitlines():
        if line.startswith("from transformers import ("):
            inside = True
        elif inside and line.strip() == ")":
            inside = False
            out.append(line)
            top = sorted(n for n in moved if n in JTRAINER_NAMES)
            models = sorted(n for n in moved if n.startswith("AutoModelFor"))
            out += [f"from jtrainer import {', '.join(top)}"] if top else []
            out += [f"from jtrainer.models import {', '.join(models)}"] if models else []
            continue
        elif inside and (
            line.strip().rstrip(",") in JTRAINER_NAMES or (models and line.strip().startswith("AutoModelFor"))
        ):
            moved.append(line.strip().rstrip(","))
            continue
        out.append(line)
    return "\n".join(out) + "\n"


@pytest.fixture(scope="module")
def glue(tmp_path_factory):
    """Tiny BERT checkpoints (dropout off, so torch and JAX draw nothing), a tokenizer, 3-class data, a metric."""
    import torch
    import transformers

    folder = tmp_path_factory.mktemp("glue")
    words = [f"w{i}" for i in range(40)]
    (folder / "vocab.txt").write_text("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *words]) + "\n")
    tokenizer = transformers.BertTokenizerFast(vocab_file=str(folder / "vocab.txt"))
    config = dict(
        vocab_size=45,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
        max_position_embeddings=64,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )
    for name, model_class, labels in (
        ("base", transformers.BertForMaskedLM, 2),
        ("three", transformers.BertForSequenceClassification, 3),
        ("two", transformers.BertForSequenceClassification, 2),
    ):
        torch.manual_seed(0)
        model_class(transformers.BertConfig(**config, num_labels=labels)).save_pretrained(folder / name)
        tokenizer.save_pretrained(folder / name)
    rng = random.Random(0)
    for split, n in (("train", 32), ("validation", 16)):
        rows = [
            {"sentence": " ".join(rng.choice(words) for _ in range(rng.randint(3, 10))), "label": rng.randint(0, 2)}
            for _ in range(n)
        ]
        (folder / f"{split}.json").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (folder / "accuracy").mkdir()  # evaluate.load("accuracy") finds ./accuracy/accuracy.py first: offline
    (folder / "accuracy" / "accuracy.py").write_text(ACCURACY)
    source = open(os.path.join(EXAMPLES, "run_glue.py")).read()
    (folder / "run_glue_hf.py").write_text(source)
    (folder / "run_glue_jtrainer.py").write_text(rewrite_imports(source))
    (folder / "run_glue_bridge.py").write_text(rewrite_imports(source, models=False))
    return folder


def _script(folder, script: str, which: str, args: list[str], **env) -> subprocess.CompletedProcess:
    """One run of `script` in `folder`, offline: the original (`which="hf"`, under torch) or its import-rewritten
    copy ("jtrainer")."""
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_EVALUATE_OFFLINE="1", JAX_PLATFORMS="cpu", **env)
    return subprocess.run(
        [sys.executable, f"{script}_{which}.py", *args],
        cwd=folder,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )


def _both(folder, script: str, args: list[str], out: str, **env) -> dict[str, subprocess.CompletedProcess]:
    """The script under torch and under jtrainer, into `{out}_hf` and `{out}_jtrainer`; both must succeed."""
    runs = {}
    for which in ("hf", "jtrainer"):
        runs[which] = _script(folder, script, which, [*args, "--output_dir", f"{out}_{which}"], **env)
        assert runs[which].returncode == 0, runs[which].stderr[-3000:]
    return runs


def _run(folder, which: str, model: str, out: str, *extra):
    args = [
        "--model_name_or_path",
        model,
        "--train_file",
        "train.json",
        "--validation_file",
        "validation.json",
        "--do_train",
        "--do_eval",
        "--max_seq_length",
        "16",
        "--per_device_train_batch_size",
        "4",
        "--per_device_eval_batch_size",
        "4",
        "--max_steps",
        "6",
        "--learning_rate",
        "1e-3",
        "--seed",
        "0",
        "--report_to",
        "none",
        "--train_sampling_strategy",
        "sequential",
        "--logging_steps",
        "1",
        "--output_dir",
        out,
        *extra,
    ]
    return _script(folder, "run_glue", which, args)


def _results(folder, out):
    return json.loads((folder / out / "all_results.json").read_text())


def test_the_import_rewrite_changes_only_imports():
    source = open(os.path.join(EXAMPLES, "run_glue.py")).read()
    before, after = source.splitlines(), rewrite_imports(source).splitlines()
    removed = [line for line in before if line not in after]
    added = [line for line in after if line not in before]
    assert sorted(x.strip() for x in removed) == [
        "AutoModelForSequenceClassification,",
        "Trainer,",
        "TrainingArguments,",
    ]
    assert added == [
        "from jtrainer import Trainer, TrainingArguments",
        "from jtrainer.models import AutoModelForSequenceClassification",
    ]


def test_run_glue_fine_tunes_a_classifier_with_torchs_numbers(glue):
    theirs = _run(glue, "hf", "three", "out_hf")
    assert theirs.returncode == 0, theirs.stderr[-3000:]
    ours = _run(glue, "jtrainer", "three", "out_jt")
    assert ours.returncode == 0, ours.stderr[-3000:]
    expected, got = _results(glue, "out_hf"), _results(glue, "out_jt")
    assert set(got) == set(expected)
    for key in ("train_loss", "eval_loss"):
        assert got[key] == pytest.approx(expected[key], rel=1e-3), key
    assert got["eval_accuracy"] == expected["eval_accuracy"] and got["total_flos"] == expected["total_flos"]


def test_run_glue_with_only_the_trainer_imports_changed_trains_transformers_model(glue):
    """The torch bridge: run_glue.py keeps transformers' AutoModelForSequenceClassification (a PyTorch model),
    jtrainer's Trainer trains it with torch's numbers."""
    source = open(os.path.join(EXAMPLES, "run_glue.py")).read()
    added = [line for line in rewrite_imports(source, models=False).splitlines() if line not in source.splitlines()]
    assert added == ["from jtrainer import Trainer, TrainingArguments"]
    theirs = _run(glue, "hf", "three", "bridge_hf")
    assert theirs.returncode == 0, theirs.stderr[-3000:]
    ours = _run(glue, "bridge", "three", "bridge_jt")
    assert ours.returncode == 0, ours.stderr[-3000:]
    expected, got = _results(glue, "bridge_hf"), _results(glue, "bridge_jt")
    assert set(got) == set(expected)
    for key in ("train_loss", "eval_loss"):
        assert got[key] == pytest.approx(expected[key], rel=1e-5), key
    assert got["eval_accuracy"] == expected["eval_accuracy"] and got["total_flos"] == expected["total_flos"]


def test_run_glue_from_a_masked_lm_base_and_over_a_two_label_checkpoint_as_transformers(glue):
    # A base checkpoint: the classifier and pooler are initialised and reported, training runs. (Their initial
    # values are each framework's own random draw, so the losses are not compared.)
    for which in ("hf", "jtrainer"):
        run = _run(glue, which, "base", f"base_{which}")
        assert run.returncode == 0, run.stderr[-3000:]
    assert "BertForSequenceClassification LOAD REPORT" in run.stderr and "classifier.weight  MISSING" in run.stderr
    assert set(_results(glue, "base_jtrainer")) == set(_results(glue, "base_hf"))
    # Three labels in the data over a two-label checkpoint: transformers' size-mismatch error, then the flag.
    for which in ("hf", "jtrainer"):
        refused = _run(glue, which, "two", f"two_{which}")
        assert refused.returncode != 0 and "ignore_mismatched_sizes" in refused.stderr, (which, refused.stderr[-2000:])
        allowed = _run(glue, which, "two", f"two_{which}_ok", "--ignore_mismatched_sizes")
        assert allowed.returncode == 0, allowed.stderr[-3000:]


@pytest.fixture(scope="module")
def clm(tmp_path_factory, glue):
    """A tiny Llama whose tokenizer (a byte-level BPE of 70 tokens) outgrows its 64 embeddings, and text files."""
    import shutil

    import torch
    import transformers
    from conftest import tiny_llama_config
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    folder = tmp_path_factory.mktemp("clm")
    rng = random.Random(0)
    words = [f"w{i}" for i in range(30)]
    lines = [" ".join(rng.choice(words) for _ in range(rng.randint(5, 15))) for _ in range(200)]
    (folder / "train.txt").write_text("\n".join(lines[:160]) + "\n")
    (folder / "validation.txt").write_text("\n".join(lines[160:]) + "\n")
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer, bpe.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()
    bpe.train_from_iterator(
        lines,
        trainers.BpeTrainer(
            vocab_size=70, special_tokens=["<|endoftext|>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
        ),
    )
    tokenizer = transformers.PreTrainedTokenizerFast(
        tokenizer_object=bpe, eos_token="<|endoftext|>", bos_token="<|endoftext|>"
    )
    assert len(tokenizer) > 64  # run_clm resizes the embeddings
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(tiny_llama_config(bos_token_id=0, eos_token_id=0)).save_pretrained(folder / "model")
    tokenizer.save_pretrained(folder / "model")
    shutil.copytree(glue / "accuracy", folder / "accuracy")
    source = open(os.path.join(EXAMPLES, "run_clm.py")).read()
    (folder / "run_clm_hf.py").write_text(source)
    (folder / "run_clm_jtrainer.py").write_text(rewrite_imports(source))
    (folder / "run_clm_bridge.py").write_text(rewrite_imports(source, models=False))
    return folder


CLM_ARGS = [  # run_clm.py's arguments in both of its tests (plus --output_dir)
    "--model_name_or_path",
    "model",
    "--train_file",
    "train.txt",
    "--validation_file",
    "validation.txt",
    "--do_train",
    "--do_eval",
    "--block_size",
    "16",
    "--per_device_train_batch_size",
    "4",
    "--per_device_eval_batch_size",
    "4",
    "--max_steps",
    "4",
    "--seed",
    "0",
    "--report_to",
    "none",
    "--train_sampling_strategy",
    "sequential",
]


def test_run_clm_fine_tunes_with_resized_embeddings_and_torchs_numbers(clm):
    """run_clm's path: resize_token_embeddings for a larger tokenizer, its torch-style
    preprocess_logits_for_metrics (`logits.argmax(dim=-1)`), perplexity; the same numbers as torch."""
    args = CLM_ARGS
    _both(clm, "run_clm", args, "out")
    expected, got = _results(clm, "out_hf"), _results(clm, "out_jtrainer")
    assert set(got) == set(expected)
    for key in ("train_loss", "eval_loss", "perplexity"):
        assert got[key] == pytest.approx(expected[key], rel=1e-3), key
    assert got["eval_accuracy"] == expected["eval_accuracy"] and got["total_flos"] == expected["total_flos"]


ROUGE = """
import datasets
import evaluate
from rouge_score import rouge_scorer, scoring


class Rouge(evaluate.Metric):
    def _info(self):
        features = datasets.Features({"predictions": datasets.Value("string"), "references": datasets.Value("string")})
        return evaluate.MetricInfo(description="rouge", citation="", inputs_description="", features=features)

    def _compute(self, predictions, references, use_stemmer=False):
        scorer = rouge_scorer.RougeScorer(["rouge1", "rouge2", "rougeL", "rougeLsum"], use_stemmer=use_stemmer)
        aggregator = scoring.BootstrapAggregator()
        for reference, prediction in zip(references, predictions):
            aggregator.add_scores(scorer.score(reference, prediction))
        return {key: value.mid.fmeasure for key, value in aggregator.aggregate().items()}
"""


def test_run_summarization_trains_and_generates_with_torchs_numbers(tmp_path):
    """Seq2SeqTrainer with predict_with_generate on a tiny T5, offline (nltk's punkt data as empty parameter
    files, a local rouge metric on rouge_score): the same losses, generated lengths, ROUGE and keys as torch."""
    import torch
    import transformers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    rng = random.Random(0)
    words = [f"w{i}" for i in range(30)]

    def sentence():
        return " ".join(rng.choice(words) for _ in range(rng.randint(6, 14))) + "."

    rows = [{"text": f"{sentence()} {sentence()}", "summary": sentence()} for _ in range(40)]
    for split, part in (("train", rows[:32]), ("validation", rows[32:])):
        (tmp_path / f"{split}.json").write_text("".join(json.dumps(r) + "\n" for r in part))
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer, bpe.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()
    bpe.train_from_iterator(
        [r["text"] + " " + r["summary"] for r in rows],
        trainers.BpeTrainer(
            vocab_size=64,
            special_tokens=["<pad>", "</s>", "<unk>"],
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        ),
    )
    tokenizer = transformers.PreTrainedTokenizerFast(
        tokenizer_object=bpe, pad_token="<pad>", eos_token="</s>", unk_token="<unk>"
    )
    config = transformers.T5Config(
        vocab_size=64,
        d_model=32,
        d_kv=8,
        d_ff=64,
        num_layers=2,
        num_heads=4,
        feed_forward_proj="gated-gelu",
        tie_word_embeddings=False,
        dropout_rate=0.0,
        decoder_start_token_id=0,
        pad_token_id=0,
        eos_token_id=1,
    )
    torch.manual_seed(0)
    transformers.T5ForConditionalGeneration(config).save_pretrained(tmp_path / "model")
    tokenizer.save_pretrained(tmp_path / "model")
    punkt = tmp_path / "nltk_data" / "tokenizers"
    (punkt / "punkt").mkdir(parents=True)
    (punkt / "punkt_tab" / "english").mkdir(parents=True)
    for name in ("collocations.tab", "sent_starters.txt", "abbrev_types.txt", "ortho_context.tab"):
        (punkt / "punkt_tab" / "english" / name).write_text("")
    (tmp_path / "rouge").mkdir()
    (tmp_path / "rouge" / "rouge.py").write_text(ROUGE)
    source = open(os.path.join(EXAMPLES, "run_summarization.py")).read()
    (tmp_path / "run_summarization_hf.py").write_text(source)
    (tmp_path / "run_summarization_jtrainer.py").write_text(rewrite_imports(source))
    (tmp_path / "run_summarization_bridge.py").write_text(rewrite_imports(source, models=False))
    args = [
        "--model_name_or_path",
        "model",
        "--train_file",
        "train.json",
        "--validation_file",
        "validation.json",
        "--text_column",
        "text",
        "--summary_column",
        "summary",
        "--do_train",
        "--do_eval",
        "--predict_with_generate",
        "--max_source_length",
        "32",
        "--max_target_length",
        "12",
        "--per_device_train_batch_size",
        "4",
        "--per_device_eval_batch_size",
        "4",
        "--max_steps",
        "4",
        "--seed",
        "0",
        "--report_to",
        "none",
        "--train_sampling_strategy",
        "sequential",
        "--learning_rate",
        "1e-3",
    ]
    nltk = dict(NLTK_DATA=str(tmp_path / "nltk_data"))
    _both(tmp_path, "run_summarization", args, "out", **nltk)
    expected, got = _results(tmp_path, "out_hf"), _results(tmp_path, "out_jtrainer")
    assert set(got) == set(expected)
    for key in ("train_loss", "eval_loss"):
        assert got[key] == pytest.approx(expected[key], rel=1e-3), key
    for key in ("eval_gen_len", "eval_rouge1", "eval_rougeL", "total_flos"):
        assert got[key] == expected[key], key
    # The torch bridge: only the Trainer imports changed, transformers' T5 trained by jtrainer's step and
    # generating with transformers' generate.
    bridge = _script(tmp_path, "run_summarization", "bridge", [*args, "--output_dir", "out_bridge"], **nltk)
    assert bridge.returncode == 0, bridge.stderr[-3000:]
    got = _results(tmp_path, "out_bridge")
    assert set(got) == set(expected)
    for key in ("train_loss", "eval_loss"):
        assert got[key] == pytest.approx(expected[key], rel=1e-5), key
    for key in ("eval_gen_len", "eval_rouge1", "eval_rougeL", "total_flos"):
        assert got[key] == expected[key], key


def test_run_clm_with_only_the_trainer_imports_changed_trains_transformers_model(clm):
    """The torch bridge on run_clm.py: transformers' LlamaForCausalLM, resized embeddings, its torch-style
    preprocess_logits_for_metrics (in the step through torchax), perplexity; torch's numbers."""
    args = CLM_ARGS
    for which in ("hf", "bridge"):
        run = _script(clm, "run_clm", which, [*args, "--output_dir", f"bridge_{which}"])
        assert run.returncode == 0, run.stderr[-3000:]
    expected, got = _results(clm, "bridge_hf"), _results(clm, "bridge_bridge")
    assert set(got) == set(expected)
    for key in ("train_loss", "eval_loss", "perplexity"):
        assert got[key] == pytest.approx(expected[key], rel=1e-5), key
    assert got["eval_accuracy"] == expected["eval_accuracy"] and got["total_flos"] == expected["total_flos"]


def test_run_clm_from_scratch_counts_parameters_as_torch(clm):
    """run_clm's from-scratch branch (--config_name, no model): from_config, and its torch-style parameter count
    `sum({p.data_ptr(): p.numel() ...})` logged through the script's own logging format. (Each framework draws
    its own initial weights, so the losses are not compared.)"""
    args = [
        "--config_name",
        "model",
        "--tokenizer_name",
        "model",
        "--train_file",
        "train.txt",
        "--validation_file",
        "validation.txt",
        "--do_train",
        "--do_eval",
        "--block_size",
        "16",
        "--per_device_train_batch_size",
        "4",
        "--per_device_eval_batch_size",
        "4",
        "--max_steps",
        "2",
        "--seed",
        "0",
        "--report_to",
        "none",
    ]
    said = {
        which: [
            line.split(" - ", 3)[-1]
            for line in (run.stdout + run.stderr).splitlines()
            if "Training new model from scratch" in line
        ]
        for which, run in _both(clm, "run_clm", args, "scratch").items()
    }
    assert said["jtrainer"] == said["hf"] and len(said["hf"]) == 1
    assert set(_results(clm, "scratch_jtrainer")) == set(_results(clm, "scratch_hf"))
