"""The Ray Serve config of a RayService (``serveConfigV2``), and the preflight that keeps a replica on one slice.

A multi-host model must land on ONE slice. Ray Serve LLM gang-schedules a replica onto
a slice only when its ``LLMConfig`` has ``accelerator_type`` and
``accelerator_config: {kind: tpu, topology: ...}``; without the topology it reserves
one bundle per chip, which can span two slices, and the service sits in DEPLOYING
forever. A plain Serve deployment whose replica needs more chips than one host has is
the same trap unless it declares placement-group bundles, one per host. So the builder
writes the LLM fields from the :class:`TpuSlice`, and :func:`preflight_serve_config`
refuses what cannot be scheduled on the slice, before anything is applied.

The LLMConfig field names (``accelerator_type``, ``accelerator_config.kind``,
``accelerator_config.topology``) are those of ``ray.llm._internal.serve.core.configs``
in Ray 2.60; ``ray.serve.llm`` is never imported here (it needs vLLM).
"""

from __future__ import annotations

import copy
import re
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import yaml

from airflow_provider_raytpu.errors import InvalidInputError
from airflow_provider_raytpu.tpu import TpuSlice

LLM_MODULE = "ray.serve.llm"
# Where each ray.serve.llm builder takes its LLMConfig(s) in ``args``.
LLM_CONFIG_ARGS = ("llm_configs", "llm_config", "prefill_config", "decode_config")
PLACEMENT_STRATEGIES = ("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD")
TPU = "TPU"
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


def is_llm_import_path(import_path: str) -> bool:
    return import_path.startswith((LLM_MODULE + ":", LLM_MODULE + "."))


def _where(app: str, path: str) -> str:
    return f"applications[{app!r}].{path}"


