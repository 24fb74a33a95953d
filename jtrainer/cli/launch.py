"""`jtrainer launch`: N processes of one program on this machine, joined by jax.distributed.

Each process gets `JTRAINER_COORDINATOR` / `JTRAINER_NUM_PROCESSES` / `JTRAINER_PROCESS_ID` (read by
`jtrainer.initialize()` in each process) and, with `--devices_per_process K`, K simulated CPU devices. The launcher
supervises: when one process fails, the others are stopped and the launcher exits with its code (128 + N for a
process killed by signal N, as a shell reports it). SIGTERM or SIGINT to the launcher is passed on to every
process (a preemption: each saves the current step's checkpoint) and the launcher exits when they have; if the
launcher itself is killed, the processes get SIGTERM from the kernel, so none trains on as an orphan.
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
import time

from jtrainer.core import env as settings

GRACE_S = 10.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def command_for(target: str, extra: list[str]) -> list[str]:
    if target.endswith((".yaml", ".yml", ".json")):
        return [sys.executable, "-m", "jtrainer.cli", "train", target, *extra]
    if target.endswith(".py"):
        return [sys.executable, target, *extra]
    raise SystemExit(f"jtrainer launch: {target!r} is neither a .py script nor a .yaml/.json config.")


def process_env(process_id: int, num_processes: int, port: int, devices_per_process: int | None) -> dict[str, str]:
    env = dict(os.environ)
    env.update(
        {
            settings.COORDINATOR.name: f"127.0.0.1:{port}",
            settings.NUM_PROCESSES.name: str(num_processes),
            settings.PROCESS_ID.name: str(process_id),
            settings.LOCAL_PROCESS_ID.name: str(process_id),
        }
    )
    if devices_per_process:
        env["JAX_PLATFORMS"] = "cpu"
        flags = [f for f in env.get("XLA_FLAGS", "").split() if "xla_force_host_platform_device_count" not in f]
        env["XLA_FLAGS"] = " ".join(flags + [f"--xla_force_host_platform_device_count={devices_per_process}"])
    return env


def _child_setup() -> None:
    """In the child, before exec: a process group of its own, so a terminal's Ctrl-C reaches it once, through
    the launcher; and SIGTERM when the launcher dies, however it dies (Linux's PR_SET_PDEATHSIG)."""
    import ctypes

    os.setpgrp()
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG = 1
    except (OSError, AttributeError):  # not Linux: the launcher's own handlers still forward signals
        pass


def exit_code(returncode: int) -> int:
    """A child's exit status as a shell gives it: 128 + N for a process killed by signal N."""
    return 128 - returncode if returncode < 0 else returncode


def _describe(index: int, returncode: int) -> str:
    if returncode < 0:
        return f"process {index} was killed by {signal.Signals(-returncode).name}"
    return f"process {index} exited with code {returncode}"


class _Forwarded(Exception):
    """A signal the launcher received and passed on to its processes."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)


def _stop(processes: list[subprocess.Popen]) -> None:
    for p in processes:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + GRACE_S
    for p in processes:
        try:
            p.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()


def launch(target: str, extra: list[str], num_processes: int, devices_per_process: int | None = None) -> int:
    """Run and supervise the processes; the exit code is the first failure's, else 0."""
    if num_processes < 1:
        raise SystemExit(f"jtrainer launch: --num_processes must be >= 1, got {num_processes}.")
    port = free_port()
    cmd = command_for(target, extra)
    processes: list[subprocess.Popen] = []

    def forward(signum, frame):
        for p in processes:
            if p.poll() is None:
                p.send_signal(signum)
        raise _Forwarded(signum)

    previous = {s: signal.signal(s, forward) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        for i in range(num_processes):
            processes.append(
                subprocess.Popen(
                    cmd, env=process_env(i, num_processes, port, devices_per_process), preexec_fn=_child_setup
                )
            )
        return _supervise(processes)
    except _Forwarded as received:
        for s, handler in previous.items():
            signal.signal(s, handler)  # a second signal acts at once
        print(f"jtrainer launch: {received} passed on to the processes; waiting for them to stop.", file=sys.stderr)
        codes = [exit_code(p.wait()) for p in processes]
        return next((c for c in codes if c != 0), 0)
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
        _stop(processes)


def _supervise(processes: list[subprocess.Popen]) -> int:
    while True:
        codes = [p.poll() for p in processes]
        failed = [(i, c) for i, c in enumerate(codes) if c not in (None, 0)]
        if failed:
            index, code = failed[0]
            print(f"jtrainer launch: {_describe(index, code)}; stopping the others.", file=sys.stderr)
            _stop(processes)
            return exit_code(code)
        if all(c == 0 for c in codes):
            return 0
        time.sleep(0.2)


def launch_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="jtrainer launch", description="Run N processes of one job here.")
    parser.add_argument("--num_processes", type=int, required=True)
    parser.add_argument("--devices_per_process", type=int, default=None, help="simulated CPU devices each")
    parser.add_argument("target", help="a .py script or a .yaml config for `jtrainer train`")
    parser.add_argument("args", nargs=argparse.REMAINDER, help="passed on to the script or to `jtrainer train`")
    return parser


def run_launch(argv: list[str]) -> int:
    ns = launch_parser().parse_args(argv)
    return launch(ns.target, ns.args, ns.num_processes, ns.devices_per_process)
