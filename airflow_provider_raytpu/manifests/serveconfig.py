"""The Ray Serve config of a RayService (``serveConfigV2``), and the preflight that keeps a replica on one slice.

A multi-host model must land on ONE slice. Ray Serve LLM gang-schedules a replica onto
a slice only when its ``LLMConfig`` has ``accelerator_type`` and
``accelerator_config: {kind: tpu, topology: ...}``; without the topology it reserves
one bundle per chip, which can span two slices, and the service sits in DEPLOYING
forever. A plain Serve deployment whose replica needs more chips than one host has is
the same trap unless it declares placement-group bundles, one per host. So the builder
writes the LLM fields from the :class:`TpuSlice`, and :func:`preflight_serve_config`
refuses what cannot be scheduled on the slice, before anything is applied
(:mod:`~airflow_provider_raytpu.manifests.serve_preflight`).

The LLMConfig field names (``accelerator_type``, ``accelerator_config.kind``,
``accelerator_config.topology``) are those of ``ray.llm._internal.serve.core.configs``
in Ray 2.60; ``ray.serve.llm`` is never imported here (it needs vLLM).
"""

from __future__ import annotations

import copy
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import yaml

from airflow_provider_raytpu.errors import InvalidInputError
from airflow_provider_raytpu.manifests.serve_preflight import (
    fill_llm_config,
    is_llm_import_path,
    llm_configs,
    preflight_serve_config,
    where_in_config,
)
from airflow_provider_raytpu.tpu import TpuSlice

_APPLICATION_KEYS = ("name", "import_path", "route_prefix", "args", "deployments", "runtime_env", "version_arg")
_IMPORT_PATH = re.compile(r"^[A-Za-z_][\w.]*[:.][A-Za-z_]\w*$")


@dataclass(frozen=True)
class ServeApplication:
    """One Ray Serve application of a RayService, as in a Serve config file.

    :param name: the application's name (unique in the RayService).
    :param import_path: ``module:attribute`` of the application or its builder, e.g.
        ``ray.serve.llm:build_openai_app`` or ``my_models.serve:build_app``.
    :param route_prefix: the HTTP route, e.g. ``"/"``; ``None`` for no HTTP route.
    :param args: the builder's arguments (for Ray Serve LLM: ``{"llm_configs": [...]}``).
    :param deployments: per-deployment option overrides (``name``, ``num_replicas``,
        ``ray_actor_options``, ``placement_group_bundles``, ...).
    :param runtime_env: the application's Ray runtime_env.
    :param version_arg: where the model version goes in ``args``, a dotted path such as
        ``"checkpoint_uri"`` or ``"llm_configs.0.model_loading_config.model_source"``;
        promoting or rolling back then changes exactly that argument.
    """

    name: str
    import_path: str
    route_prefix: str | None = "/"
    args: Mapping[str, Any] | None = None
    deployments: Sequence[Mapping[str, Any]] | None = None
    runtime_env: Mapping[str, Any] | None = None
    version_arg: str | None = None

    @property
    def is_llm(self) -> bool:
        """Whether the application is built by Ray Serve LLM (``ray.serve.llm:build_openai_app`` and kin)."""
        return is_llm_import_path(self.import_path)

    @classmethod
    def from_value(cls, value: Any, index: int) -> ServeApplication:
        """Read one entry of an operator's ``applications``: a :class:`ServeApplication` or a dict."""
        if isinstance(value, ServeApplication):
            return value
        where = f"applications[{index}]"
        if not isinstance(value, Mapping):
            raise InvalidInputError(
                where, value, "is not a Serve application",
                "Give a dict with name, import_path and optionally route_prefix, args, deployments, runtime_env, "
                "version_arg",
            )
        if unknown := sorted(set(value) - set(_APPLICATION_KEYS)):
            raise InvalidInputError(where, unknown, "are not fields of a Serve application",
                                    f"Use only: {', '.join(_APPLICATION_KEYS)}")
        for key in ("name", "import_path"):
            if not isinstance(value.get(key), str) or not value[key].strip():
                raise InvalidInputError(f"{where}.{key}", value.get(key), "is required",
                                        "Give e.g. name='llm', import_path='ray.serve.llm:build_openai_app'")
        return cls(**dict(value))


def _check_application(app: ServeApplication, seen: set[str]) -> None:
    if app.name in seen:
        raise InvalidInputError(where_in_config(app.name, "name"), app.name, "is used by two applications",
                                "Give every application its own name")
    seen.add(app.name)
    if not _IMPORT_PATH.match(app.import_path):
        raise InvalidInputError(where_in_config(app.name, "import_path"), app.import_path, "is not an import path",
                                "Write 'module:attribute', e.g. 'ray.serve.llm:build_openai_app'")
    if app.route_prefix is not None and (not isinstance(app.route_prefix, str) or not app.route_prefix.startswith("/")):
        raise InvalidInputError(where_in_config(app.name, "route_prefix"), app.route_prefix, "is not an HTTP route",
                                "Write a path starting with '/', e.g. '/' or '/llm'")
    for key, kind in (("args", Mapping), ("runtime_env", Mapping), ("deployments", (list, tuple))):
        value = getattr(app, key)
        if value is not None and not isinstance(value, kind):
            raise InvalidInputError(where_in_config(app.name, key), value,
                                    f"is not a {'list' if key == 'deployments' else 'dict'}",
                                    "See the Ray Serve config file reference")
    for index, deployment in enumerate(app.deployments or ()):
        if not isinstance(deployment, Mapping) or not isinstance(deployment.get("name"), str):
            raise InvalidInputError(where_in_config(app.name, f"deployments[{index}]"), deployment,
                                    "is not a deployment override with a name",
                                    "Write e.g. {'name': 'Model', 'num_replicas': 1}")


