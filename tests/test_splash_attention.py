"""jtrainer.models.kernels.splash_attention (the TPU attention kernel) against XLA's attention, run here in Pallas'
interpret mode: values and q/k/v gradients, for causality, grouped-query heads, padding, packed rows and
sliding windows; on 8 CPU devices, queries split over `sequence` (context parallelism) and heads over
`tensor` give one device's values."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jtrainer.models.kernels import attention, splash_attention

HERE = os.path.dirname(os.path.abspath(__file__))
LENGTH = 512


@pytest.fixture(autouse=True)
def small_blocks(monkeypatch):
    """Tiles of 128 tokens (the smallest the kernel takes), so a row of 512 has 4 x 4 blocks: the kernel skips
    the ones causality hides."""
    monkeypatch.setattr(splash_attention, "BLOCK", 128)
    monkeypatch.setenv("JTRAINER_ATTENTION", "splash")


def _inputs(kv_heads: int, length: int = LENGTH, seed: int = 0):
    keys = jax.random.split(jax.random.key(seed), 4)
    q = jax.random.normal(keys[0], (2, length, 4, 16))
    k, v = (jax.random.normal(key, (2, length, kv_heads, 16)) for key in keys[1:3])
    return q, k, v, jax.random.normal(keys[3], q.shape)


def _masks(length: int = LENGTH):
    """Row 0 left-padded by 5 (those queries see no key), row 1 right-padded by 9; packed: three documents in
    row 0, two and padding in row 1."""
    positions = jnp.arange(length)[None]
    padding = (positions >= jnp.array([[5], [0]])) & (positions < jnp.array([[length], [length - 9]]))
    segments = jnp.stack(
        [
            jnp.where(positions[0] < 160, 1, jnp.where(positions[0] < 300, 2, 3)),
            jnp.where(positions[0] < 200, 1, jnp.where(positions[0] < length - 9, 2, 0)),
        ]
    )
    return {
        "causal": (attention.TokenMask(), jnp.ones((2, length), bool)),
        "padding": (attention.TokenMask(padding), padding),
        "packed": (attention.TokenMask(segment_ids_BxT=segments), segments != 0),
        "packed and padded": (attention.TokenMask(padding, segments), padding & (segments != 0)),
    }


def _reference(q, k, v, mask: attention.TokenMask, window):
    dense = attention.causal_mask(q.shape[1], window)
    extra = mask.dense()
    return jax.nn.dot_product_attention(q, k, v, mask=dense if extra is None else dense & extra, scale=0.25)


@pytest.mark.parametrize("case", ["causal", "padding", "packed", "packed and padded"])
@pytest.mark.parametrize("kv_heads,window", [(4, None), (2, None), (1, 200)])
def test_kernel_equals_xla_attention(case, kv_heads, window):
    """Values and gradients on every query row that sees a key (the loss weights the others by 0, as a label
    of -100 does): multi-head, grouped-query and multi-query heads, a sliding window of 200 (partly hiding blocks)."""
    q, k, v, weights = _inputs(kv_heads)
    mask, sees_a_key = _masks()[case]
    weights = weights * sees_a_key[:, :, None, None]

    def objective(attend):
        return lambda q, k, v: jnp.sum(attend(q, k, v) * weights)

    kernel = jax.jit(
        jax.value_and_grad(
            objective(lambda q, k, v: attention.causal_attention(q, k, v, mask, 0.25, window)), (0, 1, 2)
        )
    )
    reference = jax.value_and_grad(objective(lambda q, k, v: _reference(q, k, v, mask, window)), (0, 1, 2))
    ours, theirs = kernel(q, k, v), reference(q, k, v)
    for a, b in zip(jax.tree.leaves(ours), jax.tree.leaves(theirs)):
        np.testing.assert_allclose(a, b, rtol=2e-5, atol=2e-5)
    out = attention.causal_attention(q, k, v, mask, 0.25, window)
    assert bool(jnp.all(jnp.isfinite(out)))  # rows that see no key too


def test_the_kernel_is_what_runs():
    """JTRAINER_ATTENTION=splash lowers a Pallas call (not XLA's dot products over [T, T] scores)."""
    q, k, v, _ = _inputs(2)
    text = jax.jit(lambda q, k, v: attention.causal_attention(q, k, v)).lower(q, k, v).as_text()
    assert "splash" in text
    assert attention.implementation(q, k) == "splash"


def test_shapes_the_kernel_cannot_run_are_refused_when_forced_and_fall_back_otherwise(monkeypatch, caplog):
    """A length that is not a multiple of the kernel's tile: XLA's attention with a warning under `auto` (on a
    TPU), a one-line error naming the variable under JTRAINER_ATTENTION=splash."""
    q, k, v, _ = _inputs(2, length=100)
    monkeypatch.setattr(attention, "on_tpu", lambda: True)
    with pytest.raises(ValueError, match="JTRAINER_ATTENTION=splash: .*not a multiple of 128"):
        attention.implementation(q, k)
    monkeypatch.setenv("JTRAINER_ATTENTION", "auto")
    attention._warned.clear()
    with caplog.at_level("WARNING", logger=attention.__name__):
        assert attention.implementation(q, k) == "xla"
    assert "Splash attention cannot run" in caplog.text


def test_tpus_choose_the_kernel_cpus_keep_their_formulation(monkeypatch):
    monkeypatch.setenv("JTRAINER_ATTENTION", "auto")
    q, k, v, _ = _inputs(2)
    assert attention.implementation(q, k) == "cpu"
    monkeypatch.setattr(attention, "on_tpu", lambda: True)
    assert attention.implementation(q, k) == "splash"


MESH_SCRIPT = r"""
import sys, json, numpy as np, jax, jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P
from jtrainer.parallel import sharding
from jtrainer.models.kernels import attention, splash_attention
splash_attention.BLOCK = 128
length = 1024
keys = jax.random.split(jax.random.key(0), 5)
q = jax.random.normal(keys[0], (2, length, 4, 16))
k, v = (jax.random.normal(key, (2, length, 2, 16)) for key in keys[1:3])
weights = jax.random.normal(keys[3], q.shape)
positions = jnp.arange(length)[None]
segments = jnp.stack([jnp.where(positions[0] < 300, 1, 2), jnp.where(positions[0] < length - 9, 1, 0)])
mask = attention.TokenMask(segments != 0, segments)

def loss_and_grads(window):
    f = lambda q, k, v: jnp.sum(attention.causal_attention(q, k, v, mask, None, window) * weights)
    return jax.jit(jax.value_and_grad(f, (0, 1, 2)))(q, k, v)

results = {}
for layout in json.loads(sys.argv[1]):
    size = int(np.prod(list(layout.values()) or [1]))
    mesh = sharding.make_mesh(layout or {"data": 1}, jax.devices()[:size])
    with jax.set_mesh(mesh), sharding.axis_rules(sharding.DEFAULT_RULES):
        for window in (None, 200):
            out = loss_and_grads(window)
            text = jax.jit(lambda q, k, v: attention.causal_attention(q, k, v, mask)).lower(q, k, v).as_text()
            results.setdefault(json.dumps(layout), []).append(
                [np.asarray(x).tolist() for x in jax.tree.leaves(out)] + ["shard_map" in text or "manual" in text]
            )
print("RESULT" + json.dumps(results))
"""


def test_sequence_and_tensor_shards_equal_one_device():
    """8 CPU devices: queries over `sequence` 2/4/8 (keys and values gathered), heads over `tensor` (also more
    shards than key/value heads), rows over fsdp; loss and gradients equal one device's (the kernel runs inside
    shard_map: Mosaic cannot be partitioned)."""
    layouts = [{}, {"sequence": 2}, {"sequence": 4}, {"sequence": 8}, {"fsdp": 2, "tensor": 2, "sequence": 2}]
    layouts.append({"tensor": 4, "sequence": 2})  # 2 key/value heads over 4 tensor shards: each takes its own
    env = dict(
        os.environ,
        XLA_FLAGS="--xla_force_host_platform_device_count=8",
        JAX_PLATFORMS="cpu",
        JTRAINER_ATTENTION="splash",
    )

    out = subprocess.run(
        [sys.executable, "-c", MESH_SCRIPT, json.dumps(layouts)], env=env, capture_output=True, text=True, timeout=900
    )
    assert out.returncode == 0, out.stderr[-3000:]
    results = json.loads(out.stdout.split("RESULT", 1)[1])
    one = results[json.dumps({})]
    for layout in layouts[1:]:
        sharded = results[json.dumps(layout)]
        for (*values, lowered_sharded), (*expected, _) in zip(sharded, one):
            assert lowered_sharded
            for a, b in zip(values, expected):
                np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-5)


