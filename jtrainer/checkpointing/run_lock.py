"""One run per output_dir: a lock file taken before a run writes anything there, released when it ends.

`output_dir/.jtrainer.lock` appears atomically (a complete file hard-linked into place, which fails if one is
there) and names its holder: host, pid, the process's start time and the run's start time. A heartbeat thread
refreshes its modification time every `HEARTBEAT_S` seconds. A lock is stale, and taken over with a warning,
when its holder ran on this host and that process is gone (or its pid now names another process), or when it
ran on another host and its heartbeat is older than `STALE_AFTER_S`. A multi-host run's lock is held by
process 0; the others learn whether it was taken. Holding is re-entrant within a process, so `jtrainer train`
holds the lock over its whole job and `Trainer.train()` inside it does not take it again. On an object store
(gs://, s3://) the lock is an object with a heartbeat inside (`ObjectStoreRunLock`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import json
import logging
import os
import socket
import threading
import time
import uuid
from typing import Iterator

from jtrainer.core import storage
from jtrainer.core.errors import BadInput

logger = logging.getLogger(__name__)

LOCK_NAME = ".jtrainer.lock"
HEARTBEAT_S = 30.0
STALE_AFTER_S = 600.0  # a holder on another host is presumed dead after 10 minutes without a heartbeat


class OutputDirLocked(BadInput):
    """Another run holds the output_dir."""


@dataclasses.dataclass(frozen=True)
class LockHolder:
    host: str
    pid: int
    pid_start: str | None  # the process's start time as the kernel counts it (tells a reused pid apart)
    started: float  # when the run took the lock (Unix time)
    token: str

    @classmethod
    def this_process(cls) -> "LockHolder":
        return cls(socket.gethostname(), os.getpid(), _process_start(os.getpid()), time.time(), uuid.uuid4().hex)

    def describe(self) -> str:
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(self.started))
        return f"pid {self.pid} on host {self.host}, started {when}"


def _process_start(pid: int) -> str | None:
    """Field 22 of /proc/PID/stat (start time in clock ticks since boot); None where there is no /proc."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def _process_alive(pid: int, start: str | None) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        pass
    return start is None or _process_start(pid) in (None, start)


def _read_holder(path: str) -> LockHolder | None:
    """The lock's holder; None when the file is gone or unreadable (a lock being written is complete once it
    is visible, so unreadable means damaged)."""
    try:
        with open(path) as f:
            return LockHolder(**json.load(f))
    except FileNotFoundError:
        return None
    except (OSError, ValueError, TypeError):
        return LockHolder("unknown", -1, None, os.path.getmtime(path), "")


def is_stale(path: str, holder: LockHolder, stale_after_s: float = STALE_AFTER_S) -> bool:
    try:
        beat = os.path.getmtime(path)
    except FileNotFoundError:
        beat = None
    return _holder_gone(holder, beat, stale_after_s)


def _holder_gone(holder: LockHolder, last_beat: float | None, stale_after_s: float) -> bool:
    """A holder on this host is gone when its process is; one elsewhere when its last heartbeat (None: no lock
    left) is older than `stale_after_s`. A damaged lock (pid -1: empty or unreadable; locks are written whole and
    then linked into place) has no holder."""
    if holder.pid < 0:
        return True
    if holder.host == socket.gethostname() and holder.pid > 0:
        return not _process_alive(holder.pid, holder.pid_start)
    return last_beat is None or time.time() - last_beat > stale_after_s


