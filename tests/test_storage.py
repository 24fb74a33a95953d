"""output_dir, checkpoints, exports, metrics and data on gs://, against a local GCS server (fake-gcs-server):
train, checkpoint, rotate, resume bit-identically (one process and two), crash leftovers, tampering, the lock,
and the CLI's text_dir / dataset folder / model folder on the bucket."""

import json
import os
import socket
import subprocess
import sys

import fsspec
import gcs_emulator
import jax
import numpy as np
import pytest
from jobs.ckpt_job import make_trainer

from jtrainer import TrainingArguments
from jtrainer.checkpointing import checkpoint
from jtrainer.core import storage
from jtrainer.core.errors import BadInput
from jtrainer.models.llama import LlamaForCausalLM

HERE = os.path.dirname(__file__)


@pytest.fixture(scope="module")
def gcs():
    with gcs_emulator.running() as url:
        saved = {k: os.environ.get(k) for k in gcs_emulator.environment(url)}
        os.environ.update(gcs_emulator.environment(url))
        fsspec.filesystem("gs").clear_instance_cache()
        yield url
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def _bucket():
    fs = fsspec.filesystem("gs")
    fs.invalidate_cache()
    return fs


def _params(trainer):
    return [np.asarray(x) for x in jax.tree.leaves(trainer._train_state.params)]


def _losses(trainer, after=0):
    return [h["loss"] for h in trainer.state.log_history if "loss" in h and h["step"] > after]


def test_train_checkpoint_rotate_and_resume_on_gcs_equal_a_local_run(gcs, tmp_path):
    """A run into gs:// saves committed checkpoints (rotated to save_total_limit), the export, metrics and state
    there; resuming from it gives bit-identical parameters and the same losses as an uninterrupted local run."""
    local = make_trainer(str(tmp_path / "local"), 6, 0, False)
    local.train()

    out = "gs://bkt/single"
    first = make_trainer(out, 4, 2, False)
    first.args.save_total_limit = 1
    first.train()
    assert checkpoint.checkpoint_folders(out) == [f"{out}/checkpoint-4"]  # checkpoint-2 rotated away
    first.save_model()
    first.save_metrics("train", {"train_loss": 1.5})
    first.save_state()
    names = set(storage.listdir(out))
    assert {
        "checkpoint-4",
        "config.json",
        "model.safetensors",
        "train_results.json",
        "all_results.json",
        "trainer_state.json",
    } <= names
    assert ".jtrainer.lock" not in names  # released at the end
    folder = f"{out}/checkpoint-4"
    checkpoint.verify_checkpoint(folder)
    files = storage.listdir(folder)
    assert checkpoint.COMMIT_NAME in files and checkpoint.WRITING_NAME not in files
    manifest = json.loads(storage.read_text(f"{folder}/{checkpoint.MANIFEST_NAME}"))
    assert all("crc32c" in entry or "md5Hash" in entry for entry in manifest.values())  # the store's own hashes
    assert any(name.startswith("train_state/") for name in manifest)

    resumed = make_trainer(out, 6, 2, False)
    resumed.train(resume_from_checkpoint=True)
    assert resumed.state.global_step == 6
    for a, b in zip(_params(resumed), _params(local)):
        np.testing.assert_array_equal(a, b)
    assert _losses(resumed, after=4) == _losses(local, after=4)
    assert checkpoint.get_last_checkpoint(out) == f"{out}/checkpoint-6"
    loaded = LlamaForCausalLM.from_pretrained(f"{out}/checkpoint-6")  # the HF export, read from the bucket
    np.testing.assert_array_equal(
        np.asarray(loaded.model.embed_tokens.embedding[...]),
        np.asarray(resumed.model.model.embed_tokens.embedding[...]),
    )


