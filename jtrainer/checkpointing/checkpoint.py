"""`checkpoint-N/` folders: committed atomically, checked on restore, rotated only after a successor exists.

Layout of `output_dir/checkpoint-{global_step}/`:
  train_state/          orbax: params, optimizer state, step, rng, model state (omitted with save_only_model);
                        every process writes its own shards
  config.json, model.safetensors   the model in HF format (what `from_pretrained` reads)
  trainer_state.json    HF's TrainerState
  training_args.json    the TrainingArguments (HF writes a torch pickle, training_args.bin, instead)
  scheduler.json        a per-evaluation scheduler's state (reduce_lr_on_plateau, greedy), when the run has one
  torch_optimizer.pt    a user's torch optimizer groups and scheduler state, when the run has them
  manifest.json         sha256 and size of every other file
  commit_success.json   written last: the checkpoint is complete

In a local folder everything is written into `checkpoint-N.tmp/` and renamed to `checkpoint-N/` only when
complete (a rename is atomic), so a reader never sees half a checkpoint and a crash leaves only a `.tmp` folder,
which is removed at the next start. Object stores (gs://, s3://) have no rename: there `checkpoint-N/` is written
in place, starting with a `writing.json` marker and ending with the manifest and then the commit marker; a
folder with `writing.json` and no commit marker is a crash's leftover, skipped by readers and removed at the
next start.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import logging
import os
import re
import shutil
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
import optax
import orbax.checkpoint as ocp
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

from jtrainer.checkpointing import hf_checkpoint
from jtrainer.core import storage
from jtrainer.core.errors import BadInput
from jtrainer.numerics import opt_state as opt_states
from jtrainer.numerics import schedules
from jtrainer.numerics.mixed_precision import LossScaleState

logger = logging.getLogger(__name__)

TRAIN_STATE_DIR = "train_state"
TRAINER_STATE_NAME = "trainer_state.json"
TRAINING_ARGS_NAME = "training_args.json"
MANIFEST_NAME = "manifest.json"
SCHEDULER_NAME = "scheduler.json"  # a per-evaluation scheduler's host state (HF: scheduler.pt)
# A user's torch optimizer and scheduler: their groups' hyperparameters and the scheduler's state (torch.save)
TRANSLATED_OPTIMIZER_NAME = "torch_optimizer.pt"
COMMIT_NAME = "commit_success.json"
LOOP_STATE_NAME = "loop_state_{}.json"  # per process: host generators, padded length (HF: rng_state_{i}.pth)
TMP_SUFFIX = ".tmp"
WRITING_NAME = "writing.json"  # object stores: written first, removed after the commit marker
# Called on the writing process with (the checkpoint's folder as written, its step) once everything is written,
# just before the commit marker; None: nothing. A seam for tests that kill a process in the middle of a save.
before_commit: Callable[[str, int], None] | None = None

__all__ = [
    "CheckpointIntegrityError",
    "CheckpointWriteError",
    "checkpoint_folder",
    "get_last_checkpoint",
    "restore_train_state",
    "checkpoint_folders",
    "remove_checkpoint",
    "rotate_checkpoints",
    "PendingCheckpoint",
    "save_checkpoint",
    "verify_checkpoint",
]


class CheckpointIntegrityError(BadInput):
    """A checkpoint folder is incomplete or corrupted; the message names the folder and the file."""


class CheckpointMismatchError(BadInput):
    """A checkpoint of another model (other parameter names or shapes) than the one being trained."""


class CheckpointWriteError(OSError):
    """A checkpoint could not be written: a full or read-only disk, a file-size limit, a lost mount. The
    checkpoints committed before it are untouched; its partial `.tmp` folder is removed (when the disk allows)."""

    def __init__(self, folder: str, cause: BaseException):
        code, reason, path = _os_error(cause)
        path = path if path != "?" else _writing_folder(folder)  # a write that did not name its file
        super().__init__(code, reason, path)
        self.folder = folder
        self.message = (
            f"Checkpoint {folder} could not be written ({reason}: {path}); the checkpoints committed before it are "
            "intact. Free space on that disk or give it write access (or set another output_dir), then run again "
            "to resume from the last committed checkpoint."
        )

    def __str__(self) -> str:
        return self.message


_TENSORSTORE_OS_ERROR = re.compile(r"\[os_error_code='(?P<code>\d+)'\]")
_QUOTED_PATH = re.compile(r'"(?P<path>(?:/|[a-z0-9]+://)[^"]+)"')


def _os_error(error: BaseException) -> tuple[int | None, str, str]:
    """(errno, reason, file) of a failed write, from Python's OSError or tensorstore's error text (orbax: the
    file is the last quoted path before its os_error_code), looking through the exceptions it was raised from."""
    code: int | None = None
    reason, path = "", None
    for cause in _chain(error):
        if isinstance(cause, OSError) and cause.strerror:
            found = cause.errno, cause.strerror, cause.filename
        elif match := _TENSORSTORE_OS_ERROR.search(str(cause)):
            paths = _QUOTED_PATH.findall(str(cause)[: match.start()])
            found = int(match["code"]), os.strerror(int(match["code"])), paths[-1] if paths else None
        else:
            continue
        if code is None:
            code, reason = found[0], found[1]
        path = path or found[2]
        if path:
            break
    if code is None:
        return None, str(error).splitlines()[0] if str(error) else type(error).__name__, "?"
    return code, reason, path or "?"


def _chain(error: BaseException | None):
    seen = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        yield error
        error = error.__cause__ or error.__context__


class _ReportedAsCheckpointWriteError(logging.Filter):
    """orbax's background threads and asyncio's unretrieved futures log the failed write (with its traceback,
    several times) that jtrainer raises as one CheckpointWriteError naming the checkpoint, the file and the cause:
    those records are left out."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not (record.exc_info and record.exc_info[1] is not None and _os_error(record.exc_info[1])[0])