class RunLock:
    """The lock of one output_dir, held by this process between `acquire()` and `release()`."""

    def __init__(self, folder: str, stale_after_s: float = STALE_AFTER_S, heartbeat_s: float = HEARTBEAT_S):
        self.folder = folder
        self.path = storage.join(folder, LOCK_NAME)
        self.stale_after_s, self.heartbeat_s = stale_after_s, heartbeat_s
        self.holder = LockHolder.this_process()
        self._created_folder = False
        self._stop = threading.Event()
        self._heartbeat: threading.Thread | None = None

    def acquire(self) -> "RunLock":
        if os.path.exists(self.folder) and not os.path.isdir(self.folder):
            raise BadInput(f"output_dir {self.folder!r} is a file, not a folder: choose another output_dir.")
        self._created_folder = not os.path.exists(self.folder)
        staged = f"{self.path}.{self.holder.token}"
        try:
            os.makedirs(self.folder, exist_ok=True)
            with open(staged, "w") as f:
                json.dump(dataclasses.asdict(self.holder), f)
        except OSError as e:
            raise BadInput(
                f"output_dir {self.folder!r} is not writable ({e.strerror}): fix its permissions or "
                "choose another output_dir."
            ) from None
        try:
            self._place(staged)
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(staged)
        self._heartbeat = threading.Thread(target=self._beat, name="jtrainer-lock-heartbeat", daemon=True)
        self._heartbeat.start()
        return self

    def _place(self, staged: str) -> None:
        for _ in range(3):  # a holder that leaves between our two looks: try again
            try:
                os.link(staged, self.path)
                return
            except FileExistsError:
                pass
            holder = _read_holder(self.path)
            if holder is None:
                continue
            if not is_stale(self.path, holder, self.stale_after_s):
                raise OutputDirLocked(
                    f"output_dir {self.folder!r} is in use by another jtrainer run ({holder.describe()}): wait for "
                    f"it to end or choose another output_dir (remove {self.path} only if that run is gone)."
                )
            self._take_over(staged, holder)
            return
        raise OutputDirLocked(f"output_dir {self.folder!r}: could not take its lock {self.path}; try again.")

    def _take_over(self, staged: str, stale: LockHolder) -> None:
        """Replace a dead holder's lock, under a second lock so two runs cannot both take it over."""
        guard = self.path + ".takeover"
        try:
            os.link(staged, guard)
        except FileExistsError:
            raise OutputDirLocked(f"output_dir {self.folder!r}: another run is taking over its lock; try again.")
        try:
            if _read_holder(self.path) != stale:
                raise OutputDirLocked(f"output_dir {self.folder!r}: its lock changed hands; try again.")
            os.replace(staged, self.path)
            logger.warning("Took over the lock of %s from a run that is gone (%s).", self.folder, stale.describe())
        finally:
            os.unlink(guard)

    def _beat(self) -> None:
        while not self._stop.wait(self.heartbeat_s):
            with contextlib.suppress(OSError):
                os.utime(self.path)

    def release(self) -> None:
        self._stop.set()
        if self._heartbeat is not None:
            self._heartbeat.join()
            self._heartbeat = None
        holder = _read_holder(self.path)
        if holder is not None and holder.token == self.holder.token:
            try:
                os.unlink(self.path)
            except OSError as error:  # a folder turned read-only: the next run takes the dead holder's lock over
                _unremovable(self.path, error)
        if self._created_folder:
            with contextlib.suppress(OSError):
                os.rmdir(self.folder)  # only if the run left it empty


