"""Where a run reads and writes: a local folder or an object-store URL (gs://, s3://), through one small layer.

Local paths keep the plain `os`/`shutil` behaviour (atomic renames included). URLs go through fsspec (gcsfs,
s3fs); orbax and tensorstore take the URL itself. Object stores have no rename and no real folders, so callers
ask `is_url` where that matters (the checkpoint commit protocol does). Files that libraries insist on writing to
a local path (safetensors, tokenizers, TrainerState) are written into a local staging folder and uploaded
(`staged_folder`); folders read the same way are downloaded once (`local_folder`).
"""

from __future__ import annotations

import contextlib
import os
import posixpath
import shutil
import tempfile
import threading
from collections.abc import Iterator
from typing import IO

# Schemes tensorstore (orbax's array store) can write as well as fsspec: the ones an output_dir may use.
OUTPUT_SCHEMES = ("gs", "s3")
_PACKAGES = {"gs": "gcsfs", "s3": "s3fs"}


def scheme(path: str) -> str | None:
    """The URL scheme of `path` ("gs", "s3", ...), None for a local path (file:// counts as local)."""
    head, sep, _ = str(path).partition("://")
    if not sep or not head.isidentifier() or head == "file":
        return None
    return head


def is_url(path: str) -> bool:
    return scheme(path) is not None


def normalize(path: str) -> str:
    """A local path made absolute (`~` expanded, file:// dropped); a URL without its trailing slash."""
    path = str(path)
    if path.startswith("file://"):
        path = path[len("file://") :]
    if is_url(path):
        return path.rstrip("/")
    return os.path.abspath(os.path.expanduser(path))


def check_output_url(path: str, argument: str = "output_dir") -> None:
    """Refuse a URL an output folder cannot live at, naming the argument and the fix (before any work)."""
    found = scheme(path)
    if found is None:
        return
    from jtrainer.core.errors import BadInput

    if found not in OUTPUT_SCHEMES:
        raise BadInput(
            f"{argument} {path!r}: {found}:// cannot hold checkpoints (orbax writes arrays through "
            f"tensorstore, which knows {', '.join(s + '://' for s in OUTPUT_SCHEMES)}): use one of "
            "those or a local folder."
        )
    try:
        __import__(_PACKAGES[found])
    except ImportError:
        raise BadInput(
            f"{argument} {path!r} needs the {_PACKAGES[found]} package: pip install "
            f"{_PACKAGES[found]} (or pip install 'jtrainer[cloud]')."
        ) from None


def check_reachable(path: str, argument: str) -> None:
    """Refuse in one line a URL whose storage service gives no answer (a wrong endpoint, no network, refused
    credentials) within JTRAINER_STORAGE_TIMEOUT seconds, instead of the client's own error after its retries."""
    if not is_url(path):
        return
    from jtrainer.core import env
    from jtrainer.core.errors import BadInput

    outcome: dict[str, BaseException | bool] = {}

    def probe() -> None:
        try:
            exists(path)
            outcome["answered"] = True
        except BaseException as error:  # reported below, in the caller's thread
            outcome["error"] = error

    seconds = env.STORAGE_TIMEOUT.get_int() or 30
    thread = threading.Thread(target=probe, name="jtrainer-storage-probe", daemon=True)
    thread.start()
    thread.join(seconds)
    if outcome.get("answered"):
        return
    error = outcome.get("error")
    cause = (
        f"no answer within {seconds} s" if error is None else f"{type(error).__name__}: {str(error).splitlines()[0]}"
    )
    raise BadInput(
        f"{argument} {path!r}: the {scheme(path)}:// storage service cannot be reached ({cause}): check the network, "
        "the credentials and the endpoint, then run again."
    )


def _fs(path: str):
    import fsspec

    return fsspec.core.url_to_fs(path)


def join(base: str, *names: str) -> str:
    return posixpath.join(base, *names) if is_url(base) else os.path.join(base, *names)


def basename(path: str) -> str:
    return posixpath.basename(path.rstrip("/")) if is_url(path) else os.path.basename(os.path.normpath(path))


def exists(path: str) -> bool:
    if not is_url(path):
        return os.path.exists(path)
    fs, p = _fs(path)
    return fs.exists(p)


def isdir(path: str) -> bool:
    if not is_url(path):
        return os.path.isdir(path)
    fs, p = _fs(path)
    return fs.isdir(p)


def isfile(path: str) -> bool:
    if not is_url(path):
        return os.path.isfile(path)
    fs, p = _fs(path)
    return fs.isfile(p)


def getsize(path: str) -> int:
    if not is_url(path):
        return os.path.getsize(path)
    fs, p = _fs(path)
    return int(fs.info(p)["size"])


