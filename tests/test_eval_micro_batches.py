"""A loss-only evaluation of a causal LM's own loss runs its batch in micro-batches of per_device_train_batch_size
rows a data shard: the same eval loss as the batch at once, the activations of one micro-batch."""

import numpy as np
from conftest import short_run_args, tiny_llama_config, token_rows

from jtrainer import Trainer
from jtrainer.models.llama import LlamaForCausalLM
from jtrainer.numerics.step import MicroBatching


def test_micro_batches_take_rows_from_every_data_shard():
    micro = MicroBatching(rows=2, shards=3)
    rows = np.arange(3 * 4)  # shard s holds rows 4s..4s+3
    assert micro.parts({"x": rows}) == 2
    parts = np.asarray(micro.split(rows, 2))
    np.testing.assert_array_equal(parts, [[0, 1, 4, 5, 8, 9], [2, 3, 6, 7, 10, 11]])
    assert micro.parts({"x": np.arange(6)}) is None  # two rows a shard: at once
    assert micro.parts({"x": np.arange(9)}) is None  # three rows a shard do not split in twos


def _eval_loss(eval_rows, **over):
    trainer = Trainer(
        LlamaForCausalLM.from_config(tiny_llama_config(), seed=0),
        short_run_args(per_device_eval_batch_size=6, loss_chunk_size=5, **over),
    )
    return trainer, trainer.evaluate(eval_rows)["eval_loss"]


def test_eval_loss_in_micro_batches_equals_the_batch_at_once():
    eval_rows = token_rows(12, length=16, ragged_labels=True, seed=5)  # uneven label counts per row
    split, loss = _eval_loss(eval_rows, per_device_train_batch_size=2)
    whole, expected = _eval_loss(eval_rows, per_device_train_batch_size=6)
    np.testing.assert_allclose(loss, expected, rtol=1e-6)
    long_rows = token_rows(1, length=64, seed=1)[0]
    example = {k: v[None] for k, v in long_rows.items()}
    temporaries = [
        t.compile_eval_step(example, num_training_steps=1).memory_analysis().temp_size_in_bytes for t in (split, whole)
    ]
    assert temporaries[0] < temporaries[1], temporaries


def test_evaluation_with_logits_runs_the_batch_at_once():
    eval_rows = token_rows(6, length=16, seed=6)
    trainer = Trainer(
        LlamaForCausalLM.from_config(tiny_llama_config(), seed=0),
        short_run_args(per_device_eval_batch_size=6, per_device_train_batch_size=2),
        compute_metrics=lambda p: {"rows": float(len(p.predictions))},
    )
    metrics = trainer.evaluate(eval_rows)
    assert metrics["eval_rows"] == 6.0
