"""The fake GCS for tests: a session fixture around :class:`FakeGcsServer` (shared with ``make demo``).

In a conftest: ``from tests.support.gcs import fake_gcs``.
"""

from __future__ import annotations

import os
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass

import pytest

from example_dags.demo.fake_gcs import FakeGcsServer

TEST_BUCKET = "raytpu-test"


@dataclass
class GcsStorage:
    """The session's fake GCS: the server, its bucket and the environment it needs.

    :param server: the running fake-gcs-server.
    :param bucket: a bucket that exists.
    :param env: the variables every process (Ray workers included) needs.
    """

    server: FakeGcsServer
    bucket: str
    env: dict[str, str]

    def uri(self, *parts: str) -> str:
        """``gs://<bucket>/<parts...>``, unique per call when ``parts`` is empty."""
        path = "/".join(p.strip("/") for p in parts) or uuid.uuid4().hex[:10]
        return f"gs://{self.bucket}/{path}"

    def objects(self, prefix: str) -> list[str]:
        """Object names in the bucket under ``prefix``."""
        return self.server.list_objects(self.bucket, prefix)


@pytest.fixture(scope="session")
def fake_gcs() -> Iterator[GcsStorage]:
    """A fake-gcs-server for the session, with its env vars (and Airflow's anonymous Google connection) set in
    ``os.environ``, and a bucket."""
    server = FakeGcsServer()
    server.start()
    saved = {key: os.environ.get(key) for key in server.airflow_env()}
    os.environ.update(server.airflow_env())
    try:
        server.create_bucket(TEST_BUCKET)
        yield GcsStorage(server=server, bucket=TEST_BUCKET, env=server.env())
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        server.stop()


def wait_for(predicate, timeout: float, interval: float = 0.2) -> bool:  # noqa: ANN001
    """Poll ``predicate`` until it is true or ``timeout`` seconds pass; return its last value."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value or time.monotonic() > deadline:
            return bool(value)
        time.sleep(interval)
