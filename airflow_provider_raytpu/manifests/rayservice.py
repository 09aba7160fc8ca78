"""The RayService custom resource: a TPU RayCluster config plus a Ray Serve config, versioned.

``rayClusterConfig`` is the spec :func:`build_ray_cluster` renders for the same
:class:`TpuSlice`; ``serveConfigV2`` comes from :func:`build_serve_config` (with its
preflight). Only fields that exist in KubeRay v1.5.0 are rendered.

How a model version is recorded, and how a reader tells the clusters apart:

- ``raytpu.dev/model-version`` on the RayService: the version its spec asks for;
  ``raytpu.dev/version-history``: the versions deployed, a JSON list, newest last.
- The same ``raytpu.dev/model-version`` annotation on the head and TPU host pod
  templates inside ``rayClusterConfig`` (unless ``in_place``). KubeRay starts a
  pending cluster only when ``rayClusterConfig`` changes, and copies it verbatim into
  the RayCluster it creates; so writing the version there gives a zero-downtime switch
  to a fresh slice, and every RayCluster carries the version it was created for. The
  active cluster runs the requested version exactly when its head pod template says
  the version the RayService's ``rayClusterConfig`` says.
- ``raytpu.dev/version-args``: where each application takes the version (its
  ``version_arg``), so a rollback needs only the service (:func:`rolled_back_service`).
- ``raytpu.dev/update``: how the latest change reaches the service: ``created``,
  ``new-cluster`` (``rayClusterConfig`` changed) or ``in-place`` (only
  ``serveConfigV2`` changed, applied on the running cluster). After an in-place
  change the only proof that the active cluster runs it is Serve's own record of the
  deployed config (``deployed_app_config``), which readers then consult.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping, Sequence
from typing import Any

from airflow_provider_raytpu.errors import InvalidInputError
from airflow_provider_raytpu.manifests.merge import merge_fragment
from airflow_provider_raytpu.manifests.names import RAY_SERVICE_NAME_LIMIT, resource_name
from airflow_provider_raytpu.manifests.options import DEFAULT_CLUSTER_OPTIONS, RayClusterOptions
from airflow_provider_raytpu.manifests.raycluster import (
    ALSO_ADOPTS_ANNOTATION,
    API_VERSION,
    DAG_ID_KEY,
    KEY_PREFIX,
    MAP_INDEX_KEY,
    ORIGINATED_FROM_LABEL,
    RUN_ID_KEY,
    SPEC_HASH_ANNOTATION,
    TASK_ID_KEY,
    TPU_SLICE_ANNOTATION,
    AirflowOrigin,
    as_released_in_0_1,
    build_ray_cluster,
    owned_resource,
    spec_hash,
    tpu_slice_of,
)
from airflow_provider_raytpu.manifests.serve_preflight import serve_config_problems
from airflow_provider_raytpu.manifests.serveconfig import (
    ServeApplication,
    build_serve_config,
    parse_serve_config,
    render_serve_config,
    set_version_arg,
)
from airflow_provider_raytpu.tpu import TpuSlice

MODEL_VERSION_ANNOTATION = KEY_PREFIX + "model-version"
VERSION_HISTORY_ANNOTATION = KEY_PREFIX + "version-history"
VERSION_ARGS_ANNOTATION = KEY_PREFIX + "version-args"
ROLLED_BACK_BY_ANNOTATION = KEY_PREFIX + "rolled-back-by"
UPDATE_ANNOTATION = KEY_PREFIX + "update"
CREATED, NEW_CLUSTER, IN_PLACE = "created", "new-cluster", "in-place"
HISTORY_LIMIT = 10
VERSION_LIMIT = 1024
UPGRADE_STRATEGIES = ("NewCluster", "None")
SERVE_SERVICE_SUFFIX = "-serve-svc"
SERVE_PORT_NAME = "serve"


def serve_service_name(service_name: str) -> str:
    """The Kubernetes Service KubeRay puts in front of the active cluster's Serve proxies."""
    return f"{service_name}{SERVE_SERVICE_SUFFIX}"


def parse_version(value: Any, field: str = "version") -> str:
    """A model version as it is recorded: a non-empty string such as ``v7`` or a checkpoint URI."""
    text = str(value).strip() if isinstance(value, (str, int, float)) and not isinstance(value, bool) else ""
    if text in ("", "None"):
        raise InvalidInputError(
            field, value, "is not a model version",
            "Give a version string, e.g. 'v7' or the checkpoint URI the training task returned "
            "(\"{{ ti.xcom_pull('train')['checkpoint_uri'] }}\")",
        )
    if len(text) > VERSION_LIMIT:
        raise InvalidInputError(field, text[:40] + "...", f"is longer than {VERSION_LIMIT} characters",
                                "Use a shorter version, e.g. a checkpoint step or a short URI")
    return text


