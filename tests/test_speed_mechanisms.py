"""What the loop does for speed, checked for correctness (speed itself is measured by benchmarks/): packing,
length buckets, no device reads between logs, throughput logs, the persistent compilation cache."""

import os
import subprocess
import sys
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import count_compiles, short_run_args, tiny_llama_config, token_rows
from flax import nnx

import jtrainer.trainer.trainer
from jtrainer import Trainer, TrainingArguments
from jtrainer.models.llama import LlamaForCausalLM
from jtrainer.models.packing import pack_sequences, packing_efficiency
from jtrainer.numerics.losses import shift_labels, token_cross_entropy_sum
from jtrainer.sizing import throughput


def _args(**over):
    """conftest's short run, four steps."""
    return short_run_args(**{"max_steps": 4, **over})


def test_packed_rows_compute_what_documents_compute_alone():
    model = LlamaForCausalLM.from_config(tiny_llama_config())
    rng = np.random.RandomState(0)
    docs = [rng.randint(1, 64, n).tolist() for n in (5, 7, 3, 9, 12)]
    rows = pack_sequences(docs, block_size=16)
    assert len(rows) == 3 and packing_efficiency(rows) == pytest.approx(36 / 48)
    forward = nnx.jit(lambda m, batch: m(**batch))
    packed_sum, alone_sum = 0.0, 0.0
    for row in rows:
        batch = {k: jnp.asarray(v)[None] for k, v in row.items()}
        out = forward(model, batch)
        packed_sum += float(token_cross_entropy_sum(out.logits, shift_labels(batch["labels"])))
        for segment in range(1, int(row["segment_ids"].max()) + 1):
            where = np.flatnonzero(row["segment_ids"] == segment)
            doc = jnp.asarray(row["input_ids"][where])[None]
            alone = forward(model, {"input_ids": doc, "labels": doc})
            # Each document's logits in the packed row are its logits alone.
            np.testing.assert_allclose(np.asarray(out.logits[0, where]), np.asarray(alone.logits[0]), atol=1e-5)
            alone_sum += float(token_cross_entropy_sum(alone.logits, shift_labels(doc)))
    assert packed_sum == pytest.approx(alone_sum, rel=1e-5)

    trainer = Trainer(LlamaForCausalLM.from_config(tiny_llama_config()), _args(max_steps=4), train_dataset=rows * 8)
    trainer.train()  # segment_ids and position_ids reach the model (not dropped as unused columns)
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    assert losses[-1] < losses[0]


def test_group_by_length_pads_to_bounded_buckets():
    rng = np.random.RandomState(0)
    rows = []
    for _ in range(64):
        n = int(rng.randint(4, 120))
        ids = rng.randint(0, 64, n)
        rows.append({"input_ids": ids, "labels": ids, "length": n})

    def pad(features):
        width = max(len(f["input_ids"]) for f in features)
        out = {
            "input_ids": np.zeros((len(features), width), np.int64),
            "labels": np.full((len(features), width), -100, np.int64),
        }
        for i, f in enumerate(features):
            out["input_ids"][i, : len(f["input_ids"])] = f["input_ids"]
            out["labels"][i, : len(f["labels"])] = f["labels"]
        return out

    trainer = Trainer(
        LlamaForCausalLM.from_config(tiny_llama_config(max_position_embeddings=128)),
        _args(train_sampling_strategy="group_by_length", max_steps=8, remove_unused_columns=False),
        train_dataset=rows,
        data_collator=pad,
    )
    jtrainer.clear_compiled_steps()
    with count_compiles() as compiles:
        trainer.train()
    assert 2 <= len(compiles) <= 4  # one per bucket used: 16, 32, 64, 128


def test_the_loop_reads_the_device_only_when_it_logs(monkeypatch):
    """Device-to-host reads (ArrayImpl._value: float(), np.asarray(), device_get) counted over a whole run:
    12 steps read no more than 4 steps when both log once."""
    from jax._src.array import ArrayImpl

    original = ArrayImpl._value
    reads = []

    def counted(self):
        reads.append(1)
        return original.fget(self)

    def run(steps):
        trainer = Trainer(
            LlamaForCausalLM.from_config(tiny_llama_config()),
            _args(max_steps=steps, logging_steps=steps),
            train_dataset=token_rows(48),
        )
        trainer.train()  # compiles first, outside the count below (equal for both runs anyway)
        trainer = Trainer(
            LlamaForCausalLM.from_config(tiny_llama_config()),
            _args(max_steps=steps, logging_steps=steps),
            train_dataset=token_rows(48),
        )
        monkeypatch.setattr(ArrayImpl, "_value", property(counted))
        del reads[:]
        trainer.train()
        monkeypatch.setattr(ArrayImpl, "_value", original)
        return len(reads)

    assert run(12) == run(4)