def listdir(path: str) -> list[str]:
    """The names directly under `path` ([] when it does not exist)."""
    if not is_url(path):
        return os.listdir(path) if os.path.isdir(path) else []
    fs, p = _fs(path)
    if not fs.isdir(p):
        return []
    fs.invalidate_cache(p)  # another process (or host) may have written since we last looked
    return sorted({posixpath.basename(entry.rstrip("/")) for entry in fs.ls(p, detail=False)} - {""})


def files_under(folder: str) -> list[str]:
    """Every file below `folder`, as paths relative to it (posix separators for URLs), sorted."""
    if not is_url(folder):
        return sorted(
            os.path.relpath(os.path.join(root, name), folder) for root, _, names in os.walk(folder) for name in names
        )
    fs, p = _fs(folder)
    fs.invalidate_cache(p)
    prefix = p.rstrip("/") + "/"
    return sorted(found[len(prefix) :] for found in fs.find(p) if found.startswith(prefix))


def makedirs(path: str) -> None:
    if not is_url(path):
        os.makedirs(path, exist_ok=True)
        return
    fs, p = _fs(path)
    fs.makedirs(p, exist_ok=True)  # object stores: nothing to create (a prefix exists once it holds a file)


def open_file(path: str, mode: str = "r", **kwargs) -> IO:
    if not is_url(path):
        return open(path, mode, **kwargs)
    fs, p = _fs(path)
    return fs.open(p, mode, **kwargs)


def read_text(path: str) -> str:
    with open_file(path, "r", encoding="utf-8") as f:
        return f.read()


def write_text(path: str, text: str) -> None:
    with open_file(path, "w", encoding="utf-8") as f:
        f.write(text)


def remove(path: str) -> None:
    if not is_url(path):
        os.unlink(path)
        return
    fs, p = _fs(path)
    fs.rm_file(p)


def rmtree(path: str) -> None:
    """Remove a folder and everything under it; nothing happens when it is not there."""
    if not is_url(path):
        shutil.rmtree(path, ignore_errors=True)
        return
    fs, p = _fs(path)
    with contextlib.suppress(FileNotFoundError):
        fs.rm(p, recursive=True)
    fs.invalidate_cache(p)


def digest(path: str) -> dict:
    """What the manifest records of a file: its size and a content hash. Local files are hashed (sha256);
    object stores already keep a hash of every object (GCS crc32c/md5, S3 ETag), which is read instead of
    downloading the bytes again."""
    if is_url(path):
        fs, p = _fs(path)
        info = fs.info(p)
        for key in ("crc32c", "md5Hash", "ETag", "etag"):
            if info.get(key):
                return {key: str(info[key]).strip('"'), "bytes": int(info["size"])}
    import hashlib

    h = hashlib.sha256()
    with open_file(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return {"sha256": h.hexdigest(), "bytes": getsize(path)}


@contextlib.contextmanager
def staged_folder(folder: str) -> Iterator[str]:
    """A local folder to write `folder`'s files into: `folder` itself when local; for a URL, a temporary
    folder uploaded into it when the block ends without an error."""
    if not is_url(folder):
        os.makedirs(folder, exist_ok=True)
        yield folder
        return
    with tempfile.TemporaryDirectory(prefix="jtrainer-stage-") as local:
        yield local
        upload(local, folder)


def upload(local_folder: str, folder: str) -> None:
    """Copy every file of a local folder to the same relative paths under `folder` (a URL)."""
    fs, p = _fs(folder)
    for rel in files_under(local_folder):
        fs.put_file(os.path.join(local_folder, rel), posixpath.join(p, rel.replace(os.sep, "/")))
    fs.invalidate_cache(p)


@contextlib.contextmanager
def local_folder(folder: str) -> Iterator[str]:
    """`folder` as a local path to read from: itself when local, else a temporary download of it."""
    if not is_url(folder):
        yield folder
        return
    with tempfile.TemporaryDirectory(prefix="jtrainer-fetch-") as local:
        _download(folder, local)
        yield local


def _download(folder: str, local: str) -> None:
    """Copy every file under `folder` (a URL) to the same relative paths under the local folder `local`."""
    fs, p = _fs(folder)
    for rel in files_under(folder):
        target = os.path.join(local, *rel.split("/"))
        os.makedirs(os.path.dirname(target), exist_ok=True)
        fs.get_file(posixpath.join(p, rel), target)


_FETCHED: dict[str, str] = {}


def fetched(folder: str) -> str:
    """`folder` as a local path for the rest of the process: itself when local; a URL is downloaded once (a
    model or tokenizer folder that `from_pretrained` reads more than once) and removed at exit."""
    if not is_url(folder):
        return folder
    key = normalize(folder)
    if key not in _FETCHED:
        import atexit

        local = tempfile.mkdtemp(prefix="jtrainer-fetch-")
        atexit.register(shutil.rmtree, local, True)
        _download(key, local)
        _FETCHED[key] = local
    return _FETCHED[key]
