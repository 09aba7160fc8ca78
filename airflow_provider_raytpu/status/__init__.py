"""Pure reading of KubeRay status into a small state model: no I/O, no clients.

- :mod:`.cluster`: a RayCluster's phase, read from the object and its pods.
- :mod:`.service`: a RayService's phase for one model version.
- :mod:`.diagnosis`: the text that explains a cluster or service that is not there yet.
- :mod:`.ray_nodes`: whether Ray's node list lets it reserve every TPU slice the pods promise.
- :mod:`.tpu_webhook`: whether GKE's TPU webhook gave the TPU pods their slice identity.

Every name is importable from ``airflow_provider_raytpu.status`` as well.
"""

from airflow_provider_raytpu.status.cluster import (
    HOST_INDEX_LABEL,
    NODE_TYPE_LABEL,
    RAY_UNCONFIRMED,
    REPLICA_INDEX_LABEL,
    TPU_WEBHOOK_MISSING,
    ClusterStatus,
    Phase,
    ReconcileFailureGrace,
    SliceStatus,
    desired_hosts,
    pod_is_ready,
    read_ray_cluster,
    read_slices,
)
from airflow_provider_raytpu.status.diagnosis import describe_replicas, diagnose_pods, diagnose_ray_service
from airflow_provider_raytpu.status.service import (
    APP_DEPLOY_FAILED,
    APP_DEPLOYING,
    APP_RUNNING,
    APP_UNHEALTHY,
    MODEL_VERSION_KEY,
    UPDATE_KEY,
    ApplicationState,
    DeploymentState,
    ServicePhase,
    ServiceStatus,
    read_ray_service,
    runs_config,
    spec_applications,
)

__all__ = [
    "APP_DEPLOYING",
    "APP_DEPLOY_FAILED",
    "APP_RUNNING",
    "APP_UNHEALTHY",
    "HOST_INDEX_LABEL",
    "MODEL_VERSION_KEY",
    "NODE_TYPE_LABEL",
    "RAY_UNCONFIRMED",
    "REPLICA_INDEX_LABEL",
    "TPU_WEBHOOK_MISSING",
    "UPDATE_KEY",
    "ApplicationState",
    "ClusterStatus",
    "DeploymentState",
    "Phase",
    "ReconcileFailureGrace",
    "ServicePhase",
    "ServiceStatus",
    "SliceStatus",
    "describe_replicas",
    "desired_hosts",
    "diagnose_pods",
    "diagnose_ray_service",
    "pod_is_ready",
    "read_ray_cluster",
    "read_ray_service",
    "read_slices",
    "runs_config",
    "spec_applications",
]
