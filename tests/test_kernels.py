"""jtrainer.models.kernels: the kernel choice per platform, and the hand-written backward passes (kernels.dense,
kernels.attention, and losses' cross-entropy) equal autodiff of the plain formula."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jtrainer.models.kernels.dense import _weight_grad_transposing, dense, dense_transposed
from jtrainer.numerics.losses import IGNORE_INDEX, token_cross_entropy_sum


@pytest.mark.parametrize("shape,d_in,d_out", [((6,), 4, 12), ((2, 5), 12, 4), ((3,), 8, 8)])
def test_dense_gradients_equal_autodiff(shape, d_in, d_out):
    x = jax.random.normal(jax.random.key(0), shape + (d_in,))
    kernel = jax.random.normal(jax.random.key(1), (d_in, d_out))

    def objective(matmul):
        return lambda x, kernel: jnp.sum(jnp.sin(matmul(x, kernel)))

    ours = jax.jit(jax.value_and_grad(objective(dense), argnums=(0, 1)))(x, kernel)
    plain = jax.value_and_grad(objective(jnp.dot), argnums=(0, 1))(x, kernel)
    for a, b in zip(jax.tree.leaves(ours), jax.tree.leaves(plain)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)
    # torch's [out, in] layout: the same gradients, the weight's transposed.
    ours_t = jax.jit(jax.value_and_grad(objective(dense_transposed), argnums=(0, 1)))(x, kernel.T)
    np.testing.assert_allclose(ours_t[0], plain[0], rtol=1e-5)
    np.testing.assert_allclose(ours_t[1][0], plain[1][0], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(ours_t[1][1], plain[1][1].T, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("matmul", [dense, lambda x, k: dense_transposed(x, k.T)])
def test_dense_transposes_explicitly_on_cpu_only_and_keeps_dtypes(monkeypatch, matmul):
    x = jnp.ones((2, 3, 4), jnp.bfloat16)
    kernel = jnp.ones((4, 5), jnp.bfloat16)

    def grad():
        return jax.jit(jax.grad(lambda x, k: jnp.sum(matmul(x, k).astype(jnp.float32)), argnums=(0, 1)))

    assert [g.dtype for g in grad()(x, kernel)] == [jnp.bfloat16, jnp.bfloat16]
    assert "optimization_barrier" in grad().lower(x, kernel).as_text()
    # Elsewhere plain autodiff: TPU and GPU matrix units take either orientation.
    monkeypatch.setattr(jax, "default_backend", lambda: "tpu")
    assert "optimization_barrier" not in grad().lower(x, kernel).as_text()


@pytest.mark.parametrize("d_in,d_out", [(3, 7), (7, 3)])
def test_both_weight_gradient_orientations_agree(d_in, d_out):
    x = jax.random.normal(jax.random.key(2), (9, d_in))
    dy = jax.random.normal(jax.random.key(3), (9, d_out))
    np.testing.assert_allclose(_weight_grad_transposing(x, dy, None), x.T @ dy, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("label_smoothing", [0.0, 0.1])
def test_cross_entropy_gradient_equals_autodiff_of_log_softmax(label_smoothing):
    logits = jax.random.normal(jax.random.key(0), (3, 7, 11)) * 3
    labels = jax.random.randint(jax.random.key(1), (3, 7), 0, 11)
    labels = labels.at[0, 2].set(IGNORE_INDEX).at[2, 6].set(IGNORE_INDEX)

    def reference(logits):
        valid = labels != IGNORE_INDEX
        log_probs = jax.nn.log_softmax(logits, axis=-1)
        nll = -jnp.take_along_axis(log_probs, jnp.where(valid, labels, 0)[..., None], axis=-1)[..., 0]
        nll = (1 - label_smoothing) * nll - label_smoothing * jnp.mean(log_probs, axis=-1)
        return jnp.sum(jnp.where(valid, nll, 0.0))

    loss, grad = jax.jit(jax.value_and_grad(lambda z: token_cross_entropy_sum(z, labels, label_smoothing)))(logits)
    ref_loss, ref_grad = jax.value_and_grad(reference)(logits)
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-6)
    np.testing.assert_allclose(grad, ref_grad, atol=1e-6)
    assert not np.any(grad[0, 2]) and not np.any(grad[2, 6])  # ignored tokens get no gradient


@pytest.mark.parametrize("length,kv_heads", [(256, 2), (128, 4), (48, 1)])  # 4, 2 and 1 query blocks
def test_causal_attention_equals_jax_nn_with_fully_masked_rows(length, kv_heads):
    from jtrainer.models.kernels.attention import TokenMask, causal_attention

    keys = jax.random.split(jax.random.key(0), 4)
    q = jax.random.normal(keys[0], (2, length, 4, 8))
    k, v = (jax.random.normal(key, (2, length, kv_heads, 8)) for key in keys[1:3])
    weights = jax.random.normal(keys[3], q.shape)
    not_padding = jnp.arange(length)[None] >= jnp.array([[5], [0]])  # row 0 left-padded: 5 queries see no key
    mask = jnp.tril(jnp.ones((length, length), bool))[None, None] & not_padding[:, None, None, :]

    def objective(attend):
        return lambda q, k, v: jnp.sum(attend(q, k, v) * weights)

    ours = jax.jit(
        jax.value_and_grad(objective(lambda q, k, v: causal_attention(q, k, v, TokenMask(not_padding), 0.3)), (0, 1, 2))
    )
    reference = jax.value_and_grad(
        objective(lambda q, k, v: jax.nn.dot_product_attention(q, k, v, mask=mask, scale=0.3)), (0, 1, 2)
    )
    for a, b in zip(jax.tree.leaves(ours(q, k, v)), jax.tree.leaves(reference(q, k, v))):
        np.testing.assert_allclose(a, b, rtol=2e-5, atol=2e-5)


def test_causal_attention_is_jax_nn_off_cpu(monkeypatch):
    from jtrainer.models.kernels.attention import causal_attention

    q = k = v = jnp.ones((1, 128, 2, 4))

    def lowered():
        return jax.jit(jax.grad(lambda q: jnp.sum(causal_attention(q, k, v)))).lower(q).as_text()

    assert "optimization_barrier" in lowered()
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    assert "optimization_barrier" not in lowered()


def _attention_inputs(dtype=jnp.float32, length=64):
    keys = jax.random.split(jax.random.key(1), 3)
    q = jax.random.normal(keys[0], (2, length, 4, 16), dtype)
    k, v = (jax.random.normal(key, (2, length, 2, 16), dtype) for key in keys[1:])
    padding = jnp.arange(length)[None] < jnp.array([[length - 7], [length]])  # row 0 right-padded
    return q, k, v, padding


@pytest.mark.parametrize("window", [None, 9])
@pytest.mark.parametrize("padded", [False, True])
def test_attention_takes_causality_itself_on_every_path(monkeypatch, window, padded):
    """A padding-only mask (or none) and a sliding window give what the dense causal mask gives jax.nn, on the
    CPU formulation and on the fused path (XLA's, as on TPUs and for fp32 on GPUs)."""
    from jtrainer.models.kernels import attention

    q, k, v, padding = _attention_inputs()
    mask = attention.TokenMask(padding if padded else None)
    dense = attention.causal_mask(q.shape[1], window) & (padding[:, None, None, :] if padded else True)
    reference = jax.nn.dot_product_attention(q, k, v, mask=dense)
    np.testing.assert_allclose(
        attention.causal_attention(q, k, v, mask, sliding_window=window), reference, rtol=2e-5, atol=2e-5
    )
    monkeypatch.setattr(jax, "default_backend", lambda: "tpu")
    np.testing.assert_allclose(
        attention.causal_attention(q, k, v, mask, sliding_window=window), reference, rtol=2e-5, atol=2e-5
    )


def test_cudnn_attention_chosen_for_half_precision_on_gpus_and_overridable(monkeypatch):
    from jtrainer.models.kernels.attention import fused_implementation

    half, full = jnp.ones((1, 8, 2, 16), jnp.bfloat16), jnp.ones((1, 8, 2, 16), jnp.float32)
    assert fused_implementation(half) == "xla"  # CPU
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    assert (fused_implementation(half), fused_implementation(full)) == ("cudnn", "xla")
    monkeypatch.setenv("JTRAINER_ATTENTION", "XLA")
    assert fused_implementation(half) == "xla"
    monkeypatch.setenv("JTRAINER_ATTENTION", "flash")
    with pytest.raises(ValueError, match="JTRAINER_ATTENTION='flash'"):
        fused_implementation(half)


def test_cudnn_refusal_falls_back_to_xla_unless_forced(monkeypatch, caplog):
    """Here (no cuDNN) jax.nn refuses implementation="cudnn" while tracing, as it refuses shapes cuDNN cannot
    run on a GPU: the layer then runs XLA's attention and says so once; JTRAINER_ATTENTION=cudnn raises."""
    from jtrainer.models.kernels import attention

    q, k, v, padding = _attention_inputs(jnp.bfloat16)
    dense = attention.causal_mask(q.shape[1]) & padding[:, None, None, :]
    reference = jax.nn.dot_product_attention(q, k, v, mask=dense)
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    attention._warned.clear()
    with caplog.at_level("WARNING", logger=attention.__name__):
        for _ in range(2):
            out = attention.causal_attention(q, k, v, attention.TokenMask(padding))
    np.testing.assert_allclose(out.astype(jnp.float32), reference.astype(jnp.float32), atol=2e-2)
    assert [r.message for r in caplog.records].count(caplog.records[0].message) == 1
    assert "cuDNN attention refused" in caplog.records[0].message
    monkeypatch.setenv("JTRAINER_ATTENTION", "cudnn")
    with pytest.raises((RuntimeError, ValueError, NotImplementedError)):
        attention.causal_attention(q, k, v, attention.TokenMask(padding))
