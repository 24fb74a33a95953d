"""Host randomness as HF handles it: seeded when the Trainer is built, saved in every checkpoint, restored on resume.

The host generators are python's `random`, numpy's global generator and torch's (when the script uses torch): a
collator that masks tokens (HF's DataCollatorForLanguageModeling) draws from them. jtrainer collates training
batches on a background thread, ahead of the step; so that the draws do not depend on how far ahead it runs, the
training collator draws from its own `RngStream`: the generators' state is swapped in around each call and out
again, under one lock that every collator call takes. Evaluation batches and user code draw from the process's
generators as usual.
"""

from __future__ import annotations

import base64
import contextlib
import dataclasses
import importlib.util
import os
import random
import sys
import threading
from collections.abc import Iterator
from typing import Any

import numpy as np

# Held by every collator call: a swapped-in training stream is never seen by another collator.
_LOCK = threading.RLock()


def _torch(imported_only: bool):
    if "torch" in sys.modules:
        return sys.modules["torch"]
    if imported_only or importlib.util.find_spec("torch") is None:
        return None
    import torch

    return torch


@dataclasses.dataclass(frozen=True)
class HostRngState:
    """The state of python's, numpy's and (if in use) torch's global generators."""

    python: Any
    numpy: Any
    torch: bytes | None = None

    def to_json(self) -> dict[str, Any]:
        version, internal, gauss = self.python
        kind, keys, pos, has_gauss, cached = self.numpy
        return {
            "python": [version, list(internal), gauss],
            "numpy": [kind, np.asarray(keys).tolist(), int(pos), int(has_gauss), float(cached)],
            "torch": None if self.torch is None else base64.b64encode(self.torch).decode("ascii"),
        }

    @classmethod
    def from_json(cls, value: dict[str, Any]) -> "HostRngState":
        version, internal, gauss = value["python"]
        kind, keys, pos, has_gauss, cached = value["numpy"]
        torch_state = value.get("torch")
        return cls(
            python=(version, tuple(internal), gauss),
            numpy=(kind, np.asarray(keys, np.uint32), pos, has_gauss, cached),
            torch=None if torch_state is None else base64.b64decode(torch_state),
        )


def capture() -> HostRngState:
    """The generators' state now (torch's only if torch has been imported: otherwise nothing draws from it)."""
    torch = _torch(imported_only=True)
    torch_state = None if torch is None else bytes(torch.get_rng_state().numpy().tobytes())
    return HostRngState(python=random.getstate(), numpy=np.random.get_state(), torch=torch_state)


def restore(state: HostRngState) -> None:
    random.setstate(state.python)
    np.random.set_state(state.numpy)
    if state.torch is not None:
        torch = _torch(imported_only=False)
        if torch is not None:
            torch.set_rng_state(torch.frombuffer(bytearray(state.torch), dtype=torch.uint8))


def set_seed(seed: int, deterministic: bool = False) -> None:
    """HF's transformers.set_seed: python, numpy and torch seeded with `seed`; with `deterministic`
    (full_determinism), also torch's deterministic algorithms, as HF's enable_full_determinism. torch only when the
    script has imported it (a collator drawing from torch has): jtrainer itself never loads it (transformers' tensor
    checks may, on first use, in a collator that then draws nothing from it)."""
    random.seed(seed)
    np.random.seed(seed)
    torch = _torch(imported_only=True)
    if torch is not None:
        torch.manual_seed(seed)
        if deterministic:
            os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":16:8")
            torch.use_deterministic_algorithms(True)


def draw_loader_seed() -> None:
    """What torch's DataLoader does each time an iterator starts: draw one int64 from torch's generator (its
    workers' base seed), which moves what a collator drawing from torch gets next. Nothing without torch."""
    torch = _torch(imported_only=True)
    if torch is not None:
        torch.empty((), dtype=torch.int64).random_()


def global_randperm(n: int) -> np.ndarray | None:
    """`torch.randperm(n)` from torch's global generator (HF's LengthGroupedSampler without a generator); None
    when the script has not imported torch (nothing to follow)."""
    torch = _torch(imported_only=True)
    return None if torch is None else torch.randperm(n).numpy()