def set_version_arg(args: dict[str, Any], path: str, version: str, app: str) -> None:
    """Write ``version`` at a dotted ``path`` of ``args`` (list items by index), creating missing dicts."""
    keys = path.split(".")
    node: Any = args
    for depth, key in enumerate(keys):
        last = depth == len(keys) - 1
        if isinstance(node, list):
            if not key.isdigit() or int(key) >= len(node):
                raise InvalidInputError(
                    where_in_config(app, "version_arg"), path, f"indexes {key!r} into a list of {len(node)} items",
                    "Point it at an existing list item, e.g. 'llm_configs.0.model_loading_config.model_source'",
                )
            if last:
                node[int(key)] = version
            else:
                node = node[int(key)]
        elif isinstance(node, dict):
            if last:
                node[key] = version
            else:
                node = node.setdefault(key, {})
        else:
            raise InvalidInputError(where_in_config(app, "version_arg"), path,
                                    f"passes through {node!r}, which is not a dict",
                                    "Point it at a key of args, e.g. 'checkpoint_uri'")


def application_config(app: ServeApplication, version: str | None = None) -> dict[str, Any]:
    """The application as a Serve config entry; the version written at ``version_arg``."""
    config: dict[str, Any] = {"name": app.name, "route_prefix": app.route_prefix, "import_path": app.import_path}
    if app.runtime_env:
        config["runtime_env"] = copy.deepcopy(dict(app.runtime_env))
    args = copy.deepcopy(dict(app.args or {}))
    if app.version_arg:
        if version is None:
            raise InvalidInputError(where_in_config(app.name, "version_arg"), app.version_arg, "needs a version",
                                    "Give the operator a version, e.g. the checkpoint URI")
        set_version_arg(args, app.version_arg, version, app.name)
    if args:
        config["args"] = args
    if app.deployments:
        config["deployments"] = [copy.deepcopy(dict(d)) for d in app.deployments]
    return config


@dataclass(frozen=True)
class ServeConfig:
    """A rendered Serve config: the dict and its ``serveConfigV2`` YAML.

    :param config: the config as a dict.
    :param yaml_text: the YAML string KubeRay takes as ``serveConfigV2``.
    """

    config: dict[str, Any]
    yaml_text: str = field(repr=False)


def build_serve_config(
    applications: Sequence[ServeApplication | Mapping[str, Any]],
    tpu: TpuSlice,
    *,
    version: str | None = None,
    options: Mapping[str, Any] | None = None,
) -> ServeConfig:
    """Render the Serve config of a RayService on ``tpu`` and run the preflight.

    Ray Serve LLM applications get ``accelerator_type`` and
    ``accelerator_config: {kind: tpu, topology}`` from the slice where they do not
    set them; an application with ``version_arg`` gets ``version`` at that path.

    :param applications: the applications (:class:`ServeApplication` or dicts of its fields).
    :param tpu: the slice shape the RayService's cluster has.
    :param version: the model version being deployed.
    :param options: top-level Serve options (``http_options``, ``proxy_location``, ``logging_config``).
    :raises InvalidInputError: an application cannot be scheduled on one slice, or is malformed.
    """
    if not isinstance(applications, (list, tuple)) or not applications:
        raise InvalidInputError("applications", applications, "is empty",
                                "Give at least one Serve application (name, import_path, args)")
    apps = [ServeApplication.from_value(value, index) for index, value in enumerate(applications)]
    seen: set[str] = set()
    rendered = []
    for app in apps:
        _check_application(app, seen)
        entry = application_config(app, version)
        if app.is_llm:
            for _, llm_config in llm_configs(entry.get("args") or {}):
                if isinstance(llm_config, dict):
                    fill_llm_config(llm_config, tpu)
        rendered.append(entry)
    if options is not None and not isinstance(options, Mapping):
        raise InvalidInputError("serve_options", options, "is not a dict",
                                "Give top-level Serve options such as {'proxy_location': 'EveryNode'}")
    if options and "applications" in options:
        raise InvalidInputError("serve_options", sorted(options), "contains applications",
                                "Give the applications as the applications parameter")
    config: dict[str, Any] = {**copy.deepcopy(dict(options or {})), "applications": rendered}
    preflight_serve_config(config, tpu)
    return ServeConfig(config, render_serve_config(config))


def render_serve_config(config: Mapping[str, Any]) -> str:
    """The YAML of a Serve config, stable for equal input (so a re-apply is recognised as identical)."""
    return yaml.safe_dump(_plain(config), sort_keys=False, default_flow_style=False, width=1000)


def parse_serve_config(text: str | None) -> dict[str, Any]:
    """A ``serveConfigV2`` string as a dict (empty when there is none or it is not a mapping)."""
    if not text:
        return {}
    try:
        parsed = yaml.safe_load(text)
    except yaml.YAMLError:
        return {}
    return parsed if isinstance(parsed, dict) else {}


def _plain(value: Any) -> Any:
    """Mappings and sequences as dicts and lists, so YAML renders them without Python tags."""
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value
