"""Test-wide setup: a private Airflow home (SQLite) and quick API retries.

Set before Airflow is imported, so no test touches the user's Airflow installation.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import pytest
from cryptography.fernet import Fernet

_AIRFLOW_HOME = Path(tempfile.mkdtemp(prefix="raytpu-airflow-"))
(_AIRFLOW_HOME / "dags").mkdir()
os.environ.update(
    {
        "AIRFLOW_HOME": str(_AIRFLOW_HOME),
        "AIRFLOW__CORE__DAGS_FOLDER": str(_AIRFLOW_HOME / "dags"),
        "AIRFLOW__CORE__LOAD_EXAMPLES": "False",
        # As every deployment has one (a job task seals its secrets for the triggerer with it).
        "AIRFLOW__CORE__FERNET_KEY": Fernet.generate_key().decode(),
        "AIRFLOW__DATABASE__SQL_ALCHEMY_CONN": f"sqlite:///{_AIRFLOW_HOME}/airflow.db",
        # The test DAGs are written for a deployment with a triggerer: sensors and job tasks defer
        # unless a test says otherwise (Airflow's own default is False).
        "AIRFLOW__OPERATORS__DEFAULT_DEFERRABLE": "True",
        # Transient Kubernetes API errors are retried with backoff; keep it short in tests.
        "AIRFLOW__WORKERS__API_RETRY_WAIT_MIN": "0.05",
        "AIRFLOW__WORKERS__API_RETRY_WAIT_MAX": "0.5",
    }
)


@pytest.fixture(scope="session")
def airflow_home() -> Path:
    return _AIRFLOW_HOME


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    shutil.rmtree(_AIRFLOW_HOME, ignore_errors=True)
