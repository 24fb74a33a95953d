"""What the `jtrainer` command prints."""

from __future__ import annotations


def say(message: str) -> None:
    """Print on the first process only (every process of a multi-host run executes the same job)."""
    import jax

    if jax.process_index() == 0:
        print(message)
