"""auto_find_batch_size: shrink the per-device batch after an out-of-memory error, keeping the effective batch.

HF (accelerate's `find_executable_batch_size`) multiplies the batch by 0.9 after each out-of-memory error. Here
each candidate is then rounded down to a divisor of the effective batch (per-device batch x accumulation), and
gradient accumulation rises to keep that product: the optimizer sees the same batch, so results do not depend
on the device's memory.

Out of memory is XLA's RESOURCE_EXHAUSTED (TPU: at compile time; GPU: when the step allocates), or, checked
before the first step runs, the compiled step's memory analysis exceeding the device's memory.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any, TypeVar

import jax

from jtrainer.core import env

T = TypeVar("T")


class StepOutOfMemory(RuntimeError):
    """The compiled train step needs more memory per device than the device has."""


def is_out_of_memory(error: BaseException) -> bool:
    text = str(error)
    return isinstance(error, StepOutOfMemory) or "RESOURCE_EXHAUSTED" in text or "out of memory" in text.lower()


def device_memory_bytes() -> int | None:
    """The per-device memory budget: $JTRAINER_DEVICE_MEMORY_BYTES, else the device's bytes_limit (None on CPU)."""
    budget = env.DEVICE_MEMORY_BYTES.get_int()
    if budget is not None:
        return budget
    stats = jax.local_devices()[0].memory_stats()
    return int(stats["bytes_limit"]) if stats and "bytes_limit" in stats else None


def step_bytes(compiled) -> int | None:
    """Bytes per device that a compiled step holds while it runs: arguments, outputs not aliased to donated
    arguments, and temporaries (XLA's memory analysis)."""
    analysis = compiled.memory_analysis()
    if analysis is None:
        return None
    return int(
        analysis.argument_size_in_bytes
        + analysis.output_size_in_bytes
        - analysis.alias_size_in_bytes
        + analysis.temp_size_in_bytes
    )


def check_fits(compiled, batch_size: int) -> None:
    """Raise StepOutOfMemory when the compiled step cannot fit the device's memory."""
    budget, needed = device_memory_bytes(), step_bytes(compiled)
    if budget is not None and needed is not None and needed > budget:
        raise StepOutOfMemory(
            f"The train step needs {needed:,} bytes per device at per_device_train_batch_size={batch_size}; "
            f"the device has {budget:,}."
        )


def next_batch_size(batch_size: int, effective_batch: int) -> int:
    """HF's next candidate (x0.9), rounded down to a divisor of the effective batch; 0 when none is left."""
    candidate = int(batch_size * 0.9)
    return max((d for d in range(1, candidate + 1) if effective_batch % d == 0), default=0)


def per_device_from_state(train_batch_size: int, processes: int, data_parallel_devices: int) -> int:
    """The per-device batch behind a TrainerState's `train_batch_size` (rows per process and step); >= 1."""
    return max(1, train_batch_size * processes // data_parallel_devices)


class NoBatchSizeFits(RuntimeError):
    """Every candidate ran out of memory (HF's message); the last out-of-memory error is its cause."""


def with_batch(args, per_device: int, accumulation: int):
    """A copy of `args` with this per-device batch and accumulation: the caller's arguments stay as given (the
    copy is not validated again: both numbers come from the search)."""
    found = copy.copy(args)
    found.per_device_train_batch_size, found.gradient_accumulation_steps = per_device, accumulation
    return found


def search(
    attempt: Callable[[Any], T],
    args,
    *,
    start=None,
    retry_on: Callable[[BaseException], bool] = is_out_of_memory,
    on_retry: Callable[[Any, int, BaseException], None] = lambda args, smaller, error: None,
) -> T:
    """HF's find_executable_batch_size with the effective batch kept: `attempt(args)` at `start` (default `args`),
    then, while it fails with an error `retry_on` accepts, at the next smaller batch (`on_retry(tried, smaller,
    error)` first). Returns the first attempt's result that succeeds; `args` itself is never changed."""
    effective = args.per_device_train_batch_size * args.gradient_accumulation_steps
    current = args if start is None else start
    while True:
        try:
            return attempt(current)
        except Exception as error:
            if not retry_on(error):
                raise
            smaller = next_batch_size(current.per_device_train_batch_size, effective)
            if smaller == 0:
                raise NoBatchSizeFits("No executable batch size found, reached zero.") from error
            on_retry(current, smaller, error)
            current = with_batch(args, smaller, effective // smaller)
