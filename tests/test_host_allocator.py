"""The malloc settings that keep XLA's CPU temporaries mapped between steps (jtrainer.runtime.host_allocator)."""

import ast
import os
import platform
import statistics
import subprocess
import sys

import pytest

from jtrainer.runtime import host_allocator

JOB = os.path.join(os.path.dirname(__file__), "jobs", "page_fault_job.py")


@pytest.mark.parametrize(
    "env,expected",
    [
        ({"JAX_PLATFORMS": "cpu"}, True),
        ({"JAX_PLATFORMS": "cuda,cpu"}, False),
        ({"JAX_PLATFORMS": "tpu"}, False),
        ({"JAX_PLATFORMS": "cpu", "JTRAINER_TUNE_MALLOC": "0"}, False),
        ({"JAX_PLATFORMS": "cuda", "JTRAINER_TUNE_MALLOC": "1"}, True),
    ],
)
def test_tuned_only_where_jax_runs_on_cpu_unless_told(monkeypatch, env, expected):
    monkeypatch.delenv("JTRAINER_TUNE_MALLOC", raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert host_allocator.should_tune() is expected


def test_without_platforms_the_installed_plugins_decide(monkeypatch):
    monkeypatch.delenv("JAX_PLATFORMS", raising=False)
    monkeypatch.delenv("JTRAINER_TUNE_MALLOC", raising=False)
    monkeypatch.setattr(host_allocator, "_configured_platforms", lambda: "")
    monkeypatch.setattr(host_allocator, "accelerator_plugins_installed", lambda: True)
    assert not host_allocator.should_tune()
    monkeypatch.setattr(host_allocator, "accelerator_plugins_installed", lambda: False)
    assert host_allocator.should_tune()


def _faults_per_call(tuned: bool, **env) -> list[int]:
    run = subprocess.run(
        [sys.executable, JOB],
        env={**os.environ, "JAX_PLATFORMS": "cpu", **env},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    report = ast.literal_eval(run.stdout.strip().splitlines()[-1])
    assert report["tuned"] is tuned
    return report["faults"]


@pytest.mark.skipif(platform.system() != "Linux" or platform.libc_ver()[0] != "glibc", reason="glibc's mallopt")
def test_temporaries_stay_mapped_after_the_first_calls():
    tuned = _faults_per_call(True, JTRAINER_TUNE_MALLOC="auto")
    untouched = _faults_per_call(False, JTRAINER_TUNE_MALLOC="0")
    # 128 MB of temporaries = 32,768 pages: faulted in on every call unless malloc keeps them. (Kept, they
    # are still faulted in now and then, when the heap's free space is too fragmented to hold them: a few
    # calls in 24 on a loaded machine, hence the median over many calls.)
    assert statistics.median(untouched[2:]) > 20_000, untouched
    assert statistics.median(tuned[2:]) < 2_000, tuned