def _annotations(obj: Mapping[str, Any] | None) -> Mapping[str, str]:
    return ((obj or {}).get("metadata") or {}).get("annotations") or {}


def service_version(service: Mapping[str, Any] | None) -> str | None:
    """The version a RayService's spec asks for."""
    return _annotations(service).get(MODEL_VERSION_ANNOTATION)


def version_history(service: Mapping[str, Any] | None) -> list[str]:
    """The versions deployed to a RayService, oldest first (empty when unreadable)."""
    text = _annotations(service).get(VERSION_HISTORY_ANNOTATION)
    try:
        history = json.loads(text) if text else []
    except ValueError:
        return []
    return [str(v) for v in history] if isinstance(history, list) else []


def cluster_spec_version(cluster_spec: Mapping[str, Any] | None) -> str | None:
    """The version recorded on the head pod template of a RayCluster spec (or a ``rayClusterConfig``)."""
    template = ((cluster_spec or {}).get("headGroupSpec") or {}).get("template") or {}
    return ((template.get("metadata") or {}).get("annotations") or {}).get(MODEL_VERSION_ANNOTATION)


def cluster_version(cluster: Mapping[str, Any] | None) -> str | None:
    """The version a RayCluster (made by KubeRay from a RayService) was created for."""
    return cluster_spec_version((cluster or {}).get("spec"))


def update_kind(service: Mapping[str, Any] | None) -> str | None:
    """How the latest change reaches the service: ``created``, ``new-cluster`` or ``in-place``."""
    return _annotations(service).get(UPDATE_ANNOTATION)


def rollback_target(service: Mapping[str, Any]) -> str:
    """The version before the current one in the history (like ``kubectl rollout undo``, rolling back twice toggles).

    :raises InvalidInputError: the history has no earlier version.
    """
    current = service_version(service)
    history = version_history(service)
    for version in reversed(history):
        if version != current:
            return version
    name = (service.get("metadata") or {}).get("name")
    raise InvalidInputError(
        "rollback", True,
        f"RayService {name!r} has no earlier version to roll back to (history: {history}, current: {current!r})",
        "Promote a version explicitly with version=...",
    )


def next_history(history: Sequence[str], version: str, limit: int = HISTORY_LIMIT) -> list[str]:
    """The history after deploying ``version``: appended unless it is already the newest, bounded to ``limit``."""
    entries = list(history)
    if not entries or entries[-1] != version:
        entries.append(version)
    return entries[-limit:]


def _with_version(fragment: Mapping[str, Any] | None, version: str) -> dict[str, Any]:
    return merge_fragment(dict(fragment or {}), {"metadata": {"annotations": {MODEL_VERSION_ANNOTATION: version}}})


