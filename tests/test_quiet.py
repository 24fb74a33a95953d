"""A quiet start: with libtpu, the CUDA plugin, peft and bitsandbytes installed (the test extras) on a machine
with neither a TPU nor a GPU, a refused command prints its one line and nothing else; a real warning written
while the libraries load still shows."""

import os
import subprocess
import sys

from jtrainer.runtime import quiet


def _command(tmp_path, *argv: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("JAX_PLATFORMS", "XLA_FLAGS")}  # as a user's shell
    return subprocess.run(
        [sys.executable, "-m", "jtrainer.cli", *argv, "--output_dir", str(tmp_path / "out")],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
        cwd=tmp_path,
    )


def test_a_refused_command_prints_one_line_and_no_plugin_chatter(tmp_path):
    done = _command(tmp_path, "train", "--per_device_train_batch_size", "0")
    assert done.returncode == 1
    assert done.stderr.splitlines() == ["jtrainer train: --per_device_train_batch_size must be >= 1, got 0."]
    assert done.stdout == ""


def test_peft_and_bitsandbytes_load_without_their_kernel_hub_notice(tmp_path):
    """LoRA's target modules are checked on the model (peft, hence bitsandbytes, imported) before any work."""
    done = _command(tmp_path, "train", "--bridge", "true", "--use_peft", "true", "--lora_target_modules", "qkv")
    assert done.returncode == 1
    lines = done.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("jtrainer train: lora_target_modules=['qkv']"), lines


def test_the_filter_drops_the_known_lines_only(capfd):
    with quiet.filtered_stderr():
        os.write(2, b"WARNING: All log messages before absl::InitializeLog() is called are written to STDERR\n")
        os.write(
            2,
            b"I0000 00:00:1796610597.028633   14219 cudart_stub.cc:31] Could not find cuda drivers on your machine,"
            b" GPU will not be used.\n",
        )
        os.write(2, b"W0000 a real warning from a C++ library\n")
        print("a Python warning", file=sys.stderr)
    err = capfd.readouterr().err
    assert sorted(err.splitlines()) == ["W0000 a real warning from a C++ library", "a Python warning"]


def test_jax_stays_on_the_cpu_only_where_no_accelerator_is_attached(monkeypatch):
    monkeypatch.delenv("JAX_PLATFORMS", raising=False)
    monkeypatch.setattr(quiet, "accelerator_attached", lambda: True)
    quiet.choose_platforms()
    assert "JAX_PLATFORMS" not in os.environ  # a TPU VM or a GPU node: JAX's own choice
    monkeypatch.setattr(quiet, "accelerator_attached", lambda: False)
    quiet.choose_platforms()
    assert os.environ["JAX_PLATFORMS"] == "cpu"
    monkeypatch.setenv("JAX_PLATFORMS", "tpu")
    quiet.choose_platforms()
    assert os.environ["JAX_PLATFORMS"] == "tpu"  # the user's choice stands