def test_throughput_in_the_logs_and_mfu_table():
    default = Trainer(LlamaForCausalLM.from_config(tiny_llama_config()), _args(), train_dataset=token_rows(16))
    default.train()  # HF's log keys by default
    assert not any("train_tokens_per_second" in h for h in default.state.log_history)
    args = _args()
    args.log_throughput = True
    trainer = Trainer(LlamaForCausalLM.from_config(tiny_llama_config()), args, train_dataset=token_rows(16))
    trainer.train()
    logs = [h for h in trainer.state.log_history if "loss" in h]
    assert all(h["train_tokens_per_second"] > 0 for h in logs)
    assert not any("train_mfu" in h for h in logs)  # no peak is known for CPUs
    for kind, peak in (
        ("TPU v5 lite", 197e12),
        ("TPU v4", 275e12),
        ("NVIDIA H200", 989e12),
        ("NVIDIA H100 80GB HBM3", 989e12),
        ("NVIDIA A100-SXM4-80GB", 312e12),
        ("cpu", None),
    ):
        assert throughput.peak_flops(types.SimpleNamespace(device_kind=kind)) == peak
    model, config = trainer.model, trainer.model.config
    params = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    non_embedding = sum(
        int(np.prod(np.shape(v)))
        for p, v in jax.tree_util.tree_flatten_with_path(params)[0]
        if "embed_tokens" not in jax.tree_util.keystr(p)
    )
    expected = 6 * non_embedding + 12 * config.num_hidden_layers * config.hidden_size * 16
    assert not config.tie_word_embeddings and throughput.flops_per_token(model, 16) == expected
    # A tied head has no parameters of its own, yet its [width x vocab] product costs what the untied one does.
    tied = LlamaForCausalLM.from_config(tiny_llama_config(tie_word_embeddings=True))
    assert throughput.flops_per_token(tied, 16) == expected


def test_bf16_by_default_only_where_the_hardware_has_it():
    assert not TrainingArguments("o").compute_in_bf16()  # CPU: fp32, as HF
    assert TrainingArguments("o", bf16=True).compute_in_bf16()


JOB = """
import os, sys, tempfile, time, logging
sys.path.insert(0, "tests")
from conftest import tiny_llama_config, token_rows
from jtrainer import Trainer, TrainingArguments
from jtrainer.models.llama import LlamaForCausalLM
logging.getLogger("jax._src.compiler").setLevel(logging.DEBUG)
logging.basicConfig()
args = TrainingArguments(tempfile.mkdtemp(), per_device_train_batch_size=4, max_steps=2, report_to="none",
                         disable_tqdm=True, save_strategy="no", jax_compilation_cache_dir=sys.argv[1])
Trainer(LlamaForCausalLM.from_config(tiny_llama_config()), args, train_dataset=token_rows(8)).train()
"""


def test_second_run_loads_the_compiled_step_from_the_persistent_cache(tmp_path):
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    runs = [
        subprocess.run(
            [sys.executable, "-c", JOB, str(tmp_path / "cache")], env=env, capture_output=True, text=True, timeout=300
        )
        for _ in range(2)
    ]
    assert all(r.returncode == 0 for r in runs), runs[-1].stderr[-3000:]
    assert os.listdir(tmp_path / "cache")
    assert "cache hit" not in runs[0].stderr.lower()
    assert "persistent compilation cache hit for 'jit_train_step'" in runs[1].stderr.lower()


def test_benchmark_script_in_its_accelerator_mode(tmp_path):
    """benchmarks/bench_train.py end to end at a toy size in the mode the GPU check runs (bf16, rows without an
    attention mask, device memory and MFU columns): here on the CPU, where no peak is known (MFU "-")."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, JAX_PLATFORMS="cpu", JAX_DISABLE_MOST_OPTIMIZATIONS="true", TMPDIR=str(tmp_path))
    out = subprocess.run(
        [
            sys.executable,
            "benchmarks/bench_train.py",
            "--accelerator",
            "--configs",
            "tiny",
            "--repeats",
            "1",
            "--steps",
            "4",
            "--no-startup",
        ],
        cwd=root,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    lines = out.stdout.splitlines()
    assert any("bf16 on the accelerator" in line for line in lines)
    table = {line.split()[0]: line.split() for line in lines if line.split()[:1] in (["jtrainer"], ["hf"], ["bare"])}
    assert set(table) == {"jtrainer", "hf", "bare"}
    assert all(float(row[1]) > 0 and row[-1] == "-" for row in table.values())  # tokens/s; no MFU on CPU
    assert any(line.startswith("a/b") for line in lines) and any(line.startswith("a/c") for line in lines)