def _ignore_closed_event_loop(previous):
    """tensorstore's callbacks into orbax's closed event loop after a failed write raise 'Event loop is closed'
    as unraisable exceptions (a traceback each, dozens): noise once the write has failed; others go on."""

    def hook(unraisable) -> None:
        error = unraisable.exc_value
        if not (isinstance(error, RuntimeError) and str(error) == "Event loop is closed"):
            previous(unraisable)

    return hook


_QUIET = threading.Lock()
_quieted = False


def _quiet_background_failures() -> None:
    """Once per process, before the first checkpoint: a failed write is said once, by CheckpointWriteError."""
    global _quieted
    with _QUIET:
        if not _quieted:
            for name in ("absl", "asyncio"):  # orbax's threads; its futures' "exception was never retrieved"
                logging.getLogger(name).addFilter(_ReportedAsCheckpointWriteError())
            sys.unraisablehook = _ignore_closed_event_loop(sys.unraisablehook)
            _quieted = True


@contextlib.contextmanager
def _writing(folder: str, is_main: bool):
    """Turn any failure of writing `folder` into CheckpointWriteError, removing the partial `.tmp` folder."""
    try:
        yield
    except (KeyboardInterrupt, SystemExit, CheckpointWriteError):
        raise
    except Exception as error:
        if is_main:
            _remove_partial(_writing_folder(folder))
        raise CheckpointWriteError(folder, error) from error


def _writing_folder(folder: str) -> str:
    """Where `folder` is written before its commit: `folder.tmp` locally, `folder` itself on an object store."""
    return folder if storage.is_url(folder) else folder + TMP_SUFFIX


