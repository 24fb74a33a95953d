"""One line for torch code that cannot run inside the compiled step: what the code did (a value read on the
host, a shape that depends on values, an op torchax lacks), where (the user's source line), and the fix.

The original traceback stays behind `JTRAINER_BRIDGE_TRACEBACK=1`.
"""

from __future__ import annotations

import contextlib
import linecache
import os
import traceback
from collections.abc import Iterator

from jtrainer.bridge.unlowered import unlowered_op
from jtrainer.core import env, host_rng

# Frames inside these packages are the machinery, not the code the user wrote.
_MACHINERY = tuple(
    f"{os.sep}{name}{os.sep}" for name in ("torch", "torchax", "jax", "jaxlib", "flax", "jtrainer", "contextlib.py")
)

_HOST_READ = (
    "it reads a value of a tensor on the host (.item(), float(), bool(), int(), .tolist(), .numpy(), an `if` on a "
    "tensor), which the compiled step does not have until it runs",
    "compute it with tensor ops instead (torch.where(cond, a, b) for an `if`, keep the value a tensor)",
)
_DATA_SHAPE = (
    "the shape of a result depends on tensor values (torch.nonzero, boolean-mask indexing, torch.unique, "
    "masked_select), while the compiled step's shapes are fixed",
    "keep the shape fixed (torch.where(mask, x, 0) instead of x[mask]; a weighted sum instead of selecting)",
)


# JAX's errors for a traced value asked for on the host.
_HOST_READ_ERRORS = frozenset(
    {
        "ConcretizationTypeError",
        "TracerBoolConversionError",
        "TracerIntegerConversionError",
        "TracerArrayConversionError",
    }
)


def _reason(error: BaseException) -> tuple[str, str] | None:
    name = type(error).__name__
    if name in _HOST_READ_ERRORS:
        return _HOST_READ
    if name == "NonConcreteBooleanIndexError":
        return _DATA_SHAPE
    op = unlowered_op(error)
    if op is not None:
        return (f"it calls torch's {op}, which torchax cannot lower to JAX", "write that part with other torch ops")
    if "mixed math between XLATensor and torch.Tensor" in str(error):
        return (
            "it mixes a tensor made on the CPU (torch.tensor / torch.zeros without device=) with the step's",
            "create it with device=x.device (x: a tensor of the forward)",
        )
    return None


def _user_line(error: BaseException) -> str:
    """`file:line (`source`)` of the innermost frame outside torch, torchax, JAX and jtrainer."""
    frames = [f for f in traceback.extract_tb(error.__traceback__) if not any(m in f.filename for m in _MACHINERY)]
    if not frames:
        return ""
    frame = frames[-1]
    source = (frame.line or linecache.getline(frame.filename, frame.lineno or 0)).strip()
    return f" at {os.path.basename(frame.filename)}:{frame.lineno} (`{source}`)"


def explained(error: BaseException, what: str) -> BaseException | None:
    """A one-line error for `what` ("LlamaForCausalLM's forward", "MyTrainer.compute_loss") failing to trace with
    `error`, or None when the error is not one of these (it is raised as it is)."""
    reason = _reason(error)
    if reason is None or env.BRIDGE_TRACEBACK.get() == "1":
        return None
    why, fix = reason
    return NotImplementedError(
        f"{what} cannot run inside jtrainer's compiled step{_user_line(error)}: {why}. Fix: {fix}. "
        f"({env.BRIDGE_TRACEBACK.name}=1 shows the original traceback.)"
    )


def _host_generators() -> dict[str, bytes]:
    """The states of the host's global generators torch code may draw from while it is traced."""
    import random

    import numpy as np
    import torch

    _, keys, position, *_ = np.random.get_state(legacy=True)
    return {
        "python's random": repr(random.getstate()).encode(),
        "numpy's np.random": np.asarray(keys).tobytes() + str(position).encode(),
        "torch's CPU generator (a random tensor made without device=)": torch.random.get_rng_state().numpy().tobytes(),
    }


@contextlib.contextmanager
def no_host_draws(what: str) -> Iterator[None]:
    """Torch code traced into the step that draws from a host generator would draw once, when the step compiles,
    and repeat that draw every step (torch draws anew each time): refused in one line."""
    with host_rng.collators_paused():  # the training collator's thread swaps the generators' states
        before = _host_generators()
        yield
        drawn = [name for name, state in _host_generators().items() if state != before[name]]
    if drawn:
        raise NotImplementedError(
            f"{what} draws from {' and '.join(drawn)} while jtrainer compiles its step: the draw would happen once "
            "and repeat every step, where torch draws anew. Fix: draw with torch on the step's device "
            "(torch.rand(..., device=x.device), dropout), which takes the step's key."
        )
