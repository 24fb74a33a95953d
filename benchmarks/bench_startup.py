"""How long the `jtrainer` command and `import jtrainer` take to start, beside `import jax`, and which of torch,
peft, accelerate and bitsandbytes they load.

    python benchmarks/bench_startup.py                              # this interpreter, 5 repeats
    python benchmarks/bench_startup.py --python /path/to/venv-without-torch/bin/python --repeats 3

Each measurement is a fresh process (nothing warm but the OS's file cache; one unmeasured run first). Printed per
interpreter: the median wall time of each command, its ratio to `import jax` and the difference, and the
torch-side packages it imported. The target: `jtrainer --help` under 2 s over `import jax`, none of those
packages loaded by any of them.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time

TORCH_SIDE = ("torch", "peft", "accelerate", "bitsandbytes", "torchax")
REPORT = "import sys; print('loaded:', ' '.join(sorted({m.split('.')[0] for m in sys.modules} & set(%r))))" % (
    TORCH_SIDE,
)

COMMANDS = {
    "import jax": ["-c", "import jax; " + REPORT],
    "import jtrainer": ["-c", "import jtrainer; " + REPORT],
    "from jtrainer import Trainer": ["-c", "from jtrainer import Trainer, TrainingArguments; " + REPORT],
    "jtrainer --help": ["-c", "import sys; from jtrainer.cli import main; main(['--help']); " + REPORT],
    "jtrainer train --help": [
        "-c",
        "import sys\nfrom jtrainer.cli import main\ntry:\n    main(['train', '--help'])\nexcept SystemExit:\n    pass\n"
        + REPORT,
    ],
}


def _time(python: str, argv: list[str]) -> tuple[float, str]:
    env = {k: v for k, v in os.environ.items() if k != "JAX_PLATFORMS"}  # as a user's shell
    start = time.perf_counter()
    done = subprocess.run([python, *argv], capture_output=True, text=True, env=env, check=True)
    elapsed = time.perf_counter() - start
    loaded = [line for line in done.stdout.splitlines() if line.startswith("loaded:")]
    return elapsed, loaded[-1].removeprefix("loaded:").strip() if loaded else "?"


def measure(python: str, repeats: int) -> None:
    has_torch = subprocess.run([python, "-c", "import torch"], capture_output=True).returncode == 0
    print(f"{python} (torch {'installed' if has_torch else 'not installed'})")
    medians = {}
    for name, argv in COMMANDS.items():
        _time(python, argv)  # warm the file cache
        runs = [_time(python, argv) for _ in range(repeats)]
        medians[name] = statistics.median(t for t, _ in runs)
        loaded = runs[-1][1]
        base = medians["import jax"]
        print(
            f"  {name:<30} {medians[name]:6.2f} s   x{medians[name] / base:4.2f} of import jax   "
            f"{medians[name] - base:+5.2f} s   loads: {loaded or 'none of ' + ', '.join(TORCH_SIDE)}"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--python", nargs="+", default=[sys.executable], help="interpreters to measure")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    for python in args.python:
        measure(python, args.repeats)


if __name__ == "__main__":
    main()