def _remove_partial(tmp: str, attempts: int = 50) -> None:
    """Remove a failed checkpoint's `.tmp` folder. Writes tensorstore had in flight when the first one failed can
    still create files after a first rmtree, so it is repeated until the folder stays gone for 0.2 s (at most ~10 s)."""
    for _ in range(attempts):
        storage.rmtree(tmp)
        time.sleep(0.2)
        if not storage.exists(tmp):
            return


def checkpoint_folder(run_dir: str, global_step: int) -> str:
    return storage.join(run_dir, f"{PREFIX_CHECKPOINT_DIR}-{global_step}")


def save_loop_state(folder: str, process_index: int, state: dict) -> None:
    storage.write_text(storage.join(folder, LOOP_STATE_NAME.format(process_index)), json.dumps(state))


def load_loop_state(folder: str, process_index: int) -> dict | None:
    """A process's loop state from a checkpoint (None for one saved without it)."""
    path = storage.join(folder, LOOP_STATE_NAME.format(process_index))
    if not storage.isfile(path):
        return None
    return json.loads(storage.read_text(path))


_BARRIER_CALLS: dict[str, itertools.count] = {}  # per name: every process waits on it in the same order


def _barrier(name: str, timeout_s: int = 1800) -> None:
    """Wait for every process, through jax's coordination service: no device computation, so a background
    thread may wait while the main thread runs train steps."""
    if jax.process_count() > 1:
        from jax._src import distributed

        key = f"{name}_{next(_BARRIER_CALLS.setdefault(name, itertools.count()))}"
        client = distributed.global_state.client
        assert client is not None, "jax.distributed is initialised when there are several processes"
        client.wait_at_barrier(key, timeout_in_ms=timeout_s * 1000)


def _files(folder: str) -> list[str]:
    return [rel for rel in storage.files_under(folder) if rel not in (MANIFEST_NAME, COMMIT_NAME, WRITING_NAME)]


def write_manifest(folder: str) -> None:
    entries = {rel: storage.digest(storage.join(folder, rel)) for rel in _files(folder)}
    storage.write_text(storage.join(folder, MANIFEST_NAME), json.dumps(entries, indent=1, sort_keys=True))


def _inside(folder: str, rel: str) -> bool:
    """Whether manifest entry `rel` names a file inside `folder` (no absolute path, no way out through `..`)."""
    if os.path.isabs(rel) or "://" in rel:
        return False
    if storage.is_url(folder):
        return ".." not in rel.split("/")
    return os.path.realpath(os.path.join(folder, rel)).startswith(os.path.realpath(folder) + os.sep)


