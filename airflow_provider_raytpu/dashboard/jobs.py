"""Ray's Jobs REST API, synchronously, through a cluster's dashboard transport: no Ray in the Airflow process.

This is what Ray's ``JobSubmissionClient`` (Ray 2.60 ``dashboard/modules/job/sdk.py`` and
``dashboard/modules/dashboard_sdk.py``) sends and how it reads the answers, on the
:class:`~airflow_provider_raytpu.dashboard.transport.HttpTransport` every backend gives: the
endpoints and bodies of ``submit_job``, ``get_job_info``, ``list_jobs``, ``get_job_logs`` and
``stop_job``; ``RuntimeError("Request failed with status code ...")`` for an error answer
(``_raise_error``); Ray's wording for a refusal of its token authentication
(``_private/authentication/http_token_authentication.py``). Two differences, both on
purpose: every request has a timeout (Ray's sets none, and a half-open connection would hang a
task for ever), and no ``GET /api/version`` precedes the first request (each answer says all
we need; a dashboard that is not Ray's answers 404 to the request itself).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from airflow_provider_raytpu.dashboard.job_packages import upload_local_packages
from airflow_provider_raytpu.dashboard.transport import (
    REQUEST_TIMEOUT_SECONDS,
    TRANSIENT_STATUSES,
    DashboardUnavailableError,
    HttpAnswer,
)

if TYPE_CHECKING:
    from airflow_provider_raytpu.dashboard.transport import HttpTransport

#: What Ray's ``authentication_constants`` add to a 401 and to a 403 of its token authentication.
RAY_TOKEN_MISSING = "Token authentication is enabled but no authentication token was found"
RAY_TOKEN_INVALID = "Token authentication is enabled but the authentication token is invalid or incorrect."
TOKEN_HINT = ("(on Kubernetes, the raytpu connection's ray_auth sends each cluster's token from the Secret "
              "KubeRay made for it)")


class RayAuthenticationError(RuntimeError):
    """Ray's token authentication refused a request (Ray's client raises ``ray.exceptions.AuthenticationError``)."""


@dataclasses.dataclass(frozen=True)
class JobRecord:
    """What Ray records of one job (the fields of Ray's ``JobDetails`` a task reads).

    :param status: ``PENDING``, ``RUNNING``, ``STOPPED``, ``SUCCEEDED`` or ``FAILED``.
    :param submission_id: the id it was submitted under (``None`` for a driver started with ``ray.init``).
    :param job_id: Ray's own job id, once the driver started.
    :param message: Ray's words on the status.
    :param metadata: the metadata it was submitted with.
    :param entrypoint: the command it runs.
    :param start_time: when it started, in ms since the epoch.
    :param end_time: when it ended, in ms since the epoch.
    :param driver_exit_code: the driver's exit code, once it ended.
    :param error_type: Ray's kind of failure, when it failed.
    """

    status: str
    submission_id: str | None = None
    job_id: str | None = None
    message: str | None = None
    metadata: dict[str, str] | None = None
    entrypoint: str | None = None
    start_time: int | None = None
    end_time: int | None = None
    driver_exit_code: int | None = None
    error_type: str | None = None

    @classmethod
    def from_json(cls, entry: Mapping[str, Any]) -> JobRecord:
        """A record from an entry of ``GET /api/jobs/`` or the answer of ``GET /api/jobs/<id>``."""
        fields: dict[str, Any] = {field.name: entry.get(field.name) for field in dataclasses.fields(cls)}
        return cls(**fields)


class JobsApi:
    """Submit, read, list, tail and stop the jobs of one Ray cluster.

    :param transport: the cluster's dashboard, as the connection's backend reaches it.
    """

    def __init__(self, transport: HttpTransport) -> None:
        self.transport = transport

    def request(self, method: str, path: str, *, json: Any = None, data: bytes | None = None,
                timeout: float | None = None) -> HttpAnswer:
        """One request, as Ray's ``_do_request`` sends it; raises only for a transient status or a token refusal.

        :raises DashboardUnavailableError: 429/502/503/504: the dashboard, or a proxy on the way, cannot answer now.
        :raises RayAuthenticationError: Ray's token authentication refused the request.
        """
        headers = {"Accept": "application/json"}
        if data is not None:
            headers["Content-Type"] = "application/octet-stream"
        answer = self.transport.request(method, path, json=json, data=data, headers=headers,
                                        timeout=timeout or REQUEST_TIMEOUT_SECONDS)
        if answer.status in TRANSIENT_STATUSES:
            raise DashboardUnavailableError(answer.status, answer.text(300))
        if answer.status in (401, 403) and (self.transport.ray_auth_errors or answer.ray_refused):
            verdict, details = (("Authentication required", RAY_TOKEN_MISSING) if answer.status == 401
                                else ("Authentication failed", RAY_TOKEN_INVALID))
            raise RayAuthenticationError(f"{verdict}: {answer.text()}\n\n{details} {TOKEN_HINT}")
        return answer

    @staticmethod
    def refused(answer: HttpAnswer) -> RuntimeError:
        """The error Ray's client raises for an answer it did not expect (``_raise_error``)."""
        return RuntimeError(f"Request failed with status code {answer.status}: {answer.text()}.")

    def _json(self, method: str, path: str, **kwargs: Any) -> Any:
        answer = self.request(method, path, **kwargs)
        if answer.status != 200:
            raise self.refused(answer)
        return answer.json()

    def submit_job(self, *, entrypoint: str, submission_id: str, runtime_env: Mapping[str, Any] | None = None,
                   metadata: Mapping[str, str] | None = None, entrypoint_num_cpus: float | None = None,
                   entrypoint_resources: Mapping[str, float] | None = None) -> str:
        """``POST /api/jobs/`` (Ray's ``JobSubmitRequest``, ``None`` fields left out), after uploading the
        runtime_env's local ``working_dir`` and ``py_modules``; returns the submission id.

        :raises RuntimeError: Ray refused it (``... already exists.`` for a submission id it knows).
        """
        request = {
            "entrypoint": entrypoint,
            "submission_id": submission_id,
            "runtime_env": upload_local_packages(runtime_env or {}, self),
            "metadata": dict(metadata or {}),
            "entrypoint_num_cpus": entrypoint_num_cpus,
            "entrypoint_resources": dict(entrypoint_resources) if entrypoint_resources else None,
        }
        body = {key: value for key, value in request.items() if value is not None}
        return str(self._json("POST", "/api/jobs/", json=body)["submission_id"])

    def get_job_info(self, submission_id: str) -> JobRecord:
        return JobRecord.from_json(self._json("GET", f"/api/jobs/{submission_id}"))

    def list_jobs(self) -> list[JobRecord]:
        return [JobRecord.from_json(entry) for entry in self._json("GET", "/api/jobs/")]

    def get_job_logs(self, submission_id: str) -> str:
        return str(self._json("GET", f"/api/jobs/{submission_id}/logs")["logs"])

    def stop_job(self, submission_id: str) -> bool:
        return bool(self._json("POST", f"/api/jobs/{submission_id}/stop")["stopped"])
