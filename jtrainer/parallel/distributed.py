"""Many hosts, one program: `jax.distributed` start-up and the few host-level agreements the loop needs.

Start-up happens in `jtrainer.initialize()` (TrainingArguments, Trainer and the CLI call it), before any device is
touched:
- `JTRAINER_COORDINATOR`, `JTRAINER_NUM_PROCESSES`, `JTRAINER_PROCESS_ID` (set by `jtrainer launch`, or by you
  on any cluster) -> explicit initialisation; on CPU, gloo collectives;
- on Cloud TPU VMs (`TPU_WORKER_HOSTNAMES` with several workers) and SLURM jobs of several tasks ->
  `jax.distributed.initialize()` with JAX's own cluster detection.
"""

from __future__ import annotations

import os

import jax
import numpy as np

from jtrainer.core import env


def _cluster_detected() -> bool:
    tpu_hosts = os.environ.get("TPU_WORKER_HOSTNAMES", "")
    if len([h for h in tpu_hosts.split(",") if h]) > 1:
        return True
    return int(os.environ.get("SLURM_NTASKS", "1")) > 1 and "SLURM_JOB_ID" in os.environ


def maybe_initialize() -> bool:
    """Initialise jax.distributed from the environment when this is one process of many; True if it did."""
    if jax.distributed.is_initialized():
        return False
    if env.COORDINATOR.get():
        if os.environ.get("JAX_PLATFORMS", "").startswith("cpu"):
            jax.config.update("jax_cpu_collectives_implementation", "gloo")
        jax.distributed.initialize(
            coordinator_address=env.COORDINATOR.get(),
            num_processes=env.NUM_PROCESSES.get_int(),
            process_id=env.PROCESS_ID.get_int(),
            # A peer that stops answering for this long makes the others fail instead of waiting forever.
            heartbeat_timeout_seconds=env.HEARTBEAT_TIMEOUT.get_int() or 20,
            shutdown_timeout_seconds=env.HEARTBEAT_TIMEOUT.get_int() or 20,
            initialization_timeout=120,
        )
        return True
    if _cluster_detected():
        jax.distributed.initialize()
        return True
    return False


def agree_max(value: int) -> int:
    """The largest of one integer across processes (the value itself on one process)."""
    if jax.process_count() == 1:
        return value
    from jax.experimental import multihost_utils

    return int(np.max(multihost_utils.process_allgather(np.asarray(value, np.int64))))


def agree_sum(value: float) -> float:
    """The sum of one number across processes."""
    if jax.process_count() == 1:
        return value
    from jax.experimental import multihost_utils

    return float(np.sum(multihost_utils.process_allgather(np.asarray(value, np.float64))))


def gather_rows(x) -> np.ndarray:
    """A global jax.Array or this process's numpy rows -> every row, on every process, in global order."""
    if jax.process_count() == 1:
        return np.asarray(jax.device_get(x))
    from jax.experimental import multihost_utils

    return np.asarray(multihost_utils.process_allgather(x, tiled=True))
