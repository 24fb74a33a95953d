"""jtrainer.cli.memory_report: values named by their dimensions, sized per chip by the mesh, the largest of each
kind first, and the advice that follows from them."""

import jax
import jax.numpy as jnp

from jtrainer.cli import memory_report as report

SHAPES = report.StepShapes(
    rows=2, length=8192, vocab=32000, hidden=512, intermediate=1408, heads=8, mesh={"fsdp": 2, "sequence": 2}
)


def test_values_are_named_by_their_dimensions_and_sized_per_chip():
    kinds = {
        (2, 8, 8192, 8192): report.ATTENTION_SCORES,  # [rows, heads, queries, keys]
        (2, 8192, 32000): report.LOGITS,
        (2, 1024, 32000): report.LOSS_CHUNK,  # the chunked loss: a chunk of positions
        (2, 8192, 1408): report.MLP,
        (2, 8192, 512): report.HIDDEN,
        (32000, 512): report.PARAMETER_SHAPED,  # the embedding's gradient, not logits
        (512, 512): report.PARAMETER_SHAPED,
    }
    for shape, kind in kinds.items():
        assert report._kind(shape, SHAPES) == kind, shape
    # rows over fsdp (2) and queries over sequence (2); the gathered keys are whole
    assert report._split((2, 8, 8192, 8192), report.ATTENTION_SCORES, SHAPES) == 4
    assert report._split((32000, 512), report.PARAMETER_SHAPED, SHAPES) == 2


def test_the_largest_value_of_each_kind_comes_first_with_its_advice():
    def step(q, k, w):
        scores = jnp.einsum("bnqh,bnkh->bnqk", q, k)  # [2, 8, 8192, 8192]: 4 GiB in float32
        return jnp.sum(jax.nn.softmax(scores)) + jnp.sum(w @ w.T)

    q = jax.ShapeDtypeStruct((2, 8, 8192, 64), jnp.float32)
    w = jax.ShapeDtypeStruct((512, 512), jnp.float32)
    values = report.largest_values(jax.make_jaxpr(step)(q, q, w).jaxpr, SHAPES)
    assert values[0].kind == report.ATTENTION_SCORES and values[0].bytes_per_chip == 2 * 8 * 8192 * 8192 * 4 // 4
    assert values[0].count >= 2  # the scores, their exponentials, ...
    assert "attention scores: [2 x 8 x 8192 x 8192] float32, 1.00 GiB a chip each" in values[0].describe()
    advice = report.advice(values, SHAPES)
    assert advice[0].startswith("attention holds [length, length] scores") and "sequence: M" in advice[0]