def same_state(a: HostRngState, b: HostRngState) -> bool:
    """No generator moved between the two. torch imported in between (transformers' tensor checks import it on
    first use) is no draw: its generator starts where the import leaves it."""
    return (
        a.python == b.python
        and a.numpy[0] == b.numpy[0]
        and np.array_equal(a.numpy[1], b.numpy[1])
        and tuple(a.numpy[2:]) == tuple(b.numpy[2:])
        and (a.torch is None or b.torch is None or a.torch == b.torch)
    )


class RngStream:
    """A separate sequence of host draws: `run(fn, ...)` calls fn with the process's generators set to this
    stream's state, then puts the process's state back. `state` is the stream's state after the last call."""

    def __init__(self, state: HostRngState):
        self.state = state
        self.drawn = False  # whether a collator call drew from the generators (a random collator)

    def run(self, fn, *args, collator: bool = True):
        with _LOCK:
            outside = capture()
            restore(self.state)
            try:
                return fn(*args)
            finally:
                before, self.state = self.state, capture()
                restore(outside)
                self.drawn = self.drawn or (collator and not same_state(before, self.state))


@contextlib.contextmanager
def continued_by_process(stream: RngStream | None, step_by_step: bool = False) -> Iterator[None]:
    """An evaluation during training as under HF's one generator: the process's generators take the training
    stream's state, and the stream goes on from theirs afterwards (the next draws of the training loader and its
    collator then follow the evaluation's). For a stream whose collator draws nothing, its state is the same
    however far the prefetch ran; a random collator's is followed only when the batches are prepared
    `step_by_step` (the loader has then read just HF's one batch ahead)."""
    if stream is None or (stream.drawn and not step_by_step):
        yield
        return
    with _LOCK:
        restore(stream.state)
    try:
        yield
    finally:
        with _LOCK:
            stream.state = capture()


@contextlib.contextmanager
def collators_paused() -> Iterator[None]:
    """No collator call (none swaps a stream's state in) while this runs: the process's generators change only
    by what the caller does."""
    with _LOCK:
        yield


def run_collator(fn, rows, stream: RngStream | None):
    """Call a collator: on `stream` if given, else on the process's generators (under the same lock)."""
    if stream is not None:
        return stream.run(fn, rows)
    with _LOCK:
        return fn(rows)


def run_loader_draw(fn, stream: RngStream | None):
    """A draw of the loader itself (torch's DataLoader seed, a sampler's permutation), in the collator's order."""
    if stream is not None:
        return stream.run(fn, collator=False)
    with _LOCK:
        return fn()


# torch's CPU randperm draws 32-bit numbers below this size and 64-bit ones above (aten's randperm_cpu).
_TORCH_RANDPERM_32BIT_LIMIT = (2**32 - 1) // 20


def randperm(n: int, seed: int) -> np.ndarray:
    """`torch.randperm(n, generator=torch.Generator().manual_seed(seed))`, the order of HF's shuffled epochs.

    Without torch: torch's CPU generator is MT19937 seeded with the seed's low 32 bits (numpy's legacy seeding is
    the same), and randperm swaps position i with i + (draw % (n - i)) for i = 0 .. n - 2."""
    torch = _torch(imported_only=True)  # fast where the script uses torch; never imported for this
    if torch is not None:
        generator = torch.Generator()
        generator.manual_seed(seed)
        return torch.randperm(n, generator=generator).numpy()
    if n >= _TORCH_RANDPERM_32BIT_LIMIT:
        raise ValueError(
            f"Shuffling {n} rows as torch does needs torch (its 64-bit draws for so many rows): pip install torch, "
            "or set train_sampling_strategy='sequential' and shuffle the dataset yourself."
        )
    draws = np.random.RandomState(seed & 0xFFFFFFFF)._bit_generator.random_raw(max(n - 1, 0))
    order = np.arange(n)
    for i, draw in enumerate(draws.tolist()):
        j = i + draw % (n - i)
        order[i], order[j] = order[j], order[i]
    return order
