"""Wait until a RayService serves a model version; fail fast when it cannot."""

from __future__ import annotations

import json
import time
from collections.abc import Mapping, Sequence
from datetime import timedelta
from typing import TYPE_CHECKING, Any, NoReturn

from airflow.sdk import BaseSensorOperator, PokeReturnValue
from airflow.sdk.exceptions import AirflowException, AirflowFailException, AirflowSensorTimeout

from airflow_provider_raytpu.errors import InvalidInputError
from airflow_provider_raytpu.status import APP_UNHEALTHY, ServicePhase, ServiceStatus
from airflow_provider_raytpu.tasks.base import (
    DEFAULT_POKE_INTERVAL,
    ServiceTaskMixin,
    default_deferrable,
    fail_fast,
    mark_outlets,
    take_renamed,
)
from airflow_provider_raytpu.tasks.links import ServeApplicationLink, push_service_links
from airflow_provider_raytpu.triggers.rayservice import (
    DEFAULT_GRACE_PERIOD,
    DEPLOYING_TIMEOUT,
    ApplicationClock,
    RayServiceRunningTrigger,
)
from airflow_provider_raytpu.values import duration_seconds

if TYPE_CHECKING:
    from airflow.sdk import Context

SMOKE_METHODS = ("GET", "POST", "PUT")
SMOKE_RETRY_SECONDS = 2.0
BODY_LIMIT = 2000


class DeployingTooLong(AirflowSensorTimeout):
    """An application stayed DEPLOYING longer than ``deploying_timeout``."""


def parse_smoke_request(value: Any) -> dict[str, Any] | None:
    """Check ``smoke_request``: ``{"path": "/health", "method": "GET"}`` or with ``"json": {...}``."""
    if value is None:
        return None
    fix = "Write e.g. {'path': '/v1/chat/completions', 'method': 'POST', 'json': {...}} or {'path': '/health'}"
    if not isinstance(value, Mapping):
        raise InvalidInputError("smoke_request", value, "is not a dict", fix)
    if unknown := sorted(set(value) - {"path", "method", "json"}):
        raise InvalidInputError("smoke_request", unknown, "are not smoke request fields", "Use only path, method, json")
    path = value.get("path")
    if not isinstance(path, str) or not path.startswith("/"):
        raise InvalidInputError("smoke_request.path", path, "is not an HTTP path", fix)
    method = str(value.get("method") or ("POST" if value.get("json") is not None else "GET")).upper()
    if method not in SMOKE_METHODS:
        raise InvalidInputError("smoke_request.method", value.get("method"), "is not a supported method",
                                f"Write one of {', '.join(SMOKE_METHODS)}")
    return {"path": path, "method": method, "json": value.get("json")}