def build_ray_service(
    *,
    name: str,
    namespace: str,
    tpu: TpuSlice,
    applications: Sequence[ServeApplication | Mapping[str, Any]],
    version: str,
    current: Mapping[str, Any] | None = None,
    in_place: bool = False,
    upgrade_strategy: str = "NewCluster",
    serve_options: Mapping[str, Any] | None = None,
    options: RayClusterOptions = DEFAULT_CLUSTER_OPTIONS,
    origin: AirflowOrigin | None = None,
    cluster_deletion_delay_seconds: float | None = None,
    history_limit: int = HISTORY_LIMIT,
) -> dict[str, Any]:
    """Render a ray.io/v1 RayService serving ``applications`` at ``version`` on one slice shape.

    :param name: the RayService's name; normalised to an RFC 1123 label of at most 47 characters.
    :param namespace: the Kubernetes namespace.
    :param tpu: the slice shape of the serving cluster's TPU worker group.
    :param applications: the Serve applications (see :class:`ServeApplication`).
    :param version: the model version, e.g. a checkpoint URI; recorded as annotations and
        written into each application's ``version_arg``.
    :param current: the RayService as it exists now, if it does: the version history
        continues from it, and ``in_place`` keeps its cluster's version.
    :param in_place: change only ``serveConfigV2`` (KubeRay applies that on the running
        cluster); by default the version also goes into the cluster config, so KubeRay
        prepares a fresh cluster and switches to it when it serves.
    :param upgrade_strategy: ``spec.upgradeStrategy.type``: ``NewCluster`` or ``None``.
    :param serve_options: top-level Serve options (``http_options``, ``proxy_location``...).
    :param options: the serving cluster's image, resources, env, ray start flags, service
        account and pod-template fragments, and the RayService's labels and annotations
        (see :class:`RayClusterOptions`).
    :param origin: the Airflow task deploying it, recorded as labels and annotations.
    :param cluster_deletion_delay_seconds: ``rayClusterDeletionDelaySeconds``: how long
        KubeRay keeps the old cluster after a switch (its default is 60 s).
    :param history_limit: how many versions the history annotation keeps.
    :raises InvalidInputError: bad input, or a replica that cannot land on one slice.
    """
    name = resource_name(name, "service_name", RAY_SERVICE_NAME_LIMIT)
    version = parse_version(version)
    check_upgrade_strategy(upgrade_strategy, in_place)
    current_spec = (current or {}).get("spec") or {}
    kept = cluster_spec_version(current_spec.get("rayClusterConfig")) if in_place else None
    at_cluster = kept or version
    cluster_options = dataclasses.replace(
        options,
        head_pod_template=_with_version(options.head_pod_template, at_cluster),
        worker_pod_template=_with_version(options.worker_pod_template, at_cluster),
    )
    cluster = build_ray_cluster(name=name, namespace=namespace, tpu=tpu, options=cluster_options)
    serve = build_serve_config(applications, tpu, version=version, options=serve_options)
    spec: dict[str, Any] = {
        "upgradeStrategy": {"type": upgrade_strategy},
        "serveConfigV2": serve.yaml_text,
        "rayClusterConfig": cluster["spec"],
    }
    if cluster_deletion_delay_seconds is not None:
        spec["rayClusterDeletionDelaySeconds"] = round(cluster_deletion_delay_seconds)

    if current is None:
        update = CREATED
    elif spec_hash(current_spec.get("rayClusterConfig") or {}) == spec_hash(spec["rayClusterConfig"]):
        update = IN_PLACE if current_spec.get("serveConfigV2") != spec["serveConfigV2"] else (
            update_kind(current) or CREATED)
    else:
        update = NEW_CLUSTER
    apps = [ServeApplication.from_value(value, index) for index, value in enumerate(applications)]
    notes = {
        MODEL_VERSION_ANNOTATION: version,
        VERSION_HISTORY_ANNOTATION: json.dumps(next_history(version_history(current), version, history_limit)),
        VERSION_ARGS_ANNOTATION: json.dumps({app.name: app.version_arg for app in apps if app.version_arg},
                                            sort_keys=True),
        UPDATE_ANNOTATION: update,
    }
    released_in_0_1 = {**spec, "rayClusterConfig": as_released_in_0_1(spec["rayClusterConfig"], tpu, cluster_options)}
    return owned_resource("RayService", name, namespace, spec, tpu=tpu, options=options, origin=origin, notes=notes,
                          also_adopts=[spec_hash(released_in_0_1)])


def _version_args(service: Mapping[str, Any]) -> dict[str, str]:
    text = _annotations(service).get(VERSION_ARGS_ANNOTATION)
    if text is None:
        name = (service.get("metadata") or {}).get("name")
        raise InvalidInputError(
            "rollback", True,
            f"RayService {name!r} does not record where its applications take the version (it was deployed by an "
            "older version of this provider)",
            "Deploy it once with this version (a promotion of the current version is enough), then roll back",
        )
    return dict(json.loads(text))


def check_upgrade_strategy(upgrade_strategy: Any, in_place: bool) -> None:
    """Refuse an upgrade strategy KubeRay does not have, or ``None`` for a promotion of a new cluster.

    :raises InvalidInputError: naming the value and the strategies there are.
    """
    if upgrade_strategy not in UPGRADE_STRATEGIES:
        raise InvalidInputError(
            "upgrade_strategy", upgrade_strategy, "is not a KubeRay v1.5 upgrade strategy",
            f"Write one of {', '.join(repr(s) for s in UPGRADE_STRATEGIES)}",
        )
    if upgrade_strategy == "None" and not in_place:
        raise InvalidInputError(
            "upgrade_strategy", upgrade_strategy,
            "makes KubeRay ignore rayClusterConfig changes, so a promotion that writes the version into the "
            "cluster config would never reach the active cluster",
            "Set in_place=True (update only the Serve config on the running cluster), or keep "
            "upgrade_strategy='NewCluster'",
        )


