"""Fast starts: JAX's persistent compilation cache, on by default.

A second run of the same job (same model, shapes, mesh and jax version) loads its compiled steps from disk
instead of compiling them. The directory is `TrainingArguments.jax_compilation_cache_dir`, else
$JTRAINER_COMPILATION_CACHE_DIR, else ~/.cache/jtrainer/jax_compilation_cache; "none" turns the cache off.
The default is applied when jtrainer is imported, before anything compiles; a run's own directory is applied
when it starts training.
"""

from __future__ import annotations

import jax

from jtrainer import env

OFF = ("none", "off", "")


def default_cache_dir() -> str | None:
    value = env.COMPILATION_CACHE_DIR.get()
    return None if value.lower() in OFF else value


def enable_compilation_cache(directory: str | None) -> None:
    """Point JAX's persistent compilation cache at `directory`; None turns it off."""
    if jax.config.jax_compilation_cache_dir == directory:
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


def apply_default() -> None:
    """At import: turn the default cache on unless the user configured JAX's cache themselves."""
    if jax.config.jax_compilation_cache_dir is None and default_cache_dir() is not None:
        enable_compilation_cache(default_cache_dir())
