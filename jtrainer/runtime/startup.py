"""Start-up: the process-wide effects jtrainer needs, in one explicit function, `jtrainer.initialize()`.

Importing jtrainer changes nothing outside it. `initialize()` does three things, once per process:
1. joins the other processes of a multi-host job (`jtrainer.parallel.distributed.maybe_initialize`: `jtrainer launch`'s
   variables, Cloud TPU VMs, SLURM) — this has to happen before JAX touches a device;
2. tunes glibc's malloc when JAX runs on CPU (`jtrainer.runtime.host_allocator`; $JTRAINER_TUNE_MALLOC=0 opts out);
3. turns on JAX's persistent compilation cache (below; $JTRAINER_COMPILATION_CACHE_DIR=none opts out).

`TrainingArguments(...)` calls it — the point where HF's TrainingArguments sets up its distributed state —, and so
do jtrainer's models' `from_config` / `from_pretrained`, `Trainer(...)` and the `jtrainer` command: whichever
comes first in a script, before it touches a device. A script that touches devices before any of these (its own
flax module, jax arrays) calls `jtrainer.initialize()` at its top.

The compilation cache: a second run of the same job (same model, shapes, mesh and jax version) loads its
compiled steps from disk instead of compiling them. The directory is `TrainingArguments.jax_compilation_cache_dir`,
else $JTRAINER_COMPILATION_CACHE_DIR, else ~/.cache/jtrainer/jax_compilation_cache; "none" turns the cache off.
The default is applied by `initialize()`; a run's own directory when it starts training.
"""

from __future__ import annotations

import jax

from jtrainer.core import env
from jtrainer.parallel import distributed
from jtrainer.runtime import host_allocator

OFF = ("none", "off", "")


def default_cache_dir() -> str | None:
    value = env.COMPILATION_CACHE_DIR.text()
    return None if value.lower() in OFF else value


def enable_compilation_cache(directory: str | None) -> None:
    """Point JAX's persistent compilation cache at `directory`; None turns it off."""
    if getattr(jax.config, "jax_compilation_cache_dir") == directory:
        return
    jax.config.update("jax_compilation_cache_dir", directory)
    # Cache train steps however quickly they compiled: small models on CPU compile in well under a second.
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    try:  # the cache is set up at the first compile; if that already happened, set it up again
        from jax._src import compilation_cache

        compilation_cache.reset_cache()
    except (ImportError, AttributeError):
        pass


def run_cache_dir(args) -> str | None:
    """The directory a run uses: its own field, else the default; None when turned off."""
    value = getattr(args, "jax_compilation_cache_dir", None)
    if value is None:
        return default_cache_dir()
    return None if str(value).lower() in OFF else str(value)


def apply_default_cache() -> None:
    """Turn the default cache on unless the user configured JAX's cache themselves."""
    directory = default_cache_dir()
    if getattr(jax.config, "jax_compilation_cache_dir") is None and directory is not None:
        enable_compilation_cache(directory)


_initialized = False  # a fact about the process: its malloc, its jax.distributed client, JAX's config


def initialize() -> None:
    """jtrainer's start-up effects (see the module's docstring); later calls do nothing."""
    global _initialized
    if _initialized:
        return
    try:
        distributed.maybe_initialize()  # first: nothing before it may touch a device
    except RuntimeError as e:
        if "before any JAX" not in str(e):
            raise
        raise RuntimeError(
            "jtrainer.initialize(): this process is one of a multi-host job, but JAX already used a device: call "
            "jtrainer.initialize() (or create the TrainingArguments) before building the model or any array."
        ) from e
    _initialized = True
    host_allocator.apply_default()  # before XLA's CPU threads first allocate
    apply_default_cache()
