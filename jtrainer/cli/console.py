"""What the `jtrainer` command prints."""

from __future__ import annotations

import contextlib
import sys
import threading
import time
from collections.abc import Iterator


def say(message: str) -> None:
    """Print on the first process only (every process of a multi-host run executes the same job)."""
    import jax

    if jax.process_index() == 0:
        print(message)


@contextlib.contextmanager
def phase(message: str, interval_s: float = 1.0) -> Iterator[None]:
    """A long silent step (XLA compiling a big program) shown on stderr as the training bar is: on a terminal
    one line with the seconds so far, rewritten each `interval_s`; elsewhere (a log file) a line when it starts
    and one when it ends. First process only."""
    import jax

    if jax.process_index() != 0:
        yield
        return
    stream = sys.stderr
    live = stream.isatty()
    start = time.monotonic()
    done = threading.Event()

    def show(final: str = "") -> None:
        elapsed = f"{time.monotonic() - start:.0f} s"
        stream.write(f"\r{message} ... {elapsed}{final}" if live else f"{message}{final} ({elapsed})\n")
        stream.flush()

    def tick() -> None:
        while not done.wait(interval_s):
            show()

    if live:
        ticker = threading.Thread(target=tick, daemon=True)
        ticker.start()
    else:
        stream.write(f"{message} ...\n")
        stream.flush()
    try:
        yield
    finally:
        done.set()
        if live:
            ticker.join()
        show(final=" done\n" if live else ": done")