def test_a_crash_leftover_on_gcs_is_skipped_then_removed_and_tampering_is_caught(gcs):
    out = "gs://bkt/leftover"
    make_trainer(out, 2, 2, False).train()
    fs = _bucket()
    # What a kill -9 mid-save leaves on an object store: the writing marker, some files, no commit marker.
    fs.pipe_file("bkt/leftover/checkpoint-4/writing.json", b'{"global_step": 4}')
    fs.pipe_file("bkt/leftover/checkpoint-4/train_state/part", b"half")
    assert checkpoint.get_last_checkpoint(out) == f"{out}/checkpoint-2"
    resumed = make_trainer(out, 4, 2, False)
    resumed.train(resume_from_checkpoint=True)
    checkpoint.verify_checkpoint(f"{out}/checkpoint-4")  # rewritten whole after the leftover was removed
    assert not storage.isfile(f"{out}/checkpoint-4/train_state/part")

    # An object rewritten behind jtrainer's back (same size, other bytes): the store's hash no longer matches.
    path = "bkt/leftover/checkpoint-4/trainer_state.json"
    text = fs.cat_file(path)
    fs.pipe_file(path, text.replace(b'"global_step": 4', b'"global_step": 5'))
    with pytest.raises(checkpoint.CheckpointIntegrityError, match="trainer_state.json does not match"):
        checkpoint.verify_checkpoint(f"{out}/checkpoint-4")
    assert checkpoint.get_last_checkpoint(out) == f"{out}/checkpoint-2"


def test_the_run_lock_holds_on_gcs(gcs):
    from jtrainer.checkpointing import run_lock

    out = "gs://bkt/locked"
    other = {
        "holder": {"host": "another-host", "pid": 7, "pid_start": None, "started": 0.0, "token": "t"},
        "beat": __import__("time").time(),
    }
    storage.write_text(f"{out}/{run_lock.LOCK_NAME}", json.dumps(other))
    with pytest.raises(run_lock.OutputDirLocked, match="in use by another jtrainer run"):
        make_trainer(out, 2, 0, False).train()
    other["beat"] = 0.0  # its heartbeat stopped long ago: taken over
    storage.write_text(f"{out}/{run_lock.LOCK_NAME}", json.dumps(other))
    make_trainer(out, 2, 0, False).train()
    assert not storage.exists(f"{out}/{run_lock.LOCK_NAME}")


def test_output_urls_tensorstore_cannot_write_are_refused():
    with pytest.raises(BadInput, match=r"output_dir 'memory://run': memory:// cannot hold checkpoints"):
        TrainingArguments(output_dir="memory://run")
    assert TrainingArguments(output_dir="file:///tmp/x/").output_dir == "/tmp/x"
    assert TrainingArguments(output_dir="gs://b/run/").output_dir == "gs://b/run"
    with pytest.raises(ValueError, match="push_to_hub uploads output_dir"):
        TrainingArguments(output_dir="gs://b/run", push_to_hub=True)


def _env(url, **extra):
    env = {k: v for k, v in os.environ.items() if not k.startswith("JTRAINER_")}
    env.update(JAX_PLATFORMS="cpu", **gcs_emulator.environment(url), **extra)
    return env


def _pair(url, args, port):
    procs = []
    for i in range(2):
        env = _env(
            url,
            JTRAINER_COORDINATOR=f"127.0.0.1:{port}",
            JTRAINER_NUM_PROCESSES="2",
            JTRAINER_PROCESS_ID=str(i),
            XLA_FLAGS="--xla_force_host_platform_device_count=4",
            CKPT_JOB_SAVE_MODEL="1",
        )
        procs.append(
            subprocess.Popen(
                [sys.executable, os.path.join(HERE, "jobs", "ckpt_job.py"), *args],
                env=env,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.PIPE,
                text=True,
            )
        )
    for proc in procs:
        _, err = proc.communicate(timeout=400)
        assert proc.returncode == 0, err[-3000:]


def _free_port():
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_processes_save_to_gcs_and_resume_bit_identically(gcs):
    """Two processes x 4 devices (fsdp 8) write one checkpoint on the bucket (each its own shards); a second
    pair resumes from it into another folder and ends with the same weights and losses as the first pair."""
    mesh = json.dumps({"fsdp": 8})
    _pair(gcs, ["gs://bkt/mh-full", "4", "2", "0", mesh, "8"], _free_port())
    _pair(gcs, ["gs://bkt/mh-resumed", "4", "2", "0", mesh, "8", "gs://bkt/mh-full/checkpoint-2"], _free_port())
    fs = _bucket()
    full = json.loads(fs.cat_file("bkt/mh-full/losses.json"))
    resumed = json.loads(fs.cat_file("bkt/mh-resumed/losses.json"))
    assert set(resumed) == set(full) == {"1", "2", "3", "4"}  # steps 1-2 come with the resumed state
    assert all(resumed[k] == full[k] for k in ("3", "4"))
    assert fs.cat_file("bkt/mh-full/checkpoint-4/model.safetensors") == fs.cat_file(
        "bkt/mh-resumed/checkpoint-4/model.safetensors"
    )
    # The checkpoint's export, read back from its train state by process 0 inside the commit, is the export
    # save_model() gathers from both processes' shards, byte for byte.
    assert fs.cat_file("bkt/mh-full/checkpoint-4/model.safetensors") == fs.cat_file(
        "bkt/mh-full/final/model.safetensors"
    )
    manifest = json.loads(fs.cat_file("bkt/mh-full/checkpoint-4/manifest.json"))
    assert any("ocdbt.process_1" in name for name in manifest)  # process 1 wrote its shards there too
    checkpoint.verify_checkpoint("gs://bkt/mh-resumed/checkpoint-4")


