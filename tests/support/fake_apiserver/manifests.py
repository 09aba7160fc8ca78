"""What the fake's own tests create and read: a multi-host RayCluster, a pod, an error's Status body."""

from __future__ import annotations

import json

from kubernetes.client.rest import ApiException

G, V, NS = "ray.io", "v1", "default"


def raycluster(name: str, *, replicas: int = 2, hosts: int = 4, labels: dict | None = None) -> dict:
    return {
        "apiVersion": "ray.io/v1",
        "kind": "RayCluster",
        "metadata": {"name": name, "labels": labels or {"app": "demo"}},
        "spec": {
            "rayVersion": "2.60.0",
            "headGroupSpec": {
                "rayStartParams": {},
                "template": {"spec": {"containers": [{
                    "name": "ray-head", "image": "rayproject/ray:2.60.0",
                    "resources": {"requests": {"cpu": "2", "memory": "8Gi"}, "limits": {"cpu": "2", "memory": "8Gi"}},
                }]}},
            },
            "workerGroupSpecs": [{
                "groupName": "tpu-v6e-4x4", "replicas": replicas, "minReplicas": 0, "maxReplicas": replicas,
                "numOfHosts": hosts, "rayStartParams": {},
                "template": {
                    "metadata": {"labels": {"team": "ml"}},
                    "spec": {
                        "nodeSelector": {"cloud.google.com/gke-tpu-accelerator": "tpu-v6e-slice",
                                         "cloud.google.com/gke-tpu-topology": "4x4"},
                        "tolerations": [{"key": "google.com/tpu", "operator": "Exists", "effect": "NoSchedule"}],
                        "containers": [{
                            "name": "ray-worker", "image": "rayproject/ray:2.60.0",
                            "resources": {"requests": {"google.com/tpu": "4", "cpu": "8"},
                                          "limits": {"google.com/tpu": "4"}},
                        }],
                    },
                },
            }],
        },
    }


def body_of(exc: ApiException) -> dict:
    return json.loads(exc.body)


def pod(name: str, labels: dict, *, node: str | None = None) -> dict:
    spec: dict = {"containers": [{"name": "c", "image": "busybox:1.36"}]}
    if node:
        spec["nodeName"] = node
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "labels": labels}, "spec": spec}
