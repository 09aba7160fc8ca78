"""One real Airflow deployment for the tier (see :mod:`tests.deployment.deployment`), driven through
its REST API only: the example DAGs and this directory's ``dags/`` in its DAG folder, the fake GCS,
and a ``raytpu_default`` connection to the local backend saved through the API as the UI saves it.

At the end every component is stopped by its PID, every local Ray cluster is deleted, and any
process still carrying the deployment's home in its environment is killed and reported.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.deployment.deployment import (
    COMPONENTS,
    EXPECTED_DAGS,
    REPO,
    AirflowDeployment,
    DeploymentError,
    local_backend,
    local_connection,
)
from tests.deployment.rest import AirflowApi
from tests.support.gcs import GcsStorage, fake_gcs  # noqa: F401  (fake_gcs is a fixture)

HERE = Path(__file__).resolve().parent
@pytest.fixture(scope="session")
def deployment(tmp_path_factory: pytest.TempPathFactory, fake_gcs: GcsStorage) -> Iterator[AirflowDeployment]:
    """Airflow's four components, healthy, with the DAGs parsed and ``raytpu_default`` saved."""
    root = tmp_path_factory.mktemp("airflow-deployment")
    dags = root / "dags"
    dags.mkdir()
    (dags / "examples").symlink_to(REPO / "example_dags", target_is_directory=True)
    (dags / "tests").symlink_to(HERE / "dags", target_is_directory=True)
    airflow = AirflowDeployment(root, dags, env=fake_gcs.env)
    try:
        airflow.migrate()
        for name in COMPONENTS:
            airflow.start(name)
        airflow.wait_healthy()
        api = airflow.login()
        api.wait("every DAG parsed", lambda: EXPECTED_DAGS <= api.dag_ids() or api.import_errors(), 180,
                 check=airflow.check_alive)
        api.save_connection(local_connection(airflow))
        yield airflow
    finally:
        airflow.stop_all()
        leftovers = _clean_up_ray(airflow)
    if leftovers:
        raise DeploymentError(f"processes outlived the deployment and were killed: {leftovers}")


@pytest.fixture(scope="session")
def api(deployment: AirflowDeployment) -> AirflowApi:
    """The logged-in REST client."""
    return deployment.api


def _clean_up_ray(airflow: AirflowDeployment) -> list[str]:
    """Delete every local cluster the tasks made; kill (and name) anything else still running for us."""
    backend = local_backend(airflow)
    for cluster in backend.list_clusters(None, ""):
        with contextlib.suppress(Exception):
            backend.delete_cluster(cluster["metadata"]["name"], cluster["metadata"]["namespace"])
    return airflow.kill_strays()


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    """Print the fault soak's record (scenarios, faults injected, invariants held) the soak attached."""
    for report in terminalreporter.stats.get("passed", []) + terminalreporter.stats.get("failed", []):
        for name, value in getattr(report, "user_properties", []):
            if name == "fault_soak" and getattr(report, "when", "") == "call":
                terminalreporter.write_sep("-", "fault soak")
                for scenario in value:
                    terminalreporter.write_line(json.dumps(scenario))
