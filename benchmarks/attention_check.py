"""cuDNN's fused attention (GPUs) or splash attention (TPUs) against XLA's, as `jtrainer.models.kernels`
runs them.

    python benchmarks/attention_check.py                 # Llama 3.2 1B's attention: batch 2 x 2048, 32/8 heads
    python benchmarks/attention_check.py --length 256    # smaller; on CPU: the CPU formulation vs XLA

For a causal mask alone, a right-padding mask and a sliding window, in bf16: the largest difference of the
outputs and of the q/k/v gradients between `JTRAINER_ATTENTION=cudnn` and `=xla` (relative to the largest XLA
value), and the median time of one forward + backward pass of each. Without a GPU, jtrainer's CPU formulation
stands in for cuDNN.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import jax
import jax.numpy as jnp

from jtrainer.models.kernels import attention


def _loss_and_grads(q, k, v, mask, window, weights, implementation):
    def loss(q, k, v):
        if implementation in ("cpu", "splash"):  # the CPU formulation, or the TPU kernel
            out = attention.causal_attention(q, k, v, mask, sliding_window=window)
        else:  # jax.nn's fused attention (cuDNN or XLA)
            out = attention._fused_attention(q, k, v, mask.dense(), q.shape[-1] ** -0.5, window, implementation)
        return jnp.sum(out.astype(jnp.float32) * weights), out

    return jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True)(q, k, v)


def run(implementation: str, inputs, mask, window, repeats: int):
    """(output, grads, median ms) with JTRAINER_ATTENTION set while tracing."""
    os.environ["JTRAINER_ATTENTION"] = "auto" if implementation == "cpu" else implementation
    step = jax.jit(_loss_and_grads, static_argnums=(4, 6))
    (_, out), grads = jax.block_until_ready(step(*inputs[:3], mask, window, inputs[3], implementation))
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(step(*inputs[:3], mask, window, inputs[3], implementation))
        times.append((time.perf_counter() - start) * 1e3)
    return out, grads, statistics.median(times)


def relative_difference(a, b) -> float:
    a, b = a.astype(jnp.float32), b.astype(jnp.float32)
    return float(jnp.max(jnp.abs(a - b)) / jnp.maximum(jnp.max(jnp.abs(b)), 1e-6))


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--length", type=int, default=2048)
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=10)
    ns = parser.parse_args()
    keys = jax.random.split(jax.random.key(0), 4)
    q = jax.random.normal(keys[0], (ns.batch, ns.length, ns.heads, ns.head_dim), jnp.bfloat16)
    k, v = (jax.random.normal(key, (ns.batch, ns.length, ns.kv_heads, ns.head_dim), jnp.bfloat16) for key in keys[1:3])
    weights = jax.random.normal(keys[3], q.shape, jnp.float32)
    lengths = jnp.array([ns.length - ns.length // 4] + [ns.length] * (ns.batch - 1))
    padding = jnp.arange(ns.length)[None] < lengths[:, None]
    # GPUs: cuDNN; TPUs: splash attention; CPUs: jtrainer's formulation (each against XLA's).
    fused_name = {"gpu": "cudnn", "tpu": "splash"}.get(jax.default_backend(), "cpu")
    print(f"{jax.devices()[0].device_kind}: q {q.shape}, k/v {k.shape}, bf16; {fused_name} vs xla")
    print(f"{'case':<16}{'out diff':>10}{'dq diff':>10}{'dk diff':>10}{'dv diff':>10}{'fused ms':>10}{'xla ms':>10}")
    none, padded = attention.TokenMask(), attention.TokenMask(padding)
    for name, mask, window in (("causal", none, None), ("padding", padded, None), ("window 512", none, 512)):
        fused = run(fused_name, (q, k, v, weights), mask, window, ns.repeats)
        plain = run("xla", (q, k, v, weights), mask, window, ns.repeats)
        if mask is padded:  # padded query rows are ignored by every loss: compare the others
            rows = padding[:, :, None, None]
            fused = (jnp.where(rows, fused[0], 0), jax.tree.map(lambda g: jnp.where(rows, g, 0), fused[1]), fused[2])
            plain = (jnp.where(rows, plain[0], 0), jax.tree.map(lambda g: jnp.where(rows, g, 0), plain[1]), plain[2])
        diffs = [relative_difference(a, b) for a, b in zip((fused[0], *fused[1]), (plain[0], *plain[1]))]
        print(f"{name:<16}" + "".join(f"{d:>10.4f}" for d in diffs) + f"{fused[2]:>10.2f}{plain[2]:>10.2f}")


if __name__ == "__main__":
    main()