def verify_checkpoint(folder: str) -> None:
    """Raise CheckpointIntegrityError naming the file if `folder` is uncommitted, truncated or corrupted."""
    if not storage.isdir(folder):
        what = "is a file" if storage.exists(folder) else "does not exist"
        raise CheckpointIntegrityError(f"{folder} {what}: a checkpoint is a checkpoint-N folder.")
    if not storage.listdir(folder):
        raise CheckpointIntegrityError(f"{folder} is an empty folder, not a checkpoint.")
    if not storage.isfile(storage.join(folder, COMMIT_NAME)):
        if hf_checkpoint.written_by_hf_trainer(folder):
            # transformers.Trainer's checkpoint-N: no manifest to check (HF takes it by name); resumable when whole.
            missing = hf_checkpoint.missing_files(folder)
            if missing:
                raise CheckpointIntegrityError(
                    f"Checkpoint {folder} (transformers.Trainer's) lacks {', '.join(missing)}."
                )
            _read_json(folder, TRAINER_STATE_NAME)
            try:
                hf_checkpoint.check_pickles(folder)
            except hf_checkpoint.HFCheckpointError as error:
                raise CheckpointIntegrityError(str(error)) from None
            return
        raise CheckpointIntegrityError(f"Checkpoint {folder} is not committed: {COMMIT_NAME} is missing.")
    manifest_path = storage.join(folder, MANIFEST_NAME)
    if not storage.isfile(manifest_path):
        raise CheckpointIntegrityError(f"Checkpoint {folder} has no {MANIFEST_NAME}.")
    manifest = _read_json(folder, MANIFEST_NAME)
    if not isinstance(manifest, dict):
        raise CheckpointIntegrityError(f"Checkpoint {folder}: {MANIFEST_NAME} is not a mapping of files.")
    unlisted = sorted(set(_files(folder)) - set(manifest))
    if unlisted or not manifest:  # the manifest vouches for the whole folder, or for nothing
        raise CheckpointIntegrityError(
            f"Checkpoint {folder}: {MANIFEST_NAME} does not list "
            + (f"{', '.join(unlisted[:3])}{' ...' if len(unlisted) > 3 else ''}" if unlisted else "any file")
            + " (files written after the commit, or a damaged manifest)."
        )
    for rel, entry in manifest.items():
        path = storage.join(folder, rel)
        if not _inside(folder, rel):
            raise CheckpointIntegrityError(f"Checkpoint {folder}: {MANIFEST_NAME} names {rel!r}, outside the folder.")
        if not storage.isfile(path):
            raise CheckpointIntegrityError(f"Checkpoint {folder}: file {rel} is missing.")
        size = storage.getsize(path)
        if not isinstance(entry, dict) or size != entry.get("bytes"):
            written = entry.get("bytes") if isinstance(entry, dict) else entry
            raise CheckpointIntegrityError(
                f"Checkpoint {folder}: file {rel} has {size} bytes, {written} were written (truncated?)."
            )
        if storage.digest(path) != entry:
            raise CheckpointIntegrityError(f"Checkpoint {folder}: file {rel} does not match its checksum.")
        if rel.endswith(".json"):
            _read_json(folder, rel)  # every JSON file must parse: resume falls back past one that does not


def _read_json(folder: str, rel: str):
    try:
        return json.loads(storage.read_text(storage.join(folder, rel)))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, RecursionError) as error:
        what = "nested too deeply" if isinstance(error, RecursionError) else error
        raise CheckpointIntegrityError(f"Checkpoint {folder}: {rel} cannot be read ({what}).") from None


class PendingCheckpoint:
    """A checkpoint whose arrays orbax writes in the background. A committer thread commits it as soon as the
    last byte is written (manifest, commit marker, rename, then `on_commit`), independent of the next save;
    `commit()` waits for that (and re-raises its error); `done` says whether it has happened."""

    def __init__(
        self,
        folder: str,
        checkpointer,
        is_main: bool,
        step: int,
        on_commit: Callable[[], None],
        finish_files: Callable[[str, str], None] | None = None,
    ):
        self.folder, self.checkpointer, self.is_main, self.step = folder, checkpointer, is_main, step
        self.on_commit, self.finish_files = on_commit, finish_files
        self._finished = threading.Event()
        self._error: BaseException | None = None
        self._thread: threading.Thread | None = None

    def commit_in_background(self) -> None:
        self._thread = threading.Thread(target=self._commit_recording, name=f"jtrainer-commit-{self.step}", daemon=True)
        self._thread.start()

    @property
    def done(self) -> bool:
        return self._finished.is_set()

    def commit(self, timeout: float | None = None) -> None:
        """Commit now, or wait (at most `timeout` seconds) for the background commit."""
        if self._thread is None:
            self._commit_recording()
        # An Event, not Thread.join: a join interrupted by Ctrl-C can report the thread finished (Python < 3.13).
        elif not self._finished.wait(timeout):
            raise TimeoutError(f"Checkpoint {self.folder} was still being written after {timeout:.0f} s.")
        if self._error is not None:
            raise self._error

    def _commit_recording(self) -> None:
        try:
            self._commit()
        except BaseException as error:  # raised by commit() in the main thread
            self._error = error
        finally:
            self._finished.set()

    def _commit(self) -> None:
        with _writing(self.folder, self.is_main):
            if self.checkpointer is not None:
                try:
                    self.checkpointer.wait_until_finished()
                finally:  # orbax's writer threads are stopped whatever happened
                    self.checkpointer.close()
        _barrier(f"jtrainer_ckpt_written_{self.step}")
        with _writing(self.folder, self.is_main):
            tmp = _writing_folder(self.folder)
            if self.is_main and self.finish_files is not None:  # files made from the arrays just written
                with storage.staged_folder(tmp) as local:
                    self.finish_files(tmp, local)
            self._rename_into_place(tmp)
        _barrier(f"jtrainer_ckpt_committed_{self.step}")
        self.on_commit()

    def _rename_into_place(self, tmp: str) -> None:
        if self.is_main:
            write_manifest(tmp)
            if before_commit is not None:
                before_commit(tmp, self.step)
            storage.write_text(
                storage.join(tmp, COMMIT_NAME), json.dumps({"global_step": self.step, "time": time.time()})
            )
            if tmp == self.folder:  # an object store: committed by the marker; the writing marker goes last
                storage.remove(storage.join(tmp, WRITING_NAME))
                return
            if os.path.exists(self.folder):
                shutil.rmtree(self.folder)
            os.rename(tmp, self.folder)


