"""The namespace and the ``raytpu`` connection of the tests against the fake Kubernetes API server."""

from __future__ import annotations

import json

NAMESPACE = "ml"


def raytpu_connection(**extra: object) -> str:
    """The fake KubeRay's pods run no Ray (and no TPU webhook mutates them): READY is not confirmed with Ray,
    except where a test says so (``confirm_with_ray=True``, with a stub of Ray's State API)."""
    return json.dumps({"conn_type": "raytpu", "extra": {"backend": "kubernetes", "kubernetes_conn_id": "kube_test",
                                                        "namespace": NAMESPACE, "confirm_with_ray": False,
                                                        **extra}})
