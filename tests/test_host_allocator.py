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


class _Heap:
    """A heap whose in-use bytes follow a script of readings (the last one repeats)."""

    def __init__(self, *readings_mb):
        self.readings = [r << 20 for r in readings_mb]
        self.read = 0

    def __call__(self):
        self.read += 1
        return self.readings.pop(0) if len(self.readings) > 1 else self.readings[0]


def test_the_watch_waits_for_the_step_buffer_to_come_back(monkeypatch):
    monkeypatch.setattr(host_allocator, "heap_in_use", _Heap(900, 600, 580, 580))
    watch = host_allocator.ReleaseWatch(timeout_s=0.05)
    watch.wait()  # the first step: the lowest level seen while its buffer goes back
    assert watch.settled == 580 << 20
    heap = _Heap(900, 900, 585, 300)
    monkeypatch.setattr(host_allocator, "heap_in_use", heap)
    watch.wait()  # waits until the 320 MB are back, no longer
    assert heap.read == 3 and watch.settled == 580 << 20
    heap = _Heap(590)
    monkeypatch.setattr(host_allocator, "heap_in_use", heap)
    watch.wait()  # within the slack: no wait
    assert heap.read == 1 and watch.settled == 580 << 20
    monkeypatch.setattr(host_allocator, "heap_in_use", _Heap(700))
    watch.wait()  # nothing comes back: what the loop holds now is the level to come back to
    assert watch.settled == 700 << 20


def test_where_the_heap_is_kept_the_loop_runs_one_step_at_a_time(monkeypatch):
    from jtrainer.trainer.training_run import TrainingRun

    waited, blocked = [], []
    run = TrainingRun.__new__(TrainingRun)  # only its stepping
    run.dispatched, run.release_watch = None, host_allocator.ReleaseWatch()
    monkeypatch.setattr(run.release_watch, "wait", lambda: waited.append(True))
    monkeypatch.setattr("jax.block_until_ready", lambda x: blocked.append(x))
    monkeypatch.setattr(host_allocator, "heap_is_kept", lambda: True)
    run.follow_device("step 1")
    assert blocked == ["step 1"] and waited == [True] and run.dispatched is None
    monkeypatch.setattr(host_allocator, "heap_is_kept", lambda: False)
    run.follow_device("step 2")  # one step ahead: waits for the step before it only
    run.follow_device("step 3")
    assert blocked == ["step 1", "step 2"] and run.dispatched == "step 3"


@pytest.mark.skipif(platform.system() != "Linux" or platform.libc_ver()[0] != "glibc", reason="glibc's mallinfo2")
def test_heap_in_use_counts_an_allocation():
    import numpy as np

    before = host_allocator.heap_in_use()
    block = np.ones(64 << 20, np.uint8)  # numpy allocates with malloc
    assert host_allocator.heap_in_use() - before >= 60 << 20
    del block
