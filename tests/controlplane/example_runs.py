"""The example DAGs (example_dags/) run with ``dag.test()`` against the session's control plane, and what
they leave to read: the demo bucket's committed orbax steps, a cluster's pods and the ones the virtual
kubelet ran for real, Ray's node list through the API server's service proxy."""

from __future__ import annotations

import json
import tempfile
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from example_dags.demo.fake_gcs import FakeGcsServer
from tests.controlplane.controlplane import ControlPlane
from tests.controlplane.support import dashboard_get, list_pods
from tests.support.airflow_runner import TaskOutcome, ensure_airflow_db, load_dag, outcomes

#: Every task's OpenLineage events in this tier, written by the OpenLineage provider's listener (a file
#: transport, set before Airflow loads its plugins: the provider reads its configuration once).
LINEAGE_EVENTS = Path(tempfile.mkdtemp(prefix="raytpu-lineage-")) / "events.jsonl"
EXAMPLES = Path(__file__).resolve().parents[2] / "example_dags"
V4, V6E = "tpu-v4-podslice", "tpu-v6e-slice"
BUCKET = "raytpu-demo"
ROWS = 600


def cp_json(cp: ControlPlane, path: str) -> dict[str, Any]:
    status, body = cp.request("GET", path, timeout=30)
    assert status == 200, (path, status, body[:500])
    return json.loads(body)


def conf(gcs: FakeGcsServer, **more: Any) -> dict[str, Any]:
    """``make demo``'s params (v4 2x2x2 to train, v6e 2x2 to serve), storage in the fake GCS."""
    from example_dags.demo.run import CONF

    return {**CONF, "storage": f"gs://{BUCKET}", **more}


def run_example(airflow_home: Path, dag_id: str, run_conf: dict[str, Any], day: int) -> dict[str, TaskOutcome]:
    """``dag.test()`` of the example DAG file as it is, for logical date 2026-12-<day>.

    The DAGs folder gets a symlink to the file (``dag.test()`` runs DAGs of the configured bundle);
    the DAG finds its ``pipeline`` package next to the file it resolves to.
    """
    ensure_airflow_db()
    link = airflow_home / "dags" / f"{dag_id}.py"
    if not link.is_symlink():
        link.symlink_to(EXAMPLES / f"{dag_id}.py")
    dag = load_dag(link, dag_id)
    return outcomes(dag.test(run_conf=run_conf, logical_date=datetime(2026, 12, day, tzinfo=UTC)))


def cluster_pods(cp: ControlPlane, namespace: str, cluster: str) -> list[dict[str, Any]]:
    return list_pods(cp, namespace, f"ray.io/cluster={cluster}")


def ran_for_real(cp: ControlPlane, namespace: str, cluster: str) -> set[str]:
    """The pods of ``cluster`` whose containers the virtual kubelet ran here and reported Ready."""
    assert cp.kubelet is not None
    return {what.split(" on ")[0] for action, what in cp.kubelet.events
            if action == "running (host processes)" and what.startswith(f"{namespace}/{cluster}-")}


def ray_nodes(cp: ControlPlane, namespace: str, cluster: str) -> list[dict[str, Any]]:
    """The cluster's alive Ray nodes, from Ray's state API through the API server's service proxy."""
    status, body = dashboard_get(cp, namespace, cluster, "/api/v0/nodes?detail=true&limit=100")
    assert status == 200, body[:500]
    return [n for n in json.loads(body)["data"]["result"]["result"] if n["state"] == "ALIVE"]


def committed_steps(gcs: FakeGcsServer, run_prefix: str) -> list[int]:
    """The orbax steps committed under ``checkpoints/<run>/orbax/``."""
    steps = set()
    for name in gcs.list_objects(BUCKET, run_prefix):
        step = name.split("/orbax/", 1)[-1].split("/")[0] if "/orbax/" in name else ""
        if step.isdigit() and name.endswith("commit_success.txt"):
            steps.add(int(step))
    return sorted(steps)
