"""Diagnosis text: why a RayCluster is not ready, why a RayService does not serve yet.

Each function turns a status and what was read alongside it (pods, events, Serve's
record) into lines a person reads in the task log.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from typing import Any

from airflow_provider_raytpu.status.cluster import (
    HOST_INDEX_LABEL,
    NODE_TYPE_LABEL,
    REPLICA_INDEX_LABEL,
    ClusterStatus,
    pod_is_ready,
)
from airflow_provider_raytpu.status.conditions import conditions
from airflow_provider_raytpu.status.service import APP_RUNNING, ServiceStatus


def diagnose_pods(
    status: ClusterStatus, pods: Iterable[Mapping[str, Any]], events: Iterable[Mapping[str, Any]] = ()
) -> str:
    """Explain a cluster that is not ready: its state, then each pod that is not ready and why.

    :param status: the cluster's status.
    :param pods: the cluster's pods.
    :param events: core/v1 events of the namespace (scheduling failures are read from them).
    """
    pods, events = list(pods), list(events)
    lines = [f"{status.phase.value}: {status.message}"]
    unready = [p for p in pods if not pod_is_ready(p)]
    for pod in sorted(unready, key=lambda p: p.get("metadata", {}).get("name", "")):
        lines.append(f"- {_pod_label(pod)}: {_pod_reason(pod, events)}")
    workers = [p for p in pods if (p.get("metadata", {}).get("labels") or {}).get(NODE_TYPE_LABEL) == "worker"]
    missing = status.desired_hosts - len(workers)
    if missing > 0:
        lines.append(f"- {missing} TPU host pod(s) not created yet")
    return "\n".join(lines)


def _pod_label(pod: Mapping[str, Any]) -> str:
    labels = pod.get("metadata", {}).get("labels") or {}
    name = pod.get("metadata", {}).get("name", "?")
    if labels.get(NODE_TYPE_LABEL) == "head":
        return f"head (pod {name})"
    if REPLICA_INDEX_LABEL not in labels:
        return f"worker (pod {name})"
    host = labels.get(HOST_INDEX_LABEL)
    return f"slice {labels[REPLICA_INDEX_LABEL]}{f' host {host}' if host else ''} (pod {name})"


def _pod_reason(pod: Mapping[str, Any], events: Iterable[Mapping[str, Any]]) -> str:
    status = pod.get("status") or {}
    scheduled = conditions(status).get("PodScheduled")
    if scheduled and scheduled.get("status") == "False":
        return f"{scheduled.get('reason', 'not scheduled')}: {scheduled.get('message', '')}".rstrip(": ")
    name = pod.get("metadata", {}).get("name")
    mine = [e for e in events if (e.get("involvedObject") or {}).get("name") == name and e.get("type") == "Warning"]
    if mine:
        latest = max(mine, key=lambda e: e.get("lastTimestamp") or e.get("eventTime") or "")
        return f"{latest.get('reason')}: {latest.get('message', '')}"
    waiting = [
        c["state"]["waiting"] for c in status.get("containerStatuses") or [] if (c.get("state") or {}).get("waiting")
    ]
    if waiting:
        return f"{waiting[0].get('reason', 'waiting')}: {waiting[0].get('message', '')}".rstrip(": ")
    phase: str = status.get("phase", "unknown phase")
    return phase


def describe_replicas(details: Mapping[str, Any]) -> list[str]:
    """Replicas waiting to start, per deployment, from Serve's record of one application.

    Serve lists replicas without their version: during a rollout a RUNNING replica may be the
    previous version's, kept while the new ones wait, so waiting ones are counted, not
    RUNNING against the target.
    """
    lines = []
    for name, deployment in sorted((details.get("deployments") or {}).items()):
        states: dict[str, int] = {}
        for replica in deployment.get("replicas") or []:
            states[replica.get("state", "?")] = states.get(replica.get("state", "?"), 0) + 1
        running = states.get("RUNNING", 0)
        starting = {s: n for s, n in states.items() if s not in ("RUNNING", "STOPPING")}
        target = deployment.get("target_num_replicas")
        missing = max(0, (target or 0) - running - sum(starting.values()))
        waiting = sum(starting.values()) + missing
        if waiting <= 0:
            continue
        parts = [f"{n} {s}" for s, n in sorted(starting.items())] + ([f"{missing} not created yet"] if missing else [])
        resources = deployment.get("required_resources")
        lines.append(
            f"deployment {name!r}: {waiting} replica(s) waiting to start ({', '.join(parts)}), {running} RUNNING, "
            f"{target} wanted" + (f"; each replica needs {json.dumps(resources, sort_keys=True)}" if resources else "")
        )
    return lines


def diagnose_ray_service(
    status: ServiceStatus,
    *,
    waited: float | None = None,
    serve_applications: Mapping[str, Any] | None = None,
    cluster_diagnosis: str = "",
    config_problems: Iterable[str] = (),
) -> str:
    """Explain a RayService that is not serving the requested version.

    Lists each application that is not RUNNING on the cluster meant to serve it with each
    deployment's message (Serve says how many replicas wait to be scheduled), the replica
    counts when Serve was read, the state of that cluster's slices, and anything in the
    Serve config that cannot be scheduled on one slice (a missing TPU topology).

    :param status: the service's status.
    :param waited: how long the application has been deploying, in seconds.
    :param serve_applications: Serve's ``applications`` on the cluster, when read.
    :param cluster_diagnosis: :meth:`ClusterBackend.diagnose` of that cluster.
    :param config_problems: problems found in the Serve config, one line each.
    """
    target = status.target_cluster
    role = "pending" if status.pending_cluster else "active"
    head = f"{status.phase.value}: {status.message}"
    if waited is not None:
        head = f"{head} (deploying for {waited:.0f} s)"
    lines = [head]
    for app in status.applications_on(role):
        if app.status == APP_RUNNING:
            continue
        lines.append(f"- application {app.name!r} {app.status} on {role} RayCluster {target}"
                     + (f": {app.message}" if app.message else ""))
        for deployment in app.deployments:
            if deployment.status != "HEALTHY":
                lines.append(f"  - deployment {deployment.name!r} {deployment.status}"
                             + (f": {deployment.message}" if deployment.message else ""))
        for line in describe_replicas((serve_applications or {}).get(app.name) or {}):
            lines.append(f"  - {line}")
    if cluster_diagnosis:
        lines.append(f"RayCluster {target or '(none yet)'} ({role}):")
        lines.extend(f"  {line}" for line in cluster_diagnosis.splitlines())
    problems = list(config_problems)
    if problems:
        lines.append("Serve config problems (a replica that cannot land on one slice waits forever):")
        lines.extend(f"- {p}" for p in problems)
    else:
        lines.append("Serve config: every multi-host replica declares its slice topology or its bundles")
    return "\n".join(lines)
