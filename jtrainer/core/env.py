"""Every environment variable jtrainer reads, and what it does. Each is read when it is needed (not at import), so a
launcher or a test may set it first; nothing else in the package reads `os.environ` for jtrainer's own settings.

- `JTRAINER_COMPILATION_CACHE_DIR` (default `~/.cache/jtrainer/jax_compilation_cache`): JAX's persistent
  compilation cache folder; `none` / `off` turns it off (`TrainingArguments.jax_compilation_cache_dir` wins).
- `JTRAINER_DEVICE_MEMORY_BYTES` (default: the device's own): the per-device memory budget of
  `auto_find_batch_size` and `jtrainer check` (to leave headroom).
- `JTRAINER_TUNE_MALLOC` (default `auto`): glibc malloc settings for XLA's CPU buffers: `auto` (on when the CPU
  is the backend), `1` or `0`.
- `JTRAINER_ATTENTION` (default `auto`): the attention kernel: `auto` (splash attention on TPUs, cuDNN for
  bf16/fp16 on GPUs, else XLA's or the CPU formulation), `xla`, `cudnn` or `splash` (Pallas' interpret mode
  off TPUs: for tests).
- `JTRAINER_COORDINATOR`, `JTRAINER_NUM_PROCESSES`, `JTRAINER_PROCESS_ID` (default unset): join
  `jax.distributed` as one process of many (`jtrainer launch` sets them).
- `JTRAINER_LOCAL_PROCESS_ID` (default `0`): this process's index on its machine
  (`TrainingArguments.local_process_index`; set by `jtrainer launch`).
- `JTRAINER_HEARTBEAT_TIMEOUT` (default `20`): seconds a silent peer process is waited for before the others fail.
- `JTRAINER_BRIDGE_TRACEBACK` (default `0`): `1` shows the original JAX / torchax traceback behind the bridge's
  one-line error for torch code that cannot run inside the compiled step.
- `JTRAINER_STORAGE_TIMEOUT` (default `30`): seconds `jtrainer train|check` waits for the first answer of a
  gs:// or s3:// service its config names before refusing the job in one line.

Variables of other programs jtrainer honours: `JAX_PLATFORMS`, `XLA_FLAGS`, `TPU_WORKER_HOSTNAMES` and SLURM's
(cluster detection), `HF_HUB_OFFLINE` (as transformers), `TRANSFORMERS_NO_ADVISORY_WARNINGS` (set when torch is
absent).
"""

from __future__ import annotations

import dataclasses
import os


@dataclasses.dataclass(frozen=True)
class Setting:
    """One environment variable: its name, its default (None: unset) and what it does."""

    name: str
    default: str | None
    doc: str

    def get(self) -> str | None:
        """The value now (the default when unset)."""
        return os.environ.get(self.name, self.default)

    def text(self) -> str:
        """The value now, "" when unset and without a default."""
        return self.get() or ""

    def get_int(self) -> int | None:
        """The value as an integer (None when unset or empty)."""
        value = self.get()
        if not value:
            return None
        try:
            return int(value)
        except ValueError:
            raise ValueError(f"{self.name}={value!r} must be an integer ({self.doc}).") from None


COMPILATION_CACHE_DIR = Setting(
    "JTRAINER_COMPILATION_CACHE_DIR",
    os.path.join(os.path.expanduser("~"), ".cache", "jtrainer", "jax_compilation_cache"),
    "JAX's persistent compilation cache folder; none/off turns it off",
)
DEVICE_MEMORY_BYTES = Setting(
    "JTRAINER_DEVICE_MEMORY_BYTES", None, "the per-device memory budget of auto_find_batch_size and jtrainer check"
)
TUNE_MALLOC = Setting("JTRAINER_TUNE_MALLOC", "auto", "glibc malloc settings for XLA's CPU buffers: auto, 1 or 0")
ATTENTION = Setting("JTRAINER_ATTENTION", "auto", "the attention kernel: auto, xla, cudnn or splash")
COORDINATOR = Setting("JTRAINER_COORDINATOR", None, "the jax.distributed coordinator address (host:port)")
NUM_PROCESSES = Setting("JTRAINER_NUM_PROCESSES", None, "the number of processes joining jax.distributed")
PROCESS_ID = Setting("JTRAINER_PROCESS_ID", None, "this process's index among them")
LOCAL_PROCESS_ID = Setting("JTRAINER_LOCAL_PROCESS_ID", "0", "this process's index on its machine")
HEARTBEAT_TIMEOUT = Setting("JTRAINER_HEARTBEAT_TIMEOUT", "20", "seconds a silent peer is waited for")
STORAGE_TIMEOUT = Setting("JTRAINER_STORAGE_TIMEOUT", "30", "seconds the first answer of an object store is waited for")
BRIDGE_TRACEBACK = Setting("JTRAINER_BRIDGE_TRACEBACK", "0", "1: the original traceback of untraceable torch code")

ALL = (
    COMPILATION_CACHE_DIR,
    DEVICE_MEMORY_BYTES,
    TUNE_MALLOC,
    ATTENTION,
    COORDINATOR,
    NUM_PROCESSES,
    PROCESS_ID,
    LOCAL_PROCESS_ID,
    HEARTBEAT_TIMEOUT,
    STORAGE_TIMEOUT,
    BRIDGE_TRACEBACK,
)