class RayServiceRunningSensor(ServiceTaskMixin, BaseSensorOperator):
    """Succeed when the RayService's active cluster serves ``version`` with every application RUNNING.

    Success needs KubeRay's ``Ready`` condition, no ``UpgradeInProgress``, and the ACTIVE
    cluster being the one made for the requested version (each cluster carries the version
    it was made for), so the old cluster, still serving during a switch, never counts.
    Fails at once when an application on the cluster meant to serve the version is
    DEPLOY_FAILED, with Serve's message; an UNHEALTHY one (Serve may recover it) fails the
    task once it has been so for ``grace_period`` seconds (in reschedule mode: at ``timeout``).
    With ``deploying_timeout``, an
    application DEPLOYING longer than that fails the task with a diagnosis: which
    deployment, how many replicas wait, whether the cluster's slices are ready, and
    whether a replica lacks a TPU topology. Deferrable when ``[operators]
    default_deferrable`` says so, or with ``deferrable=True`` (the triggerer watches the
    RayService); poke and reschedule modes work too (in reschedule mode the DEPLOYING time
    is Serve's own record of when the application was deployed).

    Optionally a smoke request is sent once it runs: ``{"path": "/health"}`` or
    ``{"path": "/v1/chat/completions", "method": "POST", "json": {...}}``; it must answer
    2xx (on Kubernetes through the API server's service proxy of ``<name>-serve-svc``,
    with the connection's own credentials) and its JSON answer is returned as ``smoke``.
    Returns the service's status. Give it ``outlets`` (e.g. ``[Asset("served_model")]``) and the
    asset event says what now serves: ``service`` and ``served_version`` extras.

    :param service: the service reference (``deploy.output``), instead of ``service_name``
        (its version is then the one to wait for, unless ``version`` is given).
    :param service_name: the RayService's name.
    :param version: the version to wait for; default: the reference's, else the one the RayService's spec asks for.
    :param namespace: the namespace; default: the reference's, else the connection's.
    :param raytpu_conn_id: the ``raytpu`` connection; default: the reference's, else ``raytpu_default``.
    :param deploying_timeout: how long an application may stay DEPLOYING (a ``timedelta`` or seconds, as every
        duration here); ``None``: only ``timeout``.
    :param smoke_request: an HTTP request that must answer 2xx once the service runs.
    :param smoke_timeout: how long to keep retrying the smoke request while it does not answer 2xx.
    :param deferrable: wait in the triggerer instead of a worker slot; default:
        ``[operators] default_deferrable``.
    :param poke_interval: how long between checks when not deferred, or when watching fails.
    :param poll_interval: deprecated: the old name of ``poke_interval``.
    :param timeout: how long to wait in all before failing with a diagnosis.
    :param grace_period: how long an application may stay UNHEALTHY before the task fails.
    """

    template_fields: Sequence[str] = ("service", "service_name", "version", "namespace", "raytpu_conn_id",
                                      "smoke_request")
    template_fields_renderers = {"smoke_request": "json"}
    operator_extra_links = (ServeApplicationLink(),)
    ui_color = "#e6f4ea"

    def __init__(
        self,
        *,
        service: Any = None,
        service_name: str | None = None,
        version: str | None = None,
        namespace: str | None = None,
        raytpu_conn_id: str | None = None,
        deploying_timeout: timedelta | float | None = None,
        smoke_request: Mapping[str, Any] | None = None,
        smoke_timeout: timedelta | float = 60.0,
        deferrable: bool | None = None,
        poke_interval: timedelta | float | None = None,
        timeout: timedelta | float = 3600.0,
        grace_period: timedelta | float = DEFAULT_GRACE_PERIOD,
        **kwargs: Any,
    ) -> None:
        poke_interval = take_renamed(kwargs, "poll_interval", "poke_interval", poke_interval)
        super().__init__(poke_interval=DEFAULT_POKE_INTERVAL if poke_interval is None else poke_interval,
                         timeout=timeout, **kwargs)
        if deploying_timeout is not None:
            deploying_timeout = duration_seconds(deploying_timeout, "deploying_timeout", example="900")
        grace_period = duration_seconds(grace_period, "grace_period", example="120", allow_zero=True)
        self.service = service
        self.service_name = service_name
        self.version = version
        self.namespace = namespace
        self.raytpu_conn_id = raytpu_conn_id
        self.deploying_timeout = deploying_timeout
        self.smoke_request = smoke_request
        self.smoke_timeout = duration_seconds(smoke_timeout, "smoke_timeout", example="60")
        self.deferrable = default_deferrable() if deferrable is None else deferrable
        self.grace_period = grace_period
        self._clock = ApplicationClock(deploying_timeout)
        self._unhealthy = ApplicationClock(grace_period, APP_UNHEALTHY)

    def take_reference(self) -> dict[str, Any] | None:
        reference = super().take_reference()
        if reference is not None and self.version in (None, "", "None"):
            self.version = reference.get("version")
        return reference

    def _target(self) -> tuple[str, str, str | None]:
        with fail_fast():
            version = self.version if self.version not in ("", "None") else None
            parse_smoke_request(self.smoke_request)
            return self.resolved_name(), self.resolved_namespace(), version

    def _finish(self, status: ServiceStatus, name: str, namespace: str) -> dict[str, Any] | None:
        where = f"RayService {namespace}/{name}"
        if status.phase is ServicePhase.RUNNING:
            self.log.info("%s is running: %s", where, status.message)
            result = status.to_dict()
            if smoke := parse_smoke_request(self.smoke_request):
                result["smoke"] = self._smoke(smoke, name, namespace)
            mark_outlets(self, {"service": f"{namespace}/{name}", "served_version": status.active_version})
            return result
        if status.phase is ServicePhase.FAILED:
            raise AirflowFailException(f"{where} {status.phase.value}: {status.message}")
        if status.phase is ServicePhase.GONE:
            raise AirflowException(f"{where} is gone: {status.message}")
        return None

    def _unhealthy_too_long(self, status: ServiceStatus, name: str, namespace: str, waited: float) -> NoReturn:
        raise AirflowFailException(
            f"RayService {namespace}/{name} UNHEALTHY for {waited:.0f} s, longer than grace_period="
            f"{self.grace_period:.0f} s: {status.message}")

    def _smoke(self, smoke: dict[str, Any], name: str, namespace: str) -> dict[str, Any]:
        """Send the smoke request until it answers 2xx or ``smoke_timeout`` passes (routes take a moment)."""
        deadline = time.monotonic() + self.smoke_timeout
        endpoint = self.service_backend.serve_endpoint(name, namespace)
        while True:
            try:
                answer = endpoint.request(smoke["method"], smoke["path"], json=smoke["json"])
                code, body = answer.status, answer.body
            except OSError as exc:
                code, body = 0, str(exc).encode()
            if 200 <= code < 300:
                try:
                    payload: Any = json.loads(body) if body else None
                except ValueError:
                    payload = body.decode(errors="replace")[:BODY_LIMIT]
                self.log.info("Smoke request %s %s answered %s", smoke["method"], smoke["path"], code)
                return {"status": code, "json": payload}
            if time.monotonic() > deadline:
                raise AirflowFailException(
                    f"RayService {namespace}/{name} runs, but the smoke request {smoke['method']} {smoke['path']} "
                    f"answered {code or 'nothing'} for {self.smoke_timeout:.0f} s: "
                    f"{body.decode(errors='replace')[:BODY_LIMIT]}"
                )
            self.log.info("Smoke request %s %s answered %s; retrying", smoke["method"], smoke["path"], code)
            time.sleep(SMOKE_RETRY_SECONDS)

    def poke(self, context: Context) -> PokeReturnValue:
        name, namespace, version = self._target()
        with fail_fast():
            status = self.service_backend.service_status(name, namespace, version)
        done = self._finish(status, name, namespace)
        if done is None:
            self.log.info("RayService %s/%s: %s: %s", namespace, name, status.phase.value, status.message)
            now = time.time()
            self._clock.update(status, now)
            self._unhealthy.update(status, now)
            if self.reschedule:
                self._carry_clocks(context, status, namespace)
            if overdue := self._unhealthy.overdue(now):
                self._unhealthy_too_long(status, name, namespace, overdue[1])
            if overdue := self._clock.overdue(now):
                application, waited = overdue
                diagnosis = self.service_backend.diagnose_service(name, namespace, version, waited)
                raise DeployingTooLong(self._deploying_too_long(name, namespace, application, waited, diagnosis))
        return PokeReturnValue(is_done=done is not None, xcom_value=done)

    def _carry_clocks(self, context: Context, status: ServiceStatus, namespace: str) -> None:
        """In reschedule mode every poke is a new process: start the DEPLOYING clock from what outlives it.

        A DEPLOYING application's clock starts when Serve deployed it (its own record,
        ``last_deployed_time_s``), else when this sensor first poked. Nothing records since
        when an application is UNHEALTHY, so in reschedule mode that ends the wait only at
        ``timeout`` (or at once with ``grace_period=0``).
        """
        from airflow_provider_raytpu.dashboard.serve import serve_details

        first = context["ti"].get_first_reschedule_date(context)
        started = first.timestamp() if first else time.time()
        deployed: dict[str, Any] = {}
        if self._clock.since and self.deploying_timeout is not None:
            cluster = status.target_cluster
            details = serve_details(self.backend.dashboard(cluster, namespace), f"RayCluster {namespace}/{cluster}")
            deployed = (details or {}).get("applications") or {}
        for key in self._clock.since:
            at = (deployed.get(key.split("/", 1)[1]) or {}).get("last_deployed_time_s")
            self._clock.since[key] = float(at) if at else started

    def execute(self, context: Context) -> dict[str, Any] | None:
        name, namespace, version = self._target()
        with fail_fast():
            services = self.service_backend
            push_service_links(context, services, name, namespace, services.get_service(name, namespace))
        if not self.deferrable:
            try:
                done: dict[str, Any] | None = super().execute(context)
                return done
            except DeployingTooLong:
                raise
            except AirflowSensorTimeout as exc:
                diagnosis = self.service_backend.diagnose_service(name, namespace, version)
                raise AirflowSensorTimeout(self._timed_out(name, namespace, diagnosis)) from exc
        first = self.poke(context)
        if first.is_done:
            return first.xcom_value
        self.log.info("RayService %s/%s does not serve the version yet; deferring", namespace, name)
        self.defer(
            trigger=RayServiceRunningTrigger(
                service_name=name,
                namespace=namespace,
                raytpu_conn_id=self.conn_id,
                deadline=time.time() + self.timeout,
                version=version,
                deploying_timeout=self.deploying_timeout,
                poll_interval=self.poke_interval,
                grace_period=self.grace_period,
            ),
            method_name="execute_complete",
            # The trigger fires its own timeout with a diagnosis first; this is only a backstop.
            timeout=timedelta(seconds=self.timeout + 120),
        )

    def _timed_out(self, name: str, namespace: str, diagnosis: str) -> str:
        return f"RayService {namespace}/{name} does not serve the version after {self.timeout:.0f} s.\n{diagnosis}"

    def _deploying_too_long(self, name: str, namespace: str, application: str, waited: float, diagnosis: str) -> str:
        return (f"RayService {namespace}/{name}: application {application!r} DEPLOYING for {waited:.0f} s, longer "
                f"than deploying_timeout={self.deploying_timeout:.0f} s.\n{diagnosis}")

    def execute_complete(self, context: Context, event: dict[str, Any]) -> dict[str, Any]:
        name, namespace = event["service_name"], event["namespace"]
        if event["status"] == "TIMEOUT":
            raise AirflowSensorTimeout(self._timed_out(name, namespace, event["diagnosis"]))
        if event["status"] == DEPLOYING_TIMEOUT:
            raise DeployingTooLong(
                self._deploying_too_long(name, namespace, event["application"], event["waited"], event["diagnosis"])
            )
        if event["status"] == "ERROR":
            raise AirflowFailException(event["message"])
        if event["status"] == ServicePhase.UNHEALTHY.value:
            self._unhealthy_too_long(ServiceStatus.from_dict(event["service"]), name, namespace, event["waited"])
        with fail_fast():
            done = self._finish(ServiceStatus.from_dict(event["service"]), name, namespace)
        if done is None:
            raise AirflowException(f"Unexpected event for RayService {namespace}/{name}: {event}")
        return done
