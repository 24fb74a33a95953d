"""jtrainer.sizing.memory_report: values named by their dimensions, sized per chip by the mesh, the largest of each
kind first, and the advice that follows from them."""

import jax
import jax.numpy as jnp

from jtrainer.sizing import memory_report as report

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


def test_values_are_named_by_where_they_come_from_when_sizes_coincide():
    """Rows as long as the model is wide (length == hidden, as the 1B Llama at 2048): the [rows, length, vocab]
    values are the logits (a product with the LM head) and their gradient, never "hidden states"; the
    embedding's and head's gradients are parameter-shaped."""
    shapes = report.StepShapes(rows=8, length=64, vocab=4000, hidden=64, intermediate=256, heads=4, mesh={})

    def loss(params, ids):
        hidden = params["embedding"][ids] @ params["w"]  # [rows, length, hidden]
        logits = hidden @ params["head"]  # [rows, length, vocab]
        return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), ids[..., None], axis=-1))

    def step(params, ids):
        grads = jax.grad(loss)(params, ids)
        return jax.tree.map(lambda p, g: p - 0.1 * g, params, grads)

    params = {
        "embedding": jax.ShapeDtypeStruct((4000, 64), jnp.float32),
        "w": jax.ShapeDtypeStruct((64, 64), jnp.float32),
        "head": jax.ShapeDtypeStruct((64, 4000), jnp.float32),
    }
    ids = jax.ShapeDtypeStruct((8, 64), jnp.int32)
    jaxpr = jax.make_jaxpr(step)(params, ids)
    values = report.largest_values(jaxpr, shapes, batch_inputs=1)
    assert values[0].kind == report.LOGITS and values[0].shape == (8, 64, 4000), values
    assert values[0].count >= 3  # the logits, their softmax, their gradient, ...
    assert not any(v.shape == (8, 64, 4000) for v in values if v.kind != report.LOGITS), values
    parameter_shaped = [v for v in values if v.kind == report.PARAMETER_SHAPED]
    assert parameter_shaped and parameter_shaped[0].shape in {(4000, 64), (64, 4000)}, values
    assert report._kind((8, 64, 4000), shapes) == report.HIDDEN  # what dimensions alone would have said