class ObjectStoreRunLock(RunLock):
    """The lock of an output_dir on an object store (gs://, s3://): the lock object holds its holder and a
    heartbeat time rewritten every `heartbeat_s`. Object stores have no create-if-absent through fsspec, so the
    lock is written, then read back after a pause: of two runs starting together the later writer keeps it and
    the other stops (a run that starts during that pause can still slip through; one run per folder is then the
    user's to keep)."""

    settle_s = 1.0

    def acquire(self) -> "RunLock":
        if storage.isfile(self.folder):
            raise BadInput(f"output_dir {self.folder!r} is an object, not a folder: choose another output_dir.")
        found = self._read()
        if found is not None:
            holder, beat = found
            if not _holder_gone(holder, beat, self.stale_after_s):
                raise OutputDirLocked(
                    f"output_dir {self.folder!r} is in use by another jtrainer run ({holder.describe()}): wait for "
                    f"it to end or choose another output_dir (remove {self.path} only if that run is gone)."
                )
            logger.warning("Taking over the lock of %s from a run that is gone (%s).", self.folder, holder.describe())
        try:
            self._write()
        except OSError as e:
            raise BadInput(
                f"output_dir {self.folder!r} is not writable ({e}): check its permissions or choose another output_dir."
            ) from None
        time.sleep(self.settle_s)
        found = self._read()
        if found is None or found[0].token != self.holder.token:
            raise OutputDirLocked(f"output_dir {self.folder!r}: another run took its lock at the same time; try again.")
        self._heartbeat = threading.Thread(target=self._beat, name="jtrainer-lock-heartbeat", daemon=True)
        self._heartbeat.start()
        return self

    def _write(self) -> None:
        storage.write_text(self.path, json.dumps({"holder": dataclasses.asdict(self.holder), "beat": time.time()}))

    def _read(self) -> tuple[LockHolder, float] | None:
        if not storage.exists(self.path):
            return None
        try:
            saved = json.loads(storage.read_text(self.path))
            return LockHolder(**saved["holder"]), float(saved["beat"])
        except FileNotFoundError:
            return None
        except (OSError, ValueError, TypeError, KeyError):
            return LockHolder("unknown", -1, None, 0.0, ""), 0.0  # damaged: stale

    def _beat(self) -> None:
        while not self._stop.wait(self.heartbeat_s):
            with contextlib.suppress(OSError):
                self._write()

    def release(self) -> None:
        self._stop.set()
        if self._heartbeat is not None:
            self._heartbeat.join()
            self._heartbeat = None
        found = self._read()
        if found is not None and found[0].token == self.holder.token:
            try:
                storage.remove(self.path)
            except OSError as error:  # a folder turned read-only: the next run takes the dead holder's lock over
                _unremovable(self.path, error)


def _unremovable(path: str, error: OSError) -> None:
    """A lock left behind is taken over by the next run. When the disk itself refuses writes (read-only, full)
    the run's own error says so: this is said quietly, not a second time."""
    level = logging.INFO if error.errno in (errno.EROFS, errno.EACCES, errno.EPERM, errno.ENOSPC) else logging.WARNING
    logger.log(level, "Could not remove the lock %s (%s); the next run will take it over.", path, error)


def run_lock_for(folder: str) -> RunLock:
    return ObjectStoreRunLock(folder) if storage.is_url(folder) else RunLock(folder)


_held: dict[str, tuple[RunLock, int]] = {}  # realpath -> (lock, depth), for re-entrant holding
_held_guard = threading.Lock()


@contextlib.contextmanager
def hold(folder: str, is_main: bool = True) -> Iterator[None]:
    """Hold `folder`'s lock for the block. `is_main`: this process takes it (process 0 of a multi-host run); with
    several processes, all of them raise OutputDirLocked if process 0 could not take it."""
    import jax

    key = storage.normalize(folder) if storage.is_url(folder) else os.path.realpath(folder)
    with _held_guard:
        if key in _held:
            lock, depth = _held[key]
            _held[key] = (lock, depth + 1)
            nested = True
        else:
            nested = False
    if nested:
        try:
            yield
        finally:
            _leave(key)
        return
    lock, error = run_lock_for(folder), None
    if is_main:
        try:
            lock.acquire()
        except OutputDirLocked as e:
            error = e
    if jax.process_count() > 1:
        from jtrainer.parallel import distributed

        if distributed.agree_max(int(error is not None)) and error is None:
            if is_main:
                lock.release()
            error = OutputDirLocked(f"output_dir {folder!r} is in use by another run (process 0 could not lock it).")
    if error is not None:
        raise error
    with _held_guard:
        _held[key] = (lock, 1)
    try:
        yield
    finally:
        _leave(key, release=is_main)


def _leave(key: str, release: bool = True) -> None:
    with _held_guard:
        lock, depth = _held[key]
        if depth > 1:
            _held[key] = (lock, depth - 1)
            return
        del _held[key]
    if release:
        lock.release()
