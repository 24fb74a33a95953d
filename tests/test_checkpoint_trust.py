"""What is restored is trusted only after checks: finite arrays, paths inside the folder, readable JSON (so the
fallback to an earlier checkpoint works), exact checkpoint names for rotation, symlinks never followed."""

import json
import os
import shutil

import numpy as np
import pytest
from jobs.ckpt_job import make_trainer

from jtrainer.checkpointing import checkpoint
from jtrainer.core import storage


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    out = tmp_path_factory.mktemp("run")
    make_trainer(str(out), 4, 2, False).train()
    return out


def _copy(run, tmp_path):
    out = tmp_path / "out"
    shutil.copytree(run, out)
    return out


def _rehash(folder):
    checkpoint.write_manifest(str(folder))


def test_unreadable_json_falls_back_to_the_previous_checkpoint(tmp_path, run):
    out = _copy(run, tmp_path)
    (out / "checkpoint-4" / checkpoint.TRAINER_STATE_NAME).write_text("{ not json")
    _rehash(out / "checkpoint-4")  # re-hashed: only parsing can tell
    with pytest.raises(checkpoint.CheckpointIntegrityError, match="trainer_state.json cannot be read"):
        checkpoint.verify_checkpoint(str(out / "checkpoint-4"))
    assert checkpoint.get_last_checkpoint(str(out)) == str(out / "checkpoint-2")
    (out / "checkpoint-2" / checkpoint.MANIFEST_NAME).write_text("[1, 2")
    assert checkpoint.get_last_checkpoint(str(out)) is None


def test_jtrainer_exports_the_verified_get_last_checkpoint(tmp_path, run):
    import jtrainer

    out = _copy(run, tmp_path)
    (out / "checkpoint-4" / checkpoint.COMMIT_NAME).unlink()
    assert jtrainer.get_last_checkpoint(str(out)) == str(out / "checkpoint-2")


def test_manifest_and_index_paths_stay_inside(tmp_path, run):
    from jtrainer.models.hf_io import WEIGHTS_INDEX_NAME, WEIGHTS_NAME, TensorFiles

    out = _copy(run, tmp_path)
    folder = out / "checkpoint-4"
    manifest = json.loads((folder / checkpoint.MANIFEST_NAME).read_text())
    secret = tmp_path / "secret.txt"
    secret.write_text("outside")
    manifest["../../secret.txt"] = storage.digest(str(secret))
    (folder / checkpoint.MANIFEST_NAME).write_text(json.dumps(manifest))
    with pytest.raises(checkpoint.CheckpointIntegrityError, match="outside the folder"):
        checkpoint.verify_checkpoint(str(folder))

    (folder / WEIGHTS_NAME).rename(tmp_path / WEIGHTS_NAME)
    (folder / WEIGHTS_INDEX_NAME).write_text(
        json.dumps({"weight_map": {"lm_head.weight": str(tmp_path / WEIGHTS_NAME)}})
    )
    with pytest.raises(ValueError, match="outside"):
        TensorFiles(str(folder))


def test_non_finite_restored_state_is_an_integrity_error(tmp_path):
    """An array file rewritten with NaNs and a manifest updated to match restores NaN parameters silently
    without the finite check."""
    import jax
    import jax.numpy as jnp

    out = tmp_path / "run"
    trainer = make_trainer(str(out), 2, 2, False)
    trainer.train()
    state = trainer._train_state
    poisoned = state.replace(params=jax.tree.map(lambda x: x * jnp.nan, state.params))
    folder = tmp_path / "poisoned"
    checkpoint.save_checkpoint(str(folder), poisoned, lambda tmp: None, True, 2)
    with pytest.raises(checkpoint.CheckpointIntegrityError, match="params array .* is not finite"):
        checkpoint.restore_train_state(str(folder), state)


def test_rotation_matches_exact_names_and_drops_links_only(tmp_path):
    for step in (1, 2, 3, 4):
        (tmp_path / f"checkpoint-{step}").mkdir()
    (tmp_path / "checkpoint-4-backup").mkdir()
    (tmp_path / "checkpoint-5.tmp").mkdir()
    target = tmp_path / "elsewhere"
    target.mkdir()
    (target / "keep.txt").write_text("mine")
    os.symlink(target, tmp_path / "checkpoint-0")
    checkpoint.rotate_checkpoints(str(tmp_path), 2, best_model_checkpoint=str(tmp_path / "checkpoint-2"))
    assert sorted(os.listdir(tmp_path)) == [
        "checkpoint-2",
        "checkpoint-4",
        "checkpoint-4-backup",
        "checkpoint-5.tmp",
        "elsewhere",
    ]
    assert (target / "keep.txt").read_text() == "mine"


def test_resume_skips_a_poisoned_newest_checkpoint_by_checksum(tmp_path, run):
    out = _copy(run, tmp_path)
    state_dir = out / "checkpoint-4" / checkpoint.TRAIN_STATE_DIR
    victim = max((p for p in state_dir.rglob("*") if p.is_file()), key=lambda p: p.stat().st_size)
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0xFF
    victim.write_bytes(bytes(data))
    resumed = make_trainer(str(out), 4, 0, False)
    resumed.train(resume_from_checkpoint=True)  # falls back to checkpoint-2 and trains steps 3-4 again
    assert resumed.state.global_step == 4
    assert np.isfinite(resumed.state.log_history[-1]["train_loss"])


@pytest.mark.parametrize("manifest", ["{}", "partial"], ids=["empty", "one-file-left-out"])
def test_a_manifest_vouches_for_every_file_or_the_checkpoint_is_skipped(tmp_path, run, manifest):
    out = _copy(run, tmp_path)
    folder = out / "checkpoint-4"
    listed = json.loads((folder / checkpoint.MANIFEST_NAME).read_text())
    victim = max(listed, key=lambda rel: listed[rel]["bytes"])
    kept = {} if manifest == "{}" else {rel: entry for rel, entry in listed.items() if rel != victim}
    (folder / checkpoint.MANIFEST_NAME).write_text(json.dumps(kept))
    data = bytearray((folder / victim).read_bytes())
    data[len(data) // 2] ^= 0xFF  # a flipped byte the manifest no longer covers
    (folder / victim).write_bytes(bytes(data))
    with pytest.raises(checkpoint.CheckpointIntegrityError, match="manifest.json does not list"):
        checkpoint.verify_checkpoint(str(folder))
    assert checkpoint.get_last_checkpoint(str(out)) == str(out / "checkpoint-2")


@pytest.mark.parametrize("name", [checkpoint.MANIFEST_NAME, checkpoint.TRAINER_STATE_NAME])
def test_deeply_nested_json_falls_back_instead_of_recursing(tmp_path, run, name):
    out = _copy(run, tmp_path)
    (out / "checkpoint-4" / name).write_text("[" * 100_000 + "]" * 100_000)
    if name != checkpoint.MANIFEST_NAME:
        _rehash(out / "checkpoint-4")
    with pytest.raises(checkpoint.CheckpointIntegrityError, match="nested too deeply|cannot be read"):
        checkpoint.verify_checkpoint(str(out / "checkpoint-4"))
    assert checkpoint.get_last_checkpoint(str(out)) == str(out / "checkpoint-2")
