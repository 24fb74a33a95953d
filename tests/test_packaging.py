"""A wheel install (not editable) carries the configs the CLI needs and runs the main job on its embedded
default and on a shipped config named as the README names it."""

import os
import subprocess
import sys
import zipfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_a_wheel_install_runs_jtrainer_train_on_its_default(tmp_path):
    built = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "-q",
            "-w",
            str(tmp_path / "dist"),
            ROOT,
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert built.returncode == 0, built.stderr[-3000:]
    (wheel,) = (tmp_path / "dist").glob("jtrainer-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert "jtrainer/configs/default.yaml" in names and "jtrainer/configs/llama_1b_fsdp_v5e_16.yaml" in names
    installed = subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(tmp_path / "site"), str(wheel)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert installed.returncode == 0, installed.stderr[-3000:]
    # From another folder, the wheel's jtrainer first on the path (not this checkout's editable one).
    env = dict(os.environ, PYTHONPATH=str(tmp_path / "site"), JAX_PLATFORMS="cpu")
    code = (
        "import sys, jtrainer; assert jtrainer.__file__.startswith(sys.argv[1]), jtrainer.__file__; "
        "from jtrainer.cli import main; sys.exit(main(sys.argv[2:]))"
    )
    small = [
        "--max_steps",
        "2",
        "--max_chars",
        "20000",
        "--tokenizer_vocab_size",
        "300",
        "--hidden_size",
        "32",
        "--intermediate_size",
        "64",
        "--num_hidden_layers",
        "1",
        "--block_size",
        "16",
        "--eval_strategy",
        "no",
        "--disable_tqdm",
        "true",
    ]
    for config in ([], ["configs/default.yaml"]):
        out = tmp_path / f"out{len(config)}"
        run = subprocess.run(
            [sys.executable, "-c", code, str(tmp_path / "site"), "train", *config, *small, "--output_dir", str(out)],
            cwd=tmp_path,
            env=env,
            capture_output=True,
            text=True,
            timeout=600,
        )
        assert run.returncode == 0, run.stderr[-3000:]
        assert (out / "model.safetensors").exists() and (out / "tokenizer.json").exists()
