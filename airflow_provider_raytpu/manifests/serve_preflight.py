"""The preflight that keeps a Serve replica on ONE slice (see :mod:`~airflow_provider_raytpu.manifests.serveconfig`).

Ray Serve LLM gang-schedules a replica onto a slice only when its ``LLMConfig`` has
``accelerator_type`` and ``accelerator_config: {kind: tpu, topology: ...}``; a plain
deployment whose replica needs more chips than one host has must declare
placement-group bundles, one per host. :func:`serve_config_problems` finds what breaks
either rule, naming the application, the field and the fix.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from airflow_provider_raytpu.errors import InvalidInputError
from airflow_provider_raytpu.tpu import TpuSlice

LLM_MODULE = "ray.serve.llm"
# Where each ray.serve.llm builder takes its LLMConfig(s) in ``args``.
LLM_CONFIG_ARGS = ("llm_configs", "llm_config", "prefill_config", "decode_config")
PLACEMENT_STRATEGIES = ("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD")
TPU = "TPU"


def is_llm_import_path(import_path: str) -> bool:
    return import_path.startswith((LLM_MODULE + ":", LLM_MODULE + "."))


def where_in_config(app: str, path: str) -> str:
    return f"applications[{app!r}].{path}"


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
            where_in_config(app, "args"), dict(args), "has no LLMConfig (none of " + ", ".join(LLM_CONFIG_ARGS) + ")",
            "Give the Ray Serve LLM builder its configs, e.g. args={'llm_configs': [{'model_loading_config': {...}}]}",
        )
    for path, config in llm_configs(args):
        if not isinstance(config, Mapping):
            if tpu.is_multi_host:
                yield InvalidInputError(
                    where_in_config(app, path), config,
                    f"is not an inline LLMConfig, so its TPU topology can be neither checked nor set, and {hosts}",
                    "Write the LLMConfig inline as a dict; accelerator_type and accelerator_config are then "
                    "derived from the slice",
                )
            continue
        accelerator_type = config.get("accelerator_type")
        if accelerator_type is not None and accelerator_type != tpu.ray_accelerator_type:
            yield InvalidInputError(
                where_in_config(app, f"{path}.accelerator_type"), accelerator_type,
                f"disagrees with the RayService's slice ({tpu.describe()}), whose Ray accelerator type is "
                f"{tpu.ray_accelerator_type}",
                f"Write accelerator_type={tpu.ray_accelerator_type!r}, or leave it out and it is derived from the "
                "slice",
            )
        accelerator = config.get("accelerator_config")
        if accelerator is None:
            continue
        fix_all = (f"Write accelerator_config={{'kind': 'tpu', 'topology': {tpu.topology!r}}}, or leave "
                   "accelerator_config out and it is derived from the slice")
        if not isinstance(accelerator, Mapping) or accelerator.get("kind") != "tpu":
            kind = accelerator.get("kind") if isinstance(accelerator, Mapping) else accelerator
            yield InvalidInputError(
                where_in_config(app, f"{path}.accelerator_config"), accelerator,
                f"has kind {kind!r}, but the RayService runs on a TPU slice ({tpu.describe()})", fix_all,
            )
            continue
        topology = accelerator.get("topology")
        if not topology:
            if tpu.is_multi_host:
                yield InvalidInputError(
                    where_in_config(app, f"{path}.accelerator_config"), dict(accelerator),
                    f"has no topology, but {hosts}: Ray Serve LLM then reserves one bundle per chip, which can "
                    "span two slices and leave the replica DEPLOYING forever",
                    fix_all,
                )
        elif str(topology).strip().lower() != tpu.topology:
            yield InvalidInputError(
                where_in_config(app, f"{path}.accelerator_config.topology"), topology,
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


@dataclass(frozen=True)
class _Replica:
    """One deployment's replica, checked against the hosts and the slice of ``tpu``: what every message names.

    :param app: the application's name.
    :param deployment: the deployment's entry in the Serve config.
    :param tpu: the RayService's slice shape.
    """

    app: str
    deployment: Mapping[str, Any]
    tpu: TpuSlice

    def at(self, field_name: str) -> str:
        return where_in_config(self.app, f"deployments[{self.deployment.get('name')!r}].{field_name}")

    @property
    def chips(self) -> float:
        return replica_tpu_chips(self.deployment)

    @property
    def actor_options(self) -> dict[str, Any]:
        return dict(self.deployment.get("ray_actor_options") or {})

    @property
    def per_host(self) -> str:
        return f"one host of a {self.tpu.accelerator} {self.tpu.topology} slice has {self.tpu.host_chips} chips"

    @property
    def example(self) -> str:
        host, chips = self.tpu.host_chips, self.chips
        bundles = min(self.tpu.hosts_per_slice, max(1, -(-int(chips) // host))) if chips else self.tpu.hosts_per_slice
        return f"placement_group_bundles=[{{'TPU': {host}}}] * {bundles}, placement_group_strategy='STRICT_SPREAD'"


def _deployment_problems(app: str, deployment: Mapping[str, Any], tpu: TpuSlice) -> Iterator[InvalidInputError]:
    replica = _Replica(app, deployment, tpu)
    bundles = deployment.get("placement_group_bundles")
    strategy = deployment.get("placement_group_strategy")
    if strategy is not None and strategy not in PLACEMENT_STRATEGIES:
        yield InvalidInputError(replica.at("placement_group_strategy"), strategy,
                                "is not a placement strategy", f"Write one of {', '.join(PLACEMENT_STRATEGIES)}")
    if bundles is None:
        yield from _unbundled_problems(replica, strategy)
        return
    if not isinstance(bundles, list) or not bundles or not all(isinstance(b, Mapping) for b in bundles):
        yield InvalidInputError(replica.at("placement_group_bundles"), bundles,
                                "is not a non-empty list of resource dicts", f"Write e.g. {replica.example}")
        return
    sizes = [_number(b.get(TPU, 0)) for b in bundles]
    if any(size is None for size in sizes):
        yield InvalidInputError(replica.at("placement_group_bundles"), bundles,
                                "has a TPU amount that is not a number", f"Write e.g. {replica.example}")
        return
    chip_sizes = [size or 0.0 for size in sizes]
    yield from _bundle_size_problems(replica, bundles, chip_sizes)
    yield from _spread_problems(replica, bundles, chip_sizes, strategy)


def _unbundled_problems(replica: _Replica, strategy: Any) -> Iterator[InvalidInputError]:
    """A replica without placement-group bundles lives on one host."""
    if strategy is not None:
        yield InvalidInputError(
            replica.at("placement_group_strategy"), strategy, "is given without placement_group_bundles",
            f"Declare the bundles too, e.g. {replica.example}",
        )
    host = replica.tpu.host_chips
    if replica.chips > host:
        yield InvalidInputError(
            replica.at("ray_actor_options"), replica.actor_options,
            f"asks for {_chips(replica.chips)} TPU chips per replica, but {replica.per_host}, and a replica without "
            "placement-group bundles lives on one host, so it can never be scheduled",
            f"Declare one bundle per host ({replica.example}) and ask for at most {host} chips in ray_actor_options "
            "(the replica actor is placed in the first bundle)",
        )


def _bundle_size_problems(replica: _Replica, bundles: list[Any], sizes: list[float]) -> Iterator[InvalidInputError]:
    """Each bundle fits on a host, and the replica actor fits in the first bundle."""
    host = replica.tpu.host_chips
    if big := [s for s in sizes if s > host]:
        yield InvalidInputError(
            replica.at("placement_group_bundles"), bundles,
            f"has a bundle of {_chips(big[0])} TPU chips, but {replica.per_host}, so no host can hold it",
            f"Use bundles of at most {host} chips, one per host, e.g. {replica.example}",
        )
    if replica.chips > sizes[0]:
        yield InvalidInputError(
            replica.at("ray_actor_options"), replica.actor_options,
            f"asks for {_chips(replica.chips)} TPU chips, but Ray Serve places the replica actor in the first "
            f"placement-group bundle, which has {_chips(sizes[0])}",
            f"Ask for at most {_chips(sizes[0])} chips in ray_actor_options; the bundles hold the rest of the slice",
        )


def _spread_problems(replica: _Replica, bundles: list[Any], sizes: list[float],
                     strategy: Any) -> Iterator[InvalidInputError]:
    """Bundles that need more than one host are spread one per host, and all of them fit on one slice."""
    tpu, total = replica.tpu, sum(sizes)
    if total <= tpu.host_chips:
        return
    if strategy is None:
        yield InvalidInputError(
            replica.at("placement_group_strategy"), None,
            f"is missing, but the bundles hold {_chips(total)} TPU chips and {replica.per_host}",
            "Write placement_group_strategy='STRICT_SPREAD' (one bundle per host)",
        )
    elif strategy == "STRICT_PACK":
        yield InvalidInputError(
            replica.at("placement_group_strategy"), strategy,
            f"puts every bundle on one host, but the bundles hold {_chips(total)} TPU chips and {replica.per_host}",
            "Write placement_group_strategy='STRICT_SPREAD' (one bundle per host)",
        )
    if total > tpu.chips_per_slice:
        yield InvalidInputError(
            replica.at("placement_group_bundles"), bundles,
            f"hold {_chips(total)} TPU chips, more than one {tpu.accelerator} {tpu.topology} slice "
            f"({tpu.chips_per_slice} chips): the replica would span slices, which have no interconnect",
            f"Ask for at most {tpu.chips_per_slice} chips ({tpu.hosts_per_slice} bundles of {tpu.host_chips}), or "
            "use a larger topology",
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