def _check_application(app: ServeApplication, seen: set[str]) -> None:
    if app.name in seen:
        raise InvalidInputError(_where(app.name, "name"), app.name, "is used by two applications",
                                "Give every application its own name")
    seen.add(app.name)
    if not _IMPORT_PATH.match(app.import_path):
        raise InvalidInputError(_where(app.name, "import_path"), app.import_path, "is not an import path",
                                "Write 'module:attribute', e.g. 'ray.serve.llm:build_openai_app'")
    if app.route_prefix is not None and (not isinstance(app.route_prefix, str) or not app.route_prefix.startswith("/")):
        raise InvalidInputError(_where(app.name, "route_prefix"), app.route_prefix, "is not an HTTP route",
                                "Write a path starting with '/', e.g. '/' or '/llm'")
    for key, kind in (("args", Mapping), ("runtime_env", Mapping), ("deployments", (list, tuple))):
        value = getattr(app, key)
        if value is not None and not isinstance(value, kind):
            raise InvalidInputError(_where(app.name, key), value, f"is not a {'list' if key == 'deployments' else 'dict'}",
                                    "See the Ray Serve config file reference")
    for index, deployment in enumerate(app.deployments or ()):
        if not isinstance(deployment, Mapping) or not isinstance(deployment.get("name"), str):
            raise InvalidInputError(_where(app.name, f"deployments[{index}]"), deployment,
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
                    _where(app, "version_arg"), path, f"indexes {key!r} into a list of {len(node)} items",
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
            raise InvalidInputError(_where(app, "version_arg"), path, f"passes through {node!r}, which is not a dict",
                                    "Point it at a key of args, e.g. 'checkpoint_uri'")


def application_config(app: ServeApplication, version: str | None = None) -> dict[str, Any]:
    """The application as a Serve config entry; the version written at ``version_arg``."""
    config: dict[str, Any] = {"name": app.name, "route_prefix": app.route_prefix, "import_path": app.import_path}
    if app.runtime_env:
        config["runtime_env"] = copy.deepcopy(dict(app.runtime_env))
    args = copy.deepcopy(dict(app.args or {}))
    if app.version_arg:
        if version is None:
            raise InvalidInputError(_where(app.name, "version_arg"), app.version_arg, "needs a version",
                                    "Give the operator a version, e.g. the checkpoint URI")
        set_version_arg(args, app.version_arg, version, app.name)
    if args:
        config["args"] = args
    if app.deployments:
        config["deployments"] = [copy.deepcopy(dict(d)) for d in app.deployments]
    return config


# -- Ray Serve LLM -------------------------------------------------------------------------


def llm_configs(args: Mapping[str, Any]) -> Iterator[tuple[str, Any]]:
    """Every LLMConfig in a Ray Serve LLM builder's args, with its path (``llm_configs[0]``...)."""
    for key in LLM_CONFIG_ARGS:
        value = args.get(key)
        if value is None:
            continue
        if key == "llm_configs" and isinstance(value, list):
            for index, item in enumerate(value):
                yield f"args.llm_configs[{index}]", item
        else:
            yield f"args.{key}", value


def fill_llm_config(config: dict[str, Any], tpu: TpuSlice) -> None:
    """Write ``accelerator_type`` and ``accelerator_config: {kind: tpu, topology}`` where they are absent."""
    config.setdefault("accelerator_type", tpu.ray_accelerator_type)
    config.setdefault("accelerator_config", {"kind": "tpu", "topology": tpu.topology})


def _llm_problems(app: str, args: Mapping[str, Any], tpu: TpuSlice) -> Iterator[InvalidInputError]:
    hosts = f"a {tpu.accelerator} {tpu.topology} slice has {tpu.hosts_per_slice} hosts"
    if not any(True for _ in llm_configs(args)):
        yield InvalidInputError(
            _where(app, "args"), dict(args), "has no LLMConfig (none of " + ", ".join(LLM_CONFIG_ARGS) + ")",
            "Give the Ray Serve LLM builder its configs, e.g. args={'llm_configs': [{'model_loading_config': {...}}]}",
        )
    for path, config in llm_configs(args):
        if not isinstance(config, Mapping):
            if tpu.is_multi_host:
                yield InvalidInputError(
                    _where(app, path), config,
                    f"is not an inline LLMConfig, so its TPU topology can be neither checked nor set, and {hosts}",
                    "Write the LLMConfig inline as a dict; accelerator_type and accelerator_config are then "
                    "derived from the slice",
                )
            continue
        accelerator_type = config.get("accelerator_type")
        if accelerator_type is not None and accelerator_type != tpu.ray_accelerator_type:
            yield InvalidInputError(
                _where(app, f"{path}.accelerator_type"), accelerator_type,
                f"disagrees with the RayService's slice ({tpu.describe()}), whose Ray accelerator type is "
                f"{tpu.ray_accelerator_type}",
                f"Write accelerator_type={tpu.ray_accelerator_type!r}, or leave it out and it is derived from the slice",
            )
        accelerator = config.get("accelerator_config")
        if accelerator is None:
            continue
        fix_all = (f"Write accelerator_config={{'kind': 'tpu', 'topology': {tpu.topology!r}}}, or leave "
                   "accelerator_config out and it is derived from the slice")
        if not isinstance(accelerator, Mapping) or accelerator.get("kind") != "tpu":
            kind = accelerator.get("kind") if isinstance(accelerator, Mapping) else accelerator
            yield InvalidInputError(
                _where(app, f"{path}.accelerator_config"), accelerator,
                f"has kind {kind!r}, but the RayService runs on a TPU slice ({tpu.describe()})", fix_all,
            )
            continue
        topology = accelerator.get("topology")
        if not topology:
            if tpu.is_multi_host:
                yield InvalidInputError(
                    _where(app, f"{path}.accelerator_config"), dict(accelerator),
                    f"has no topology, but {hosts}: Ray Serve LLM then reserves one bundle per chip, which can "
                    "span two slices and leave the replica DEPLOYING forever",
                    fix_all,
                )
        elif str(topology).strip().lower() != tpu.topology:
            yield InvalidInputError(
                _where(app, f"{path}.accelerator_config.topology"), topology,
                f"disagrees with the RayService's slice ({tpu.describe()}): a replica is gang-scheduled onto one "
                "slice of exactly this shape",
                f"Write topology={tpu.topology!r}, or change the slice's topology",
            )


# -- plain Serve deployments ---------------------------------------------------------------


def _number(value: Any) -> float | None:
    if isinstance(value, bool):
        return None
    if isinstance(value, (int, float)):
        return float(value)
    if isinstance(value, str):
        try:
            return float(value)
        except ValueError:
            return None
    return None


def _chips(value: Any) -> str:
    return f"{value:g}"


def replica_tpu_chips(deployment: Mapping[str, Any]) -> float:
    """The TPU chips a deployment's replica actor asks for (``resources.TPU`` or ``num_tpus``)."""
    options = deployment.get("ray_actor_options") or {}
    resources = options.get("resources") or {}
    return max(_number(resources.get(TPU)) or 0.0, _number(options.get("num_tpus")) or 0.0)


def _deployment_problems(app: str, deployment: Mapping[str, Any], tpu: TpuSlice) -> Iterator[InvalidInputError]:
    name = deployment.get("name")
    where = f"deployments[{name!r}]"
    host = tpu.host_chips
    per_host = f"one host of a {tpu.accelerator} {tpu.topology} slice has {host} chips"
    chips = replica_tpu_chips(deployment)
    bundles = deployment.get("placement_group_bundles")
    strategy = deployment.get("placement_group_strategy")
    bundles_needed = min(tpu.hosts_per_slice, max(1, -(-int(chips) // host))) if chips else tpu.hosts_per_slice
    example = f"placement_group_bundles=[{{'TPU': {host}}}] * {bundles_needed}, placement_group_strategy='STRICT_SPREAD'"
    if strategy is not None and strategy not in PLACEMENT_STRATEGIES:
        yield InvalidInputError(_where(app, f"{where}.placement_group_strategy"), strategy,
                                "is not a placement strategy", f"Write one of {', '.join(PLACEMENT_STRATEGIES)}")
    if bundles is None:
        if strategy is not None:
            yield InvalidInputError(
                _where(app, f"{where}.placement_group_strategy"), strategy, "is given without placement_group_bundles",
                f"Declare the bundles too, e.g. {example}",
            )
        if chips > host:
            yield InvalidInputError(
                _where(app, f"{where}.ray_actor_options"), dict(deployment.get("ray_actor_options") or {}),
                f"asks for {_chips(chips)} TPU chips per replica, but {per_host}, and a replica without "
                "placement-group bundles lives on one host, so it can never be scheduled",
                f"Declare one bundle per host ({example}) and ask for at most {host} chips in ray_actor_options "
                "(the replica actor is placed in the first bundle)",
            )
        return
    if not isinstance(bundles, list) or not bundles or not all(isinstance(b, Mapping) for b in bundles):
        yield InvalidInputError(_where(app, f"{where}.placement_group_bundles"), bundles,
                                "is not a non-empty list of resource dicts", f"Write e.g. {example}")
        return
    sizes = [_number(b.get(TPU, 0)) for b in bundles]
    if any(size is None for size in sizes):
        yield InvalidInputError(_where(app, f"{where}.placement_group_bundles"), bundles,
                                "has a TPU amount that is not a number", f"Write e.g. {example}")
        return
    if big := [s for s in sizes if s and s > host]:
        yield InvalidInputError(
            _where(app, f"{where}.placement_group_bundles"), bundles,
            f"has a bundle of {_chips(big[0])} TPU chips, but {per_host}, so no host can hold it",
            f"Use bundles of at most {host} chips, one per host, e.g. {example}",
        )
    if chips > (sizes[0] or 0):
        yield InvalidInputError(
            _where(app, f"{where}.ray_actor_options"), dict(deployment.get("ray_actor_options") or {}),
            f"asks for {_chips(chips)} TPU chips, but Ray Serve places the replica actor in the first "
            f"placement-group bundle, which has {_chips(sizes[0] or 0)}",
            f"Ask for at most {_chips(sizes[0] or 0)} chips in ray_actor_options; the bundles hold the rest of the slice",
        )
    total = sum(s or 0 for s in sizes)
    if total > host:
        if strategy is None:
            yield InvalidInputError(
                _where(app, f"{where}.placement_group_strategy"), None,
                f"is missing, but the bundles hold {_chips(total)} TPU chips and {per_host}",
                "Write placement_group_strategy='STRICT_SPREAD' (one bundle per host)",
            )
        elif strategy == "STRICT_PACK":
            yield InvalidInputError(
                _where(app, f"{where}.placement_group_strategy"), strategy,
                f"puts every bundle on one host, but the bundles hold {_chips(total)} TPU chips and {per_host}",
                "Write placement_group_strategy='STRICT_SPREAD' (one bundle per host)",
            )
        if total > tpu.chips_per_slice:
            yield InvalidInputError(
                _where(app, f"{where}.placement_group_bundles"), bundles,
                f"hold {_chips(total)} TPU chips, more than one {tpu.accelerator} {tpu.topology} slice "
                f"({tpu.chips_per_slice} chips): the replica would span slices, which have no interconnect",
                f"Ask for at most {tpu.chips_per_slice} chips ({tpu.hosts_per_slice} bundles of {host}), or use a "
                "larger topology",
            )


# -- the whole config ----------------------------------------------------------------------


def serve_config_problems(config: Mapping[str, Any], tpu: TpuSlice) -> list[InvalidInputError]:
    """Everything in a Serve config that cannot be scheduled on the slice, or not on one slice.

    :param config: the Serve config (``serveConfigV2`` parsed), with ``applications``.
    :param tpu: the RayService's slice shape.
    """
    problems: list[InvalidInputError] = []
    for app in config.get("applications") or []:
        name = app.get("name", "?")
        if is_llm_import_path(str(app.get("import_path", ""))):
            problems.extend(_llm_problems(name, app.get("args") or {}, tpu))
        for deployment in app.get("deployments") or []:
            problems.extend(_deployment_problems(name, deployment, tpu))
    return problems


def preflight_serve_config(config: Mapping[str, Any], tpu: TpuSlice) -> None:
    """Refuse a Serve config whose replicas cannot land on one slice; the first problem is raised.

    :raises InvalidInputError: naming the application, the field and the fix.
    """
    if problems := serve_config_problems(config, tpu):
        raise problems[0]


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