def save_checkpoint(
    folder: str,
    train_state,
    write_files: Callable[[str], None],
    is_main: bool,
    step: int,
    *,
    asynchronous: bool = False,
    on_commit: Callable[[], None] = lambda: None,
    finish_files: Callable[[str, str], None] | None = None,
    write_process_files: Callable[[str], None] | None = None,
) -> PendingCheckpoint | None:
    """Write a checkpoint into `folder.tmp`, then commit it by renaming to `folder` (see the module doc).

    With `asynchronous`, orbax writes the arrays in the background (after copying them off the devices) and the
    returned PendingCheckpoint commits itself when they are written; `on_commit` runs after the rename (rotation
    goes there, so nothing is deleted before its successor exists). `finish_files(written, local)`, on the main
    process once every process's arrays are written (in the committer thread when asynchronous), writes files
    made from them (the HF export read back from `written`'s train state) into the local folder `local`.
    `write_process_files(tmp)` runs on every process, before its arrays are written (so before the commit lists
    the folder): what each process keeps of its own (its host generators).
    """
    _quiet_background_failures()
    tmp = _writing_folder(folder)
    with _writing(folder, is_main):
        if is_main:
            storage.rmtree(tmp)  # a crash's leftover, or (object stores) an earlier save of this step
            storage.makedirs(tmp)
            if tmp == folder:
                storage.write_text(storage.join(tmp, WRITING_NAME), json.dumps({"global_step": step}))
    _barrier(f"jtrainer_ckpt_begin_{step}")
    checkpointer = None
    with _writing(folder, is_main):
        try:
            if write_process_files is not None:
                write_process_files(tmp)
            if train_state is not None:
                checkpointer = ocp.StandardCheckpointer()
                checkpointer.save(_orbax_path(storage.join(tmp, TRAIN_STATE_DIR)), train_state)
            if is_main:
                with storage.staged_folder(tmp) as local:
                    write_files(local)
        except BaseException:
            if checkpointer is not None:
                checkpointer.close()
            raise
    pending = PendingCheckpoint(folder, checkpointer, is_main, step, on_commit, finish_files)
    if asynchronous:
        pending.commit_in_background()
        return pending
    pending.commit()
    return None


