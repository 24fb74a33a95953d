"""Prints the page faults of each of 24 calls of a jitted function with a 128 MB temporary buffer (run by
tests/test_host_allocator.py with and without JTRAINER_TUNE_MALLOC=0)."""

import resource

import jax
import jax.numpy as jnp

import jtrainer

jtrainer.initialize()  # tunes malloc unless JTRAINER_TUNE_MALLOC=0


@jax.jit
def reductions(x):  # every reduction materialises a [4096, 4096] intermediate
    y = jnp.sin(x)
    y = y - jnp.mean(y, axis=0)
    z = jnp.cos(y) * jnp.mean(y, axis=1, keepdims=True)
    return jnp.sum(z - jnp.mean(z, axis=0)) + jnp.sum(y * z)


x = jnp.ones((4096, 4096))
faults = []
for _ in range(24):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    reductions(x).block_until_ready()
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
print({"tuned": jtrainer.runtime.host_allocator.should_tune(), "faults": faults})