def test_cli_reads_text_and_writes_checkpoints_on_gcs_and_continues_there(gcs, tmp_path):
    fs = _bucket()
    for i in range(4):
        fs.pipe_file(f"bkt/cli-data/text/f{i}.txt", " ".join(f"w{(i + j) % 30}" for j in range(400)).encode())
    small = [
        "--hidden_size",
        "32",
        "--intermediate_size",
        "64",
        "--num_hidden_layers",
        "1",
        "--num_attention_heads",
        "2",
        "--num_key_value_heads",
        "1",
        "--block_size",
        "16",
        "--tokenizer_vocab_size",
        "300",
        "--save_steps",
        "2",
        "--disable_tqdm",
        "true",
    ]
    command = [
        sys.executable,
        "-m",
        "jtrainer.cli",
        "train",
        "--text_dir",
        "gs://bkt/cli-data/text",
        "--output_dir",
        "gs://bkt/cli-run",
        *small,
    ]
    first = subprocess.run(command + ["--max_steps", "2"], env=_env(gcs), capture_output=True, text=True, timeout=400)
    assert first.returncode == 0, first.stderr[-3000:]
    assert checkpoint.get_last_checkpoint("gs://bkt/cli-run") == "gs://bkt/cli-run/checkpoint-2"
    again = subprocess.run(command + ["--max_steps", "4"], env=_env(gcs), capture_output=True, text=True, timeout=400)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "resuming from gs://bkt/cli-run/checkpoint-2" in again.stderr + again.stdout
    assert checkpoint.get_last_checkpoint("gs://bkt/cli-run") == "gs://bkt/cli-run/checkpoint-4"
    # The trained model folder on the bucket is a model_name_or_path for the next job.
    tuned = subprocess.run(
        [
            sys.executable,
            "-m",
            "jtrainer.cli",
            "train",
            "--text_dir",
            "gs://bkt/cli-data/text",
            "--model_name_or_path",
            "gs://bkt/cli-run",
            "--output_dir",
            str(tmp_path / "tuned"),
            "--block_size",
            "16",
            "--max_steps",
            "1",
            "--save_strategy",
            "no",
            "--disable_tqdm",
            "true",
        ],
        env=_env(gcs),
        capture_output=True,
        text=True,
        timeout=400,
    )
    assert tuned.returncode == 0, tuned.stderr[-3000:]
    assert (tmp_path / "tuned" / "model.safetensors").exists()


def test_a_saved_dataset_folder_on_gcs_is_read(gcs):
    import datasets

    from jtrainer.cli import tasks as jobs

    datasets.Dataset.from_dict({"text": [f"row {i}" for i in range(10)]}).save_to_disk("gs://bkt/ds/saved")
    train, validation = jobs.load_splits(jobs.DataArguments(dataset_name="gs://bkt/ds/saved", eval_fraction=0.2))
    assert len(train) == 8 and len(validation) == 2


def test_an_unreachable_storage_service_is_refused_in_one_line(tmp_path):
    """gs:// output_dir with the endpoint down: refused before any work, in one line naming it (not the client's
    connection error after a minute of retries)."""
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        down = f"http://127.0.0.1:{s.getsockname()[1]}"
    command = [
        sys.executable,
        "-m",
        "jtrainer.cli",
        "train",
        "--output_dir",
        "gs://bkt/unreachable",
        "--max_steps",
        "2",
    ]
    done = subprocess.run(
        command, env=_env(down, JTRAINER_STORAGE_TIMEOUT="10"), capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 1, done.stderr[-3000:]
    assert "Traceback" not in done.stderr
    said = [line for line in done.stderr.splitlines() if line.startswith("jtrainer train: ")]
    assert (
        len(said) == 1 and "output_dir 'gs://bkt/unreachable': the gs:// storage service cannot be reached" in said[0]
    )
    assert not (tmp_path / "unreachable").exists()