def read_params(folder: str) -> dict:
    """The parameters of a checkpoint's train state (written, not necessarily committed) as host numpy arrays,
    read by this process alone: no device, no collective, no other process takes part, so a background thread
    may read them while the main thread trains."""
    path = _orbax_path(storage.join(folder, TRAIN_STATE_DIR))
    me = jax.process_index()
    alone = ocp.options.MultiprocessingOptions(primary_host=me, active_processes={me})
    handler = ocp.PyTreeCheckpointHandler(multiprocessing_options=alone)
    with contextlib.closing(ocp.Checkpointer(handler, multiprocessing_options=alone)) as reader:
        saved = reader.metadata(path).item_metadata.tree["params"]
        item = jax.tree.map(lambda m: np.zeros((), m.dtype), saved)
        as_numpy = jax.tree.map(lambda m: ocp.RestoreArgs(restore_type=np.ndarray), saved)
        restored = reader.restore(
            path,
            args=ocp.args.PyTreeRestore(item={"params": item}, restore_args={"params": as_numpy}, partial_restore=True),
        )
    return restored["params"]


def _orbax_path(path: str) -> str:
    return path if storage.is_url(path) else os.path.abspath(path)


def remove_uncommitted(run_dir: str) -> list[str]:
    """Delete the partial checkpoints a crash left behind (`.tmp` folders; on object stores, folders with the
    writing marker and no commit marker); returns their paths."""
    removed = []
    for name in storage.listdir(run_dir):
        path = storage.join(run_dir, name)
        if not name.startswith(PREFIX_CHECKPOINT_DIR + "-"):
            continue
        partial = name.endswith(TMP_SUFFIX) or (
            storage.is_url(run_dir)
            and storage.isfile(storage.join(path, WRITING_NAME))
            and not storage.isfile(storage.join(path, COMMIT_NAME))
        )
        if partial:
            storage.rmtree(path)
            removed.append(path)
    return removed


_CHECKPOINT_NAME = re.compile(r"^" + PREFIX_CHECKPOINT_DIR + r"-(\d+)$")


def checkpoint_folders(run_dir: str) -> list[str]:
    """The run's `checkpoint-N` folders (exactly that name: not `checkpoint-4-backup`), oldest step first."""
    found = sorted(
        (int(m.group(1)), name)
        for name in storage.listdir(run_dir)
        if (m := _CHECKPOINT_NAME.match(name)) and storage.isdir(storage.join(run_dir, name))
    )
    return [storage.join(run_dir, name) for _, name in found]


def remove_checkpoint(path: str) -> None:
    if storage.is_url(path):
        storage.rmtree(path)
    elif os.path.islink(path):  # a symlinked checkpoint: drop the link, never what it points to
        os.unlink(path)
    else:
        shutil.rmtree(path, ignore_errors=True)


def rotate_checkpoints(run_dir: str, save_total_limit: int | None, best_model_checkpoint: str | None = None) -> None:
    """HF's rotate_checkpoints (keep `save_total_limit`, never the newest nor the best), on exact names only."""
    if save_total_limit is None or save_total_limit <= 0:
        return
    folders = checkpoint_folders(run_dir)
    if len(folders) <= save_total_limit:
        return
    protected = {folders[-1]}
    if best_model_checkpoint is not None:
        protected.add(storage.join(run_dir, storage.basename(best_model_checkpoint)))
    remaining = len(folders)
    for folder in folders:
        if remaining <= max(save_total_limit, len(protected)):
            break
        if folder not in protected:
            remove_checkpoint(folder)
            remaining -= 1


def get_last_checkpoint(folder: str) -> str | None:
    """HF's get_last_checkpoint, skipping checkpoints that are not committed or fail their checks (what
    `from jtrainer import get_last_checkpoint` gives HF scripts)."""
    for path in reversed(checkpoint_folders(folder)):
        try:
            verify_checkpoint(path)
        except CheckpointIntegrityError as e:
            logger.warning("Skipping %s: %s", path, e)
            continue
        return path
    return None


def _shapes_by_path(tree) -> dict[str, tuple]:
    flat = jax.tree_util.tree_flatten_with_path(tree)[0]
    return {
        jax.tree_util.keystr(path, simple=True, separator="."): tuple(getattr(leaf, "shape", ())) for path, leaf in flat
    }


