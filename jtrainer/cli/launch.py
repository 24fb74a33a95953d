"""`jtrainer launch`: N processes of one program on this machine, joined by jax.distributed.

Each process gets `JTRAINER_COORDINATOR` / `JTRAINER_NUM_PROCESSES` / `JTRAINER_PROCESS_ID` (read by
`jtrainer.distributed` at import) and, with `--devices_per_process K`, K simulated CPU devices. The launcher
supervises: when one process fails, the others are stopped and the launcher exits with its code.
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
import time

from jtrainer import env as settings

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
    processes = [
        subprocess.Popen(cmd, env=process_env(i, num_processes, port, devices_per_process))
        for i in range(num_processes)
    ]
    try:
        while True:
            codes = [p.poll() for p in processes]
            failed = [c for c in codes if c not in (None, 0)]
            if failed:
                print(f"jtrainer launch: a process exited with code {failed[0]}; stopping the others.", file=sys.stderr)
                _stop(processes)
                return failed[0]
            if all(c == 0 for c in codes):
                return 0
            time.sleep(0.2)
    except KeyboardInterrupt:
        _stop(processes)
        return 130


def run_launch(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="jtrainer launch", description="Run N processes of one job here.")
    parser.add_argument("--num_processes", type=int, required=True)
    parser.add_argument("--devices_per_process", type=int, default=None, help="simulated CPU devices each")
    parser.add_argument("target", help="a .py script or a .yaml config for `jtrainer train`")
    parser.add_argument("args", nargs=argparse.REMAINDER, help="passed on to the script or to `jtrainer train`")
    ns = parser.parse_args(argv)
    return launch(ns.target, ns.args, ns.num_processes, ns.devices_per_process)
