"""What one train() loop keeps while it runs, in one object (HF keeps these on the Trainer itself).

`TrainingRun` holds the loop's data, its compiled step, the per-run loss rules, the host side of the last
step (what its checkpoint saves), the log accumulators and the preemption notice. The Trainer creates one per
`_inner_training_loop` and keeps the last as `trainer._run`, which saving (the loop state) and the end-of-run
memory report read. `summed_step_losses` is HF's logging NaN/Inf filter as a pure function.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import signal
import threading
import time
from collections.abc import Iterator, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jtrainer.core.state import LoopState
from jtrainer.runtime import host_allocator
from jtrainer.sizing import throughput
from jtrainer.trainer import data

logger = logging.getLogger(__name__)


def summed_step_losses(
    steps: Sequence[Sequence[float] | np.ndarray],
    first_step: int,
    nan_inf_filter: bool,
    nan_inf_policy: str,
    start: float = 0.0,
) -> float:
    """The sum of the losses since the last log as HF accumulates them, from each step's micro-batch losses
    (HF's tr_loss_step) onto `start`, what HF's reset left: with `logging_nan_inf_filter`, a non-finite
    micro-batch adds the running sum divided by the steps since the last log plus one instead of itself;
    nan_inf_policy='error' refuses the step, named."""
    total = start
    for i, micro_losses in enumerate(steps):
        values = [float(v) for v in micro_losses]
        if nan_inf_policy == "error" and not all(map(math.isfinite, values)):
            raise FloatingPointError(
                f"The loss of step {first_step + i} is {sum(values)} (nan_inf_policy='error'). Lower the learning "
                "rate, clip gradients (max_grad_norm) or use nan_inf_policy='skip'."
            )
        for value in values:
            total += total / (1 + i) if nan_inf_filter and not math.isfinite(value) else value
    return total


@dataclasses.dataclass
class LossLog:
    """Each step's micro-batch losses since the last log, kept on the device until a log reads them at once."""

    last_logged_step: int  # HF's _globalstep_last_logged
    pending: list[tuple[Any, int]] = dataclasses.field(default_factory=list)  # (micro losses, how many are real)
    total: float = 0.0  # HF's _total_loss_scalar: every logged loss of the run, summed
    # What HF's `tr_loss -= tr_loss` leaves after a log: 0, or NaN once an unfiltered NaN/Inf entered the sum
    # (every later log of HF's run is then NaN too).
    residue: float = 0.0
    non_finite: int = 0  # micro-batch losses read that were NaN/Inf

    def add(self, micro_losses: Any, real: int) -> None:
        """A step's micro-batch losses (a device vector; its first `real` entries are the window's batches)."""
        self.pending.append((micro_losses, real))

    def take(self, nan_inf_filter: bool, nan_inf_policy: str) -> float:
        """The summed losses since the last log (reads the device once); the pending list starts again."""
        pending, self.pending = self.pending, []
        if not pending:
            return self.residue
        flat = np.asarray(jnp.concatenate([jnp.ravel(v) for v, _ in pending]))  # one transfer
        starts = np.cumsum([0] + [int(np.size(v)) for v, _ in pending])
        steps = [flat[start : start + real] for start, (_, real) in zip(starts, pending)]
        self.non_finite += int(sum(np.count_nonzero(~np.isfinite(step)) for step in steps))
        summed = summed_step_losses(steps, self.last_logged_step + 1, nan_inf_filter, nan_inf_policy, self.residue)
        self.residue = summed - summed
        return summed


@dataclasses.dataclass
class Throughput:
    """Tokens the loop has fed since the last log, for tokens per second and model FLOPs utilisation."""

    last_time: float = dataclasses.field(default_factory=time.perf_counter)
    tokens: int = 0
    sequence_length: int = 0
    flops_per_token: dict[int, float | None] = dataclasses.field(default_factory=dict)  # per sequence length

    def count(self, batch: data.Batch, main_input_name: str, process_count: int) -> None:
        main = batch.get(main_input_name)
        if main is not None and np.ndim(main) >= 2:
            self.tokens += int(np.size(main)) * process_count
            self.sequence_length = int(np.shape(main)[1])

    def take(self, model: Any) -> dict[str, float]:
        """Tokens per second since the last log (its losses were just read, so the device has caught up) and,
        where the device's peak is known, model FLOPs utilisation; the count starts again."""
        now = time.perf_counter()
        elapsed, tokens = now - self.last_time, self.tokens
        self.tokens, self.last_time = 0, now
        if not tokens or elapsed <= 0:
            return {}
        rate = tokens / elapsed
        logs = {"train_tokens_per_second": round(rate, 3)}
        length = self.sequence_length
        if length not in self.flops_per_token:
            self.flops_per_token[length] = throughput.flops_per_token(model, length)
        utilisation = throughput.mfu(rate, self.flops_per_token[length])
        if utilisation is not None:
            logs["train_mfu"] = round(utilisation, 4)
        return logs


@dataclasses.dataclass
class PreemptionNotice:
    """Set by SIGTERM (the preemption notice of TPU VMs and schedulers) while a train() call runs; in a run of
    several processes, `interrupted` by a first Ctrl-C (SIGINT), which the processes then obey together."""

    received: bool = False
    interrupted: bool = False

    def agreed_code(self) -> int:
        """What this process asks for after a step: 2 stop (an interrupt), 1 save and exit (a preemption), 0 go
        on; the processes follow the largest."""
        return 2 if self.interrupted else int(self.received)


@contextlib.contextmanager
def sigterm_notice() -> Iterator[PreemptionNotice]:
    """Turn SIGTERM (and, with several processes, a first SIGINT) into a notice the loop reads after each step
    (signals reach only the main thread)."""
    notice = PreemptionNotice()
    if threading.current_thread() is not threading.main_thread():
        yield notice
        return

    def on_sigterm(signum, frame):
        logger.warning("SIGTERM received: saving a checkpoint after the current step, then exiting.")
        notice.received = True

    previous = signal.signal(signal.SIGTERM, on_sigterm)
    previous_interrupt = signal.getsignal(signal.SIGINT)

    def on_interrupt(signum, frame):
        # Several processes: each raising KeyboardInterrupt wherever it stands would leave one in a step's
        # collectives while another waits at jax.distributed's shutdown barrier. They stop together after
        # the current step instead; a second Ctrl-C acts at once.
        logger.warning("Ctrl-C: every process stops after the current step (Ctrl-C again to stop at once).")
        notice.interrupted = True
        signal.signal(signal.SIGINT, previous_interrupt)

    if jax.process_count() > 1:
        signal.signal(signal.SIGINT, on_interrupt)
    try:
        yield notice
    finally:
        signal.signal(signal.SIGTERM, previous)
        signal.signal(signal.SIGINT, previous_interrupt)


@dataclasses.dataclass
class TrainingRun:
    """One train() loop: what its epochs share (HF passes these to _run_epoch one by one or keeps them on the
    Trainer) and what it accumulates between logs."""

    loader: data.BatchLoader
    shapes: data.ShapeKeeper
    train_step: Any  # the compiled step (jax.jit's wrapped function: call, .lower)
    updates_per_epoch: int
    ragged_tail: bool  # a ragged last batch runs at its own rows (Trainer._keeps_ragged_rows)
    label_classes: int | None  # the class count labels are checked against (Trainer._label_classes)
    epochs_trained: int = 0  # when resuming: whole epochs already done
    skip: int = 0  # when resuming: micro-batches of the resumed epoch already trained
    resumed_loop_state: LoopState | None = None  # when resuming: the checkpoint's loop state (its first epoch)
    epochs: int = 0
    steps_in_epoch: int = 0
    start_time: float = 0.0
    initial_global_step: int = 0  # the step it started (or resumed) from
    initial_num_input_tokens_seen: int = 0
    losses: LossLog = dataclasses.field(default_factory=lambda: LossLog(0))
    throughput: Throughput = dataclasses.field(default_factory=Throughput)
    preemption: PreemptionNotice = dataclasses.field(default_factory=PreemptionNotice)
    loop_state: LoopState | None = None  # the host side of the last step: what its checkpoint saves
    generators_after_step: Any = None  # HF's one host generator after the last step (its loader's look-ahead)
    # Batches prepared when each step runs (a random collator with evaluations during training: HF's order)
    step_by_step: bool = False
    read_ahead: bool = False  # whether the last step's epoch had a next batch (read ahead, as HF's loader)
    last_step_batch: Any = None  # the last step's StepBatch (the memory report compiles against its shapes)
    dispatched: Any = None  # the last dispatched step's losses (device arrays, maybe not computed yet)
    release_watch: host_allocator.ReleaseWatch = dataclasses.field(default_factory=host_allocator.ReleaseWatch)

    def saved_loop_state(self) -> LoopState | None:
        """What a checkpoint of this step keeps: the step's loop state; for a collator that draws nothing, with the
        training stream's state now (it moves only at the loader's own draws and the evaluations it follows)."""
        stream = self.loader.rng_stream
        if self.loop_state is None or stream is None:
            return self.loop_state
        if stream.drawn:  # step by step, the stream stands after the next batch and any evaluation since
            return (
                self.loop_state._replace(collator_rng_after_next=stream.state) if self.step_by_step else self.loop_state
            )
        return self.loop_state._replace(collator_rng=stream.state)

    def follow_device(self, step_losses: Any) -> None:
        """After dispatching a step: wait until the step before it has finished, so the host's step count (the
        callbacks, the progress bar and its ETA) runs at most one step ahead of the device, while the step just
        dispatched keeps the device busy. Where malloc keeps the CPU backend's freed memory
        (`host_allocator.heap_is_kept`), waits for the step just dispatched and for its working buffer to be
        back in the heap: two steps' buffers alive at once would stay in the heap for the rest of the run."""
        if host_allocator.heap_is_kept():
            jax.block_until_ready(step_losses)
            self.release_watch.wait()
            return
        previous, self.dispatched = self.dispatched, step_losses
        if previous is not None:
            jax.block_until_ready(previous)