def restore_train_state(directory: str, like, fresh: Callable[[], Any] | None = None):
    """Read a train state saved by `save_checkpoint`, placed (and resharded) like the pytree `like` (arrays or
    ShapeDtypeStructs with shardings); its parameters and optimizer state must be finite (a damaged but re-hashed
    array is an integrity error). Where the optimizer's wrappers changed since the save, their state starts
    afresh: from `like` when it holds arrays, else from `fresh()`."""
    restored = _restore_train_state(directory, like, fresh)
    _check_finite(directory, restored)
    return restored


def _check_finite(directory: str, state) -> None:
    floats = [
        (path, leaf)
        for path, leaf in jax.tree_util.tree_flatten_with_path((state.params, state.opt_state))[0]
        if hasattr(leaf, "dtype") and jax.numpy.issubdtype(leaf.dtype, jax.numpy.floating)
    ]
    finite = (
        jax.jit(lambda xs: jax.numpy.stack([jax.numpy.all(jax.numpy.isfinite(x)) for x in xs]))(
            [leaf for _, leaf in floats]
        )
        if floats
        else []
    )
    for (path, _), ok in zip(floats, jax.device_get(finite)):
        if not ok:
            where = "params" if path[0].idx == 0 else "optimizer state"
            raise CheckpointIntegrityError(
                f"Checkpoint {directory}: {where} array {jax.tree_util.keystr(path[1:])} is not finite (NaN or Inf); "
                "resume from an earlier checkpoint."
            )


def _restore_train_state(directory: str, like, fresh=None):
    verify_checkpoint(directory)
    path = _orbax_path(storage.join(directory, TRAIN_STATE_DIR))
    if not storage.isdir(path):
        raise FileNotFoundError(f"Can't find a valid checkpoint at {directory}")
    with contextlib.closing(ocp.StandardCheckpointer()) as checkpointer:
        return _restore_with(checkpointer, directory, path, like, fresh)


def _restore_with(checkpointer, directory: str, path: str, like, fresh=None):
    saved_tree = checkpointer.metadata(path).item_metadata.tree
    saved = _shapes_by_path(saved_tree["params"])
    wanted = _shapes_by_path(like.params)
    for name, shape in wanted.items():
        if name in saved and saved[name] != shape:
            raise CheckpointMismatchError(
                f"Checkpoint {directory}: parameter {name} has shape {saved[name]} but the model's has shape {shape}."
            )
    missing = sorted(set(wanted) - set(saved))
    saved_unrolled = any(".layers.0." in n for n in saved)  # scan_layers stacks them: no per-layer index
    if missing and saved_unrolled != any(".layers.0." in n for n in wanted):
        raise CheckpointMismatchError(
            f"Checkpoint {directory} was saved with{'out' if saved_unrolled else ''} scan_layers and "
            "this model is built the other way: build the model as it was saved (its HF export, "
            "config.json + safetensors, loads either way)."
        )
    if missing:
        raise CheckpointMismatchError(
            f"Checkpoint {directory} has no parameters {missing[:5]}: it was saved from another model."
        )
    extra = sorted(set(saved) - set(wanted))
    if extra:  # a LoRA run's adapters on another base model, ...
        raise CheckpointMismatchError(
            f"Checkpoint {directory} has parameters this model lacks ({', '.join(extra[:3])}"
            f"{', ...' if len(extra) > 3 else ''}): it was saved from another model; train it in another output_dir."
        )
    abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, like)
    saved_wrappers, _ = _peel_wrappers(saved_tree["opt_state"])
    wanted_wrappers, _ = _peel_wrappers(like.opt_state)
    if saved_wrappers == wanted_wrappers:
        try:
            return _restore_completing(checkpointer, path, abstract)
        except ValueError as error:  # the frozen weights or the optimizer state of another model
            if "tree" not in str(error).lower():
                raise
            raise CheckpointMismatchError(
                f"Checkpoint {directory} holds the state of another model (its train state's structure differs "
                "from this run's): train this model in another output_dir, or build the model it was saved from."
            ) from None
    # fp16 or nan_inf_policy changed since the save: restore the optimizer's own state from under the saved
    # wrappers (read as dicts) and put it under this run's, whose state starts afresh.
    logger.warning(
        "Checkpoint %s was saved with %s around the optimizer, this run uses %s: the optimizer's state is restored, "
        "the wrapper state starts afresh.",
        directory,
        _wrapper_names(saved_wrappers),
        _wrapper_names(wanted_wrappers),
    )
    if isinstance(jax.tree.leaves(like)[0], jax.ShapeDtypeStruct):
        like = fresh()  # the new wrappers' state starts from its initial values
    _, core_abstract = _peel_wrappers(abstract.opt_state)
    replicated = jax.sharding.NamedSharding(like.step.sharding.mesh, jax.sharding.PartitionSpec())
    saved_opt = _saved_wrappers(saved_tree["opt_state"], core_abstract, replicated)
    restored = _restore_completing(checkpointer, path, abstract.replace(opt_state=saved_opt))
    return restored.replace(opt_state=_rewrap(like.opt_state, _peel_wrappers(restored.opt_state)[1]))