def rolled_back_service(current: Mapping[str, Any], *, in_place: bool, origin: AirflowOrigin | None) -> dict[str, Any]:
    """``current`` promoted to the version before its current one (:func:`rollback_target`), from itself alone.

    Each application's recorded ``version_arg`` gets the target version; unless
    ``in_place``, so does the cluster config (KubeRay then prepares a fresh cluster). The
    labels, the owner and every other annotation stay; ``raytpu.dev/rolled-back-by``
    records the task that rolled back, so its retry keeps the rollback instead of toggling.

    :param current: the RayService as stored.
    :param in_place: change only the Serve config (the cluster config keeps its version).
    :param origin: the Airflow task rolling back.
    :raises InvalidInputError: no earlier version, or a service that does not record its version args.
    """
    target = rollback_target(current)
    version_args = _version_args(current)
    spec = json.loads(json.dumps(current.get("spec") or {}))
    config = parse_serve_config(spec.get("serveConfigV2"))
    for app in config.get("applications") or []:
        if path := version_args.get(app.get("name")):
            args = app.setdefault("args", {})
            set_version_arg(args, path, target, app["name"])
    spec["serveConfigV2"] = render_serve_config(config)
    cluster = spec.get("rayClusterConfig") or {}
    if not in_place:
        for holder in [cluster.get("headGroupSpec") or {}, *(cluster.get("workerGroupSpecs") or [])]:
            holder["template"] = _with_version(holder.get("template"), target)
    changed_cluster = spec_hash(cluster) != spec_hash((current.get("spec") or {}).get("rayClusterConfig") or {})
    metadata = current.get("metadata") or {}
    notes = {
        **{k: v for k, v in _annotations(current).items() if k not in (SPEC_HASH_ANNOTATION, ALSO_ADOPTS_ANNOTATION)},
        MODEL_VERSION_ANNOTATION: target,
        VERSION_HISTORY_ANNOTATION: json.dumps(next_history(version_history(current), target)),
        UPDATE_ANNOTATION: NEW_CLUSTER if changed_cluster else IN_PLACE,
        SPEC_HASH_ANNOTATION: spec_hash(spec),
    }
    if origin:
        notes[ROLLED_BACK_BY_ANNOTATION] = json.dumps([*_task_of(origin), target])
    return {
        "apiVersion": API_VERSION,
        "kind": "RayService",
        "metadata": {"name": metadata.get("name"), "namespace": metadata.get("namespace"),
                     "labels": dict(metadata.get("labels") or {}), "annotations": notes},
        "spec": spec,
    }


def rolled_back_by(service: Mapping[str, Any] | None, origin: AirflowOrigin) -> bool:
    """Whether ``origin`` (an earlier try of the same task) rolled the service back to the version it serves now."""
    text = _annotations(service).get(ROLLED_BACK_BY_ANNOTATION)
    try:
        recorded = json.loads(text) if text else None
    except ValueError:
        return False
    return recorded == [*_task_of(origin), service_version(service)]


def _task_of(origin: AirflowOrigin) -> list[Any]:
    """The task try's identity as the rolled-back-by annotation records it (a map index only when mapped)."""
    task: list[Any] = [origin.dag_id, origin.run_id, origin.task_id]
    return task + [origin.map_index] if origin.map_index >= 0 else task


def ray_cluster_of(service: Mapping[str, Any], cluster_name: str) -> dict[str, Any]:
    """A RayCluster manifest with the RayService's ``rayClusterConfig``, slice annotation and owner (DAG, task).

    The version annotations are left out of its pod templates, so every version maps to
    the same cluster (the local backend redeploys Serve on it instead of starting another).

    :param service: the RayService.
    :param cluster_name: the RayCluster's name.
    """
    spec = json.loads(json.dumps((service.get("spec") or {}).get("rayClusterConfig") or {}))
    for template in [(spec.get("headGroupSpec") or {}).get("template") or {}] + [
        (group.get("template") or {}) for group in spec.get("workerGroupSpecs") or []
    ]:
        notes = (template.get("metadata") or {}).get("annotations")
        if notes is not None:
            notes.pop(MODEL_VERSION_ANNOTATION, None)
            if not notes:
                template["metadata"].pop("annotations")
            if not template["metadata"]:
                template.pop("metadata")
    metadata = service.get("metadata") or {}
    source = _annotations(service)
    # The cluster belongs to the service (its DAG and task), not to the run that promoted it last.
    labels = {k: v for k, v in (metadata.get("labels") or {}).items() if k != RUN_ID_KEY}
    return {
        "apiVersion": API_VERSION,
        "kind": "RayCluster",
        "metadata": {
            "name": cluster_name,
            "namespace": metadata.get("namespace", "default"),
            "labels": {**labels, ORIGINATED_FROM_LABEL: metadata.get("name", "")},
            "annotations": {
                **{k: v for k, v in source.items()
                   if k in (TPU_SLICE_ANNOTATION, DAG_ID_KEY, TASK_ID_KEY, MAP_INDEX_KEY)},
                SPEC_HASH_ANNOTATION: spec_hash(spec),
            },
        },
        "spec": spec,
    }


def service_config_problems(service: dict[str, Any]) -> list[str]:
    """What in a RayService's Serve config cannot be scheduled on one of its slices, one line each."""
    tpu = tpu_slice_of(service)
    if tpu is None:
        return []
    config = parse_serve_config((service.get("spec") or {}).get("serveConfigV2"))
    return [str(problem) for problem in serve_config_problems(config, tpu)]
