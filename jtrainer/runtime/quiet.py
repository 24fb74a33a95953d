"""A quiet start for the `jtrainer` command: the libraries' import and plugin chatter off the terminal, their real
warnings on it.

On a machine with no accelerator, an installed libtpu prints pages about TPU hosts it cannot find and the CUDA
plugin a traceback about drivers, each time JAX brings its backends up; jaxlib's CUDA modules print absl's
"Could not find cuda drivers" as they load; bitsandbytes (through peft) warns about a CPU kernel download that
training never uses. `choose_platforms` keeps JAX on the CPU when nothing else is attached, so no plugin tries;
`filtered_stderr` drops the known lines written while jax is imported and its backend comes up, and passes every
other line on.
"""

from __future__ import annotations

import contextlib
import glob
import logging
import os
import re
import sys
import threading
from collections.abc import Iterator

# Lines that say nothing to a jtrainer user (the CUDA plugin loading on a machine with no GPU; absl's notice that
# it logs to stderr before being initialised, which precedes each of those lines).
NOISE = re.compile(
    "|".join(
        [
            r"WARNING: All log messages before absl::InitializeLog\(\) is called are written to STDERR",
            r"WARNING: Logging before InitGoogle\(\) is written to STDERR",
            r"I\d{4} [\d:.]+ +\d+ cudart_stub\.cc:\d+\] Could not find cuda drivers on your machine, GPU will not be "
            r"used\.",
        ]
    )
)
# Device files of the accelerators JAX's plugins drive: TPU chips (/dev/accel*, /dev/vfio on newer TPU VMs),
# NVIDIA and AMD GPUs.
ACCELERATOR_DEVICES = ("/dev/accel*", "/dev/vfio/[0-9]*", "/dev/nvidia[0-9]*", "/dev/nvidiactl", "/dev/kfd")


def accelerator_attached() -> bool:
    return any(glob.glob(pattern) for pattern in ACCELERATOR_DEVICES)


def choose_platforms() -> None:
    """JAX on the CPU when no accelerator is attached and no platform is chosen (JAX_PLATFORMS): an installed
    libtpu or CUDA plugin then never tries to bring up hardware that is not there."""
    if not os.environ.get("JAX_PLATFORMS") and not accelerator_attached():
        os.environ["JAX_PLATFORMS"] = "cpu"


@contextlib.contextmanager
def filtered_stderr() -> Iterator[None]:
    """Everything written to file descriptor 2 inside (C++ libraries' logs too) is held and, on leaving, written
    out but the NOISE lines. Keep it short (imports, a backend's start): nothing appears until it ends."""
    sys.stderr.flush()
    saved = os.dup(2)
    read, write = os.pipe()
    os.dup2(write, 2)
    os.close(write)
    chunks: list[bytes] = []

    def drain() -> None:
        while chunk := os.read(read, 65536):
            chunks.append(chunk)

    reader = threading.Thread(target=drain, daemon=True)
    reader.start()
    try:
        yield
    finally:
        sys.stderr.flush()
        os.dup2(saved, 2)  # closes the pipe's write end: the reader sees its end
        os.close(saved)
        reader.join(timeout=10)  # (a child process started inside would hold the write end open)
        if not reader.is_alive():
            os.close(read)
        kept = [line for line in b"".join(chunks).decode(errors="replace").splitlines(True) if not NOISE.search(line)]
        if kept:
            sys.stderr.write("".join(kept))
            sys.stderr.flush()


class KernelHubNotice(logging.Filter):
    """bitsandbytes' warning that its CPU 4-bit kernel could not be fetched from the kernel hub (it falls back
    to its own; jtrainer's steps never run it)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "from kernels-community" not in record.getMessage()


_KERNEL_HUB_NOTICE = KernelHubNotice()


def silence_kernel_hub_notice() -> None:
    """Once per process however often the command runs in it (logging adds a filter it already has once)."""
    logging.getLogger("bitsandbytes.backends.cpu.ops").addFilter(_KERNEL_HUB_NOTICE)