def _restore_completing(checkpointer, path: str, target):
    """`checkpointer.restore(path, target)`; an optimizer state saved before the schedule's switch numbers
    existed (`schedules.SCHEDULE_SWITCH`) is read without them and completed as having no switch."""
    try:
        return checkpointer.restore(path, target)
    except ValueError as error:
        if "tree" not in str(error).lower():
            raise
        older = opt_states.map_hyperparams(
            target.opt_state, lambda hyper: {k: v for k, v in hyper.items() if k not in schedules.SCHEDULE_SWITCH}
        )
        if opt_states.find_hyperparams(older) == opt_states.find_hyperparams(target.opt_state):
            raise
        try:
            restored = checkpointer.restore(path, target.replace(opt_state=older))
        except ValueError:
            raise error from None
    return restored.replace(opt_state=opt_states.map_hyperparams(restored.opt_state, schedules.no_schedule_switch))


# Optimizer-state wrappers a resumed run may add or drop, by their fields (a saved state is a dict).
_WRAPPERS: dict[frozenset, str] = {
    frozenset(LossScaleState._fields): "fp16 loss scaling",
    frozenset(optax.ApplyIfFiniteState._fields): "nan_inf_policy='skip'",
}


def _fields(node) -> frozenset:
    return frozenset(node._fields if hasattr(node, "_fields") else node if isinstance(node, dict) else ())


def _peel_wrappers(opt_state) -> tuple[list[frozenset], object]:
    """(the wrappers' field sets, outermost first; the state under them)."""
    chain = []
    while _fields(opt_state) in _WRAPPERS:
        chain.append(_fields(opt_state))
        opt_state = opt_state["inner_state"] if isinstance(opt_state, dict) else opt_state.inner_state
    return chain, opt_state


def _wrapper_names(chain) -> str:
    return " and ".join(_WRAPPERS[fields] for fields in chain) or "no wrapper"


def _saved_wrappers(saved, core, sharding):
    """The abstract restore target of saved wrapper states (dicts of replicated scalars) around `core`."""
    if _fields(saved) not in _WRAPPERS:
        return core
    return {
        key: _saved_wrappers(value, core, sharding)
        if key == "inner_state"
        else jax.ShapeDtypeStruct(value.shape, value.dtype, sharding=sharding)
        for key, value in saved.items()
    }


def _rewrap(wrapped, core):
    """`wrapped` with the state under its wrappers replaced by `core`."""
    if _fields(wrapped) not in _WRAPPERS:
        return core
    return wrapped._replace(inner_state=_rewrap(wrapped.inner_state, core))
