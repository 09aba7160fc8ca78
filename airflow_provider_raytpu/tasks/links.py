"""The links on a task's page: the Ray dashboard, the job, the Serve application, checkpoints, profiles, the run
report. Each opens a page in a browser. A Serve endpoint is not a link: it answers requests its application
defines (a GET of its root is a 404, or the application's error), so the deploy task's log says how to call it.

Airflow 3 resolves operator links in the API server, which never runs operator code: each
link's value is the XCom the task pushed under the link's ``xcom_key`` while it ran. So
every link here is an :class:`XComLink`, and a task pushes its links' values with
:func:`push_link` as soon as it knows them. An empty value shows the link disabled; that is
what a task pushes when no browser can open the place (see :func:`storage_console_url`).
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any
from urllib.parse import quote

from airflow.sdk import BaseOperator, BaseOperatorLink

from airflow_provider_raytpu.errors import FatalError
from airflow_provider_raytpu.status import spec_applications

if TYPE_CHECKING:
    from airflow.sdk import Context
    from airflow.sdk.types import TaskInstanceKey

    from airflow_provider_raytpu.backends.base import ClusterBackend, ServiceBackend
    from airflow_provider_raytpu.dashboard.transport import HttpTransport

GCS_CONSOLE = "https://console.cloud.google.com/storage/browser/"
EMULATOR_HOST_VAR = "STORAGE_EMULATOR_HOST"


class XComLink(BaseOperatorLink):
    """A link whose URL the task pushed as an XCom under :attr:`xcom_key` (``_link_<class name>``)."""

    name = ""

    def get_link(self, operator: BaseOperator, *, ti_key: TaskInstanceKey) -> str:
        from airflow.sdk.execution_time.xcom import XCom

        return XCom.get_value(ti_key=ti_key, key=self.xcom_key) or ""


class RayDashboardLink(XComLink):
    """The Ray dashboard of the task's cluster."""

    name = "Ray dashboard"


class RayJobLink(XComLink):
    """The task's Ray job in the Ray dashboard."""

    name = "Ray job"


class ServeApplicationLink(XComLink):
    """The RayService's Serve application (or its Serve page, for several) in the Ray dashboard."""

    name = "Serve application"


class CheckpointsLink(XComLink):
    """The training run's directory (its checkpoints) in the storage console."""

    name = "Checkpoints"


class ProfileLink(XComLink):
    """The training run's JAX profiler traces (TensorBoard's ``plugins/profile`` layout) in the storage console."""

    name = "Profile"


class RunReportLink(XComLink):
    """The DAG run's report (its JSON and PNG timeline) in the storage console."""

    name = "Run report"


def push_link(context: Context, link: type[XComLink], url: str | None) -> None:
    """Push ``url`` as the value of ``link`` for this task try; ``None`` or ``""`` shows the link disabled.

    :param context: the task's context.
    :param link: the link class.
    :param url: the URL a browser opens.
    """
    context["ti"].xcom_push(key=link().xcom_key, value=url or "")


def dashboard_url(dashboard: HttpTransport, fragment: str = "") -> str | None:
    """A page of a Ray dashboard as a browser opens it (``#/jobs/<id>``), or ``None`` when none can.

    :param dashboard: the dashboard as the backend reaches it.
    :param fragment: the dashboard page, e.g. ``"jobs/raytpu-...-try1"``.
    """
    base = dashboard.browser_url
    if not base:
        return None
    return f"{base.rstrip('/')}/#/{fragment}" if fragment else f"{base.rstrip('/')}/"


def serve_application_url(dashboard: HttpTransport, applications: list[Any]) -> str | None:
    """The Serve page of the one application, or the Serve overview when there are several.

    :param dashboard: the service's dashboard.
    :param applications: the applications (dicts or objects with a ``name``).
    """
    names = [a["name"] if isinstance(a, dict) else getattr(a, "name", "") for a in applications]
    if len(names) == 1 and names[0]:
        return dashboard_url(dashboard, f"serve/applications/{quote(names[0], safe='')}")
    return dashboard_url(dashboard, "serve")


def storage_console_url(uri: str, environ: dict[str, str] | None = None) -> str | None:
    """The Google Cloud console page of a ``gs://`` prefix; ``None`` for anything a browser cannot open.

    No link is built for local paths (a browser does not open files of the Ray cluster's
    machines) nor while ``STORAGE_EMULATOR_HOST`` points ``gs://`` at an emulator (the console
    does not show its objects).

    :param uri: ``gs://bucket/prefix`` or a local path.
    :param environ: the environment to read for the emulator; ``os.environ`` by default.
    """
    env = os.environ if environ is None else environ
    if not uri.startswith("gs://") or env.get(EMULATOR_HOST_VAR, "").strip():
        return None
    bucket_and_path = uri[len("gs://"):].strip("/")
    return GCS_CONSOLE + quote(bucket_and_path, safe="/") if bucket_and_path else None


def push_dashboard_link(context: Context, backend: ClusterBackend, name: str, namespace: str) -> None:
    """Push the cluster's :class:`RayDashboardLink` (disabled when the cluster has no dashboard to open).

    :param context: the task's context.
    :param backend: the connection's backend.
    :param name: the RayCluster's name.
    :param namespace: its namespace.
    """
    try:
        url = dashboard_url(backend.dashboard(name, namespace))
    except FatalError:  # the local backend has no such cluster (any more)
        url = None
    push_link(context, RayDashboardLink, url)


def push_service_links(context: Context, services: ServiceBackend, name: str, namespace: str,
                       service: dict[str, Any] | None) -> None:
    """Push the RayService's :class:`ServeApplicationLink`.

    :param context: the task's context.
    :param services: the connection's RayServices.
    :param name: the RayService's name.
    :param namespace: its namespace.
    :param service: the RayService (its Serve config names the applications); ``None``: it does not exist.
    """
    application = None
    if service is not None:
        try:
            application = serve_application_url(services.dashboard(name, namespace), spec_applications(service))
        except FatalError:  # the local backend has no such service (any more)
            pass
    push_link(context, ServeApplicationLink, application)
