"""Keep XLA's CPU working memory mapped between steps (glibc malloc settings, applied at import).

On the CPU backend every execution of a compiled step allocates its temporaries as one buffer (a few hundred
MB for a small Llama) and frees it at the end. glibc serves such a request from a fresh `mmap` and returns it
with `munmap`, so each step page-faults the whole buffer in again: for the benchmark's small Llama that is
~90,000 page faults and ~0.2 s of kernel time per 0.5 s step. With one malloc arena, no mmap-served chunks
and a high trim threshold, the buffer comes from the heap and stays mapped: no faults after the first two
steps, except now and then when the heap's free space is too fragmented to hold it.

Applied by `jtrainer.initialize()` when JAX will run on CPU (JAX_PLATFORMS / jax_platforms say cpu, or no
accelerator plugin is installed), because it only takes effect for threads that have not allocated yet: XLA's
worker threads start when the backend first runs something. $JTRAINER_TUNE_MALLOC=0 leaves malloc alone,
=1 applies it on any backend. The cost: memory freed by the process is kept for reuse rather than returned
to the system (up to 2 GiB at the top of the heap), and all threads share one malloc arena, whose lock
makes very short steps slower (~3 ms on the benchmark's ~16 ms tiny step).

A kept heap holds as many working buffers as were ever alive at once, and XLA frees a step's buffer on its
worker thread just after the step's outputs are ready: a step dispatched while the one before runs, or in that
instant after it, takes a second (and, once small allocations have split the freed one, a third) buffer for
good. So with the tuned heap the training loop runs one step at a time and, before the next, waits the moment
until the heap's in-use bytes are back where the last step left them (`ReleaseWatch`): the small Llama's peak
memory is one working buffer, not three.
"""

from __future__ import annotations

import ctypes
import dataclasses
import importlib.util
import os
import pkgutil
import platform
import time

import jax

from jtrainer.core import env

# mallopt parameters from glibc's malloc.h
_M_TRIM_THRESHOLD, _M_MMAP_MAX, _M_ARENA_MAX = -1, -4, -8
SETTINGS = ((_M_ARENA_MAX, 1), (_M_MMAP_MAX, 0), (_M_TRIM_THRESHOLD, 2**31 - 1))


def accelerator_plugins_installed() -> bool:
    """Whether JAX could find a TPU or GPU backend here (checked without initialising any backend)."""
    if importlib.util.find_spec("libtpu") is not None:
        return True
    try:
        import jax_plugins
    except ImportError:
        return False
    return any(True for _ in pkgutil.iter_modules(jax_plugins.__path__))


def _configured_platforms() -> str:
    return os.environ.get("JAX_PLATFORMS") or getattr(jax.config, "jax_platforms") or ""


def cpu_is_the_backend() -> bool:
    platforms = _configured_platforms()
    if platforms.strip():
        return platforms.split(",")[0].strip().lower() == "cpu"
    return not accelerator_plugins_installed()


def should_tune() -> bool:
    setting = env.TUNE_MALLOC.text().strip().lower()
    if setting in ("0", "false", "off", "no"):
        return False
    return setting in ("1", "true", "on", "yes") or cpu_is_the_backend()


def _glibc_function(name: str):
    """A function of this process's C library where it is glibc on Linux (None elsewhere or where missing)."""
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return None
    return getattr(ctypes.CDLL(None), name, None)


def tune_malloc() -> bool:
    """Apply `SETTINGS` with glibc's mallopt; False where the C library is not glibc or refuses one."""
    mallopt = _glibc_function("mallopt")
    if mallopt is None:
        return False
    mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    return all([mallopt(param, value) == 1 for param, value in SETTINGS])  # a list: apply every setting


_tuned = False  # a fact about the process: set once by apply_default


def apply_default() -> bool:
    """Tune malloc when `should_tune()` (called by `jtrainer.initialize()`); returns whether it was applied."""
    global _tuned
    _tuned = _tuned or (should_tune() and tune_malloc())
    return _tuned


def heap_is_kept() -> bool:
    """Whether this process's malloc keeps freed memory (`apply_default` tuned it): steps then run one at a time."""
    return _tuned


class _MallInfo2(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in "arena ordblks smblks hblks hblkhd usmblks fsmblks uordblks fordblks keepcost".split()
    ]


def _mallinfo2():
    """glibc's mallinfo2 (2.33 and later), or None."""
    function = _glibc_function("mallinfo2")
    if function is not None:
        function.restype = _MallInfo2
    return function


_MALLINFO2 = _mallinfo2()


def heap_in_use() -> int | None:
    """Bytes malloc has handed out and not taken back (its arenas and its own mmaps), or None where unknown."""
    if _MALLINFO2 is None:
        return None
    info = _MALLINFO2()
    return int(info.uordblks + info.hblkhd)


@dataclasses.dataclass
class ReleaseWatch:
    """After a step's outputs are ready, waits (at most `timeout_s`) until the heap's in-use bytes are within
    `slack_bytes` of where the steps before left them, so the step's working buffer is back in the heap before
    the next step takes one. A timeout means memory in use really grew (what the loop keeps): the new level is
    the one to come back to."""

    slack_bytes: int = 16 << 20
    timeout_s: float = 0.005
    settled: int | None = None

    def wait(self) -> None:
        used = heap_in_use()
        if used is None:
            return
        deadline = time.perf_counter() + self.timeout_s
        if self.settled is None:  # the first step: its level is the lowest seen while its buffer goes back
            lowest = used
            while time.perf_counter() < deadline:
                time.sleep(50e-6)
                lowest = min(lowest, heap_in_use() or lowest)
            self.settled = lowest
            return
        while used > self.settled + self.slack_bytes:
            if time.perf_counter() > deadline:
                self.settled = used  # not a buffer on its way back: what the loop now holds
                return
            time.sleep(50e-6)
            used = heap_in_use() or used
        self.settled = min(self.settled, used)