def _train(runs: list[dict], devices: int, tmp_path) -> dict:
    out = tmp_path / f"results{devices}.json"
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}")
    job = os.path.join(HERE, "jobs", "context_parallel_job.py")
    done = subprocess.run(
        [sys.executable, job, str(out), *(json.dumps(r) for r in runs)],
        env=env,
        capture_output=True,
        text=True,
        timeout=1200,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return {json.loads(k)["mesh"].__repr__(): v for k, v in json.loads(out.read_text()).items()}


@pytest.mark.parametrize("window", [None, 300])
def test_training_with_sequence_shards_equals_one_device(tmp_path, window):
    """A tiny Llama (Mistral: every layer windowed) trained 3 steps on rows of 1024 tokens, padded and with
    ignored labels: the splash kernel with queries over `sequence` 2, 4 and 8 (with fsdp, and heads over
    `tensor`) logs one device's XLA-attention losses and gradient norms to 1e-5."""
    meshes = [
        {"fsdp": 4, "sequence": 2},
        {"fsdp": 2, "sequence": 4},
        {"sequence": 8},
        {"fsdp": 2, "tensor": 2, "sequence": 2},
    ]
    reference = _train([{"mesh": {}, "attention": "auto", "window": window}], 1, tmp_path)["{}"]
    sharded = _train([{"mesh": m, "attention": "splash", "window": window} for m in meshes], 8, tmp_path)
    assert len(sharded) == len(meshes)
    for mesh, logs in sharded.items():
        np.testing.assert_allclose(logs["losses"], reference["losses"], rtol=1e-5, err_msg=mesh)
        np.testing.assert_allclose(logs["grad_norms"], reference["grad_norms"], rtol=1e-5, err_msg=mesh)


def _bridge_case(name: str):
    import transformers
    from conftest import tiny_llama_config

    small = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, max_position_embeddings=512)
    heads = dict(num_attention_heads=4, num_key_value_heads=2)
    if name == "llama":
        return transformers.LlamaForCausalLM(tiny_llama_config(max_position_embeddings=512))
    if name == "mistral":  # every layer windowed (200 < the row)
        return transformers.MistralForCausalLM(transformers.MistralConfig(**small, **heads, sliding_window=200))
    config = transformers.Gemma3TextConfig(  # one sliding layer, one full
        **small, **heads, head_dim=16, sliding_window=200, layer_types=["sliding_attention", "full_attention"]
    )
    return transformers.Gemma3ForCausalLM(config)


