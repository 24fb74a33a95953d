"""`jtrainer train` in a process of its own that lingers in one phase outside Trainer.train(), for the signal
tests: it touches MARKER on entering the phase, then waits there (up to a minute) for the test's signal.

    python tests/jobs/cli_job.py data|after MARKER [jtrainer train arguments ...]
data: while the data is read and the tokenizer trained; after: after the last step, in the final evaluation.
"""

import os
import sys
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")


def _lingering(function, marker):
    def wrapped(*args, **kwargs):
        open(marker, "w").close()
        time.sleep(60)
        return function(*args, **kwargs)

    return wrapped


def main(phase: str, marker: str, argv: list[str]) -> int:
    import jtrainer
    from jtrainer.cli import main as jtrainer_main
    from jtrainer.cli import tasks

    if phase == "data":
        tasks.build_data = _lingering(tasks.build_data, marker)
    else:
        jtrainer.Trainer.evaluate = _lingering(jtrainer.Trainer.evaluate, marker)
    return jtrainer_main(["train", *argv])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2], sys.argv[3:]))
