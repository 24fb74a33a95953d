"""Where a train step's time goes on this machine: forward, forward+backward, optimizer, per XLA flag set.

    python benchmarks/profile_step.py                 # the small Llama of bench_train.py
    python benchmarks/profile_step.py small bridge    # transformers' own Llama of that shape, through the bridge
    XLA_FLAGS=--xla_cpu_use_xnnpack=true python benchmarks/profile_step.py

Prints median milliseconds of each jitted piece over repeated calls (after a warm-up call).
"""

from __future__ import annotations

import os
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_train import CONFIGS  # noqa: E402


def timed(fn, *args, repeats=10):
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def _native(config):
    from jtrainer.models import LlamaForCausalLM
    from jtrainer.numerics.losses import token_loss

    model = LlamaForCausalLM.from_config(config)
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)

    def loss_fn(params, ids):
        out = nnx.merge(graphdef, params, rest)(ids)
        return token_loss(out.logits, ids, causal=True)

    def hidden_fn(params, ids):
        return nnx.merge(graphdef, params, rest).model(ids)

    return params, loss_fn, hidden_fn


def _bridged(config):
    """transformers' LlamaForCausalLM through the bridge, in training mode; its own loss (ForCausalLMLoss)."""
    import transformers

    from jtrainer.bridge.module import TorchModel

    model = TorchModel(transformers.LlamaForCausalLM(config))
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)

    def loss_fn(params, ids):
        return nnx.merge(graphdef, params, rest)(input_ids=ids, labels=ids)["loss"]

    def hidden_fn(params, ids):
        bound = nnx.merge(graphdef, params, rest)
        return bound(input_ids=ids, output_hidden_states=True)["hidden_states"][-1]

    return params, loss_fn, hidden_fn


def main(name="small", system="native"):
    import transformers

    cfg = CONFIGS[name]
    model_cfg = {k: v for k, v in cfg.items() if k not in ("seq", "batch")}
    config = transformers.LlamaConfig(max_position_embeddings=cfg["seq"], **model_cfg)
    params, loss_fn, hidden_fn = (_bridged if system == "bridge" else _native)(config)
    ids = jnp.asarray(np.random.RandomState(0).randint(0, cfg["vocab_size"], (cfg["batch"], cfg["seq"])))

    tx = optax.adamw(1e-4, weight_decay=0.01)
    opt_state = tx.init(params)
    grads = jax.grad(loss_fn)(params, ids)

    def step(params, opt_state, ids):
        loss, grads = jax.value_and_grad(loss_fn)(params, ids)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    tokens = cfg["batch"] * cfg["seq"]
    rows = [
        ("trunk forward (no LM head)", jax.jit(hidden_fn), (params, ids)),
        ("forward + loss", jax.jit(loss_fn), (params, ids)),
        ("forward + backward", jax.jit(jax.grad(loss_fn)), (params, ids)),
        ("optimizer update", jax.jit(lambda g, s, p: tx.update(g, s, p)), (grads, opt_state, params)),
        ("whole step", jax.jit(step), (params, opt_state, ids)),
    ]
    print(f"{name} ({system}): {tokens} tokens/step, XLA_FLAGS={os.environ.get('XLA_FLAGS', '')!r}")
    for label, fn, args in rows:
        ms = timed(fn, *args)
        print(f"  {label:<28} {ms:8.1f} ms   {tokens / ms * 1e3:10.0f} tokens/s")


if __name__ == "__main__":
    main(*sys.argv[1:])