@pytest.mark.parametrize("name", ["llama", "mistral", "gemma3"])
def test_bridged_transformers_models_reach_the_kernel(name, monkeypatch):
    """A transformers model through the bridge, routed to the splash kernel (its mask function hands over the
    padding and the window, not a [T, T] mask): loss and gradients equal torch's own (float64) on rows of 512
    tokens with right padding; the kernel is what ran; a row with no padding takes it too."""
    pytest.importorskip("torch")
    import torch

    torch.manual_seed(0)
    model = _bridge_case(name)
    assert _bridged_beside_torch(model, LENGTH, padded=40) == {"splash"}
    assert model.config._attn_implementation == "sdpa"  # put back after the step


def _bridged_beside_torch(model, length: int, padded: int) -> set[str]:
    """The bridged loss and gradients on two random rows of `length` tokens (the second's last `padded` are
    padding) equal the torch model's own in float64; returns the attention implementations that ran."""
    import torch
    from conftest import bridged_loss_and_grads

    ids = torch.randint(0, 64, (2, length))
    mask = torch.ones(2, length, dtype=torch.long)
    mask[1, -padded:] = 0
    inputs = dict(input_ids=ids, attention_mask=mask, labels=torch.where(mask.bool(), ids, -100))
    with attention.chosen_implementations() as chosen:
        loss, grads = bridged_loss_and_grads(model, **inputs)
    reference = model.double()
    reference.zero_grad()
    reference(**inputs).loss.backward()
    np.testing.assert_allclose(loss, reference(**inputs).loss.item(), rtol=1e-5)
    for torch_name, parameter in reference.named_parameters():
        np.testing.assert_allclose(grads[torch_name], parameter.grad.numpy(), atol=2e-6, err_msg=torch_name)
    return chosen


def test_queries_are_put_in_a_load_balanced_order_over_sequence_shards():
    """Shard i of 4 takes chunks i and 7 - i of the row (one early, one late: the same causal work each); where a
    chunk would not be whole tiles (8 shards of 1024 tokens: 64-token chunks) the order stays as it is."""
    order = splash_attention._balanced_order(1024, 4)
    chunks = order.reshape(8, 128)[:, 0] // 128
    assert chunks.tolist() == [0, 7, 1, 6, 2, 5, 3, 4]
    assert sorted(order.tolist()) == list(range(1024))
    assert splash_attention._balanced_order(1024, 8) is None and splash_attention._balanced_order(1024, 1) is None


@pytest.mark.parametrize("name", ["llama", "mistral", "gemma2"])
def test_bridged_models_on_the_cpu_take_the_native_kernel_where_they_chose_sdpa(name, monkeypatch):
    """On the CPU backend a bridged model whose config chose SDPA (Llama; Mistral, windowed) runs its causal
    layers through the native models' blocked CPU formulation; one that chose eager attention (Gemma 2:
    soft-capping) keeps it. Loss and gradients equal torch's own (float64) on padded rows either way."""
    pytest.importorskip("torch")
    import torch
    import transformers

    monkeypatch.delenv("JTRAINER_ATTENTION", raising=False)
    torch.manual_seed(0)
    if name == "gemma2":
        config = transformers.Gemma2Config(
            vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=8, sliding_window=24, max_position_embeddings=512,
        )  # fmt: skip
        model, expected_route, chosen_before = transformers.Gemma2ForCausalLM(config), set(), "eager"
    else:
        model, expected_route, chosen_before = _bridge_case(name), {"cpu"}, "sdpa"
        if name == "mistral":
            model.config.sliding_window = 24  # shorter than the rows
    assert _bridged_beside_torch(model, 48, padded=7) == expected_route
    assert model.config._attn_implementation == chosen_before  # put back after the step
