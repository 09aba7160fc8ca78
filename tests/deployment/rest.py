"""The deployment's REST API, called as the UI calls it: a token from ``POST /auth/token``, then
``/api/v2`` (and the UI's own ``/ui`` routes where the UI uses them).

Waits poll the API every second; a wait that times out names what it waited for and what it saw.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any
from urllib.parse import quote

import httpx

FINISHED_RUN = ("success", "failed")
FINISHED_TASK = ("success", "failed", "skipped", "upstream_failed", "removed")


class AirflowApi:
    """A logged-in API client.

    :param url: the api-server, ``http://127.0.0.1:<port>``.
    :param username: the user to log in as.
    :param password: the user's password.
    :param on_timeout: called when a wait times out; its text (component logs) goes into the error.
    """

    def __init__(self, url: str, username: str, password: str, on_timeout: Callable[[], str] = str) -> None:
        self.url = url
        self.on_timeout = on_timeout
        token = httpx.post(f"{url}/auth/token", json={"username": username, "password": password}, timeout=30)
        token.raise_for_status()
        self.client = httpx.Client(
            base_url=url, headers={"Authorization": f"Bearer {token.json()['access_token']}"}, timeout=60
        )

    def close(self) -> None:
        self.client.close()

    def call(self, method: str, path: str, **kwargs: Any) -> Any:
        """One request; an error status raises with the response body."""
        return self._answer(method, path, self.client.request(method, path, **kwargs))

    @staticmethod
    def _answer(method: str, path: str, response: httpx.Response) -> Any:
        """A response's JSON body; an error status raises with the body."""
        if response.status_code >= 400:
            raise AssertionError(f"{method} {path} -> {response.status_code}: {response.text}")
        return response.json() if response.content else None

    # -- DAGs and runs --------------------------------------------------------------------------

    def dag(self, dag_id: str) -> dict[str, Any]:
        return self.call("GET", f"/api/v2/dags/{quote(dag_id)}")

    def dag_ids(self) -> set[str]:
        return {d["dag_id"] for d in self.call("GET", "/api/v2/dags", params={"limit": 100})["dags"]}

    def import_errors(self) -> list[dict[str, Any]]:
        return self.call("GET", "/api/v2/importErrors")["import_errors"]

    def unpause(self, dag_id: str) -> None:
        self.call("PATCH", f"/api/v2/dags/{quote(dag_id)}", json={"is_paused": False})

    def trigger(self, dag_id: str, conf: dict[str, Any] | None = None) -> str:
        """The Trigger button: a manual run with ``conf``; returns its run id."""
        body = {"logical_date": None, "conf": conf or {}}
        run = self.call("POST", f"/api/v2/dags/{quote(dag_id)}/dagRuns", json=body)
        return run["dag_run_id"]

    def backfill(self, dag_id: str, from_date: str, to_date: str, max_active_runs: int) -> dict[str, Any]:
        """The Backfill dialog: a run for every logical date from ``from_date`` to ``to_date``, ``max_active_runs``
        at once.

        Sent again, as a person would, while the API answers 503: on SQLite, a backfill whose runs Airflow could
        not write while another component held the database is refused ("Database is locked. Backfill creation is
        not supported on SQLite under concurrent access") and removed so that it can be sent again
        (``airflow/models/backfill.py``, ``_cleanup_partial_backfill``).
        """
        body = {"dag_id": dag_id, "from_date": from_date, "to_date": to_date, "max_active_runs": max_active_runs}
        deadline = time.monotonic() + 60
        while True:
            response = self.client.post("/api/v2/backfills", json=body)
            if response.status_code != 503 or time.monotonic() > deadline:
                break
            time.sleep(2)
        return self._answer("POST", "/api/v2/backfills", response)

    def runs(self, dag_id: str) -> list[dict[str, Any]]:
        return self.call("GET", f"/api/v2/dags/{quote(dag_id)}/dagRuns", params={"order_by": "run_after"})["dag_runs"]

    def run(self, dag_id: str, run_id: str) -> dict[str, Any]:
        return self.call("GET", self._run_path(dag_id, run_id))

    # -- task instances -------------------------------------------------------------------------

    def task(self, dag_id: str, run_id: str, task_id: str) -> dict[str, Any]:
        return self.call("GET", f"{self._run_path(dag_id, run_id)}/taskInstances/{task_id}")

    def tries(self, dag_id: str, run_id: str, task_id: str) -> list[dict[str, Any]]:
        """Every try of a task instance (the UI's try selector), oldest first."""
        tries = self.call("GET", f"{self._run_path(dag_id, run_id)}/taskInstances/{task_id}/tries")["task_instances"]
        return sorted(tries, key=lambda t: t["try_number"])

    def xcom(self, dag_id: str, run_id: str, task_id: str, key: str = "return_value") -> Any:
        entry = self.call("GET", f"{self._run_path(dag_id, run_id)}/taskInstances/{task_id}/xcomEntries/{key}",
                          params={"deserialize": True})
        return entry["value"]

    def xcoms(self, dag_id: str, run_id: str, task_id: str) -> dict[str, Any]:
        """Every XCom of a task instance as the UI's XCom tab lists them: key -> value."""
        path = f"{self._run_path(dag_id, run_id)}/taskInstances/{task_id}/xcomEntries"
        keys = [entry["key"] for entry in self.call("GET", path)["xcom_entries"]]
        return {key: self.xcom(dag_id, run_id, task_id, key) for key in keys}

    def links(self, dag_id: str, run_id: str, task_id: str) -> dict[str, str | None]:
        """The task's extra links by name; ``None`` for one the task has not given a URL (yet)."""
        return self.call("GET", f"{self._run_path(dag_id, run_id)}/taskInstances/{quote(task_id)}/links")[
            "extra_links"]

    def log(self, dag_id: str, run_id: str, task_id: str, try_number: int) -> list[str]:
        """The task's log as the UI shows it: one string per record (the message, then any extra fields)."""
        return [_record_text(record) for record in self.log_records(dag_id, run_id, task_id, try_number)]

    def log_records(self, dag_id: str, run_id: str, task_id: str, try_number: int) -> list[dict[str, Any]]:
        """The task's log records as the UI gets them (``event``, ``level``, an exception's ``error_detail``...)."""
        body = self.call("GET", f"{self._run_path(dag_id, run_id)}/taskInstances/{task_id}/logs/{try_number}",
                         params={"full_content": True}, headers={"Accept": "application/json"})
        records: list[dict[str, Any]] = body["content"]
        return records

    def mark(self, dag_id: str, run_id: str, task_id: str, state: str) -> None:
        """"Mark as failed/success" on one task instance."""
        self.call("PATCH", f"{self._run_path(dag_id, run_id)}/taskInstances/{task_id}", json={"new_state": state})

    def clear(self, dag_id: str, run_id: str, task_id: str) -> list[str]:
        """The Clear button on one task instance with the UI's defaults; returns the task ids cleared."""
        body = {"dag_run_id": run_id, "dry_run": False, "task_ids": [task_id], "only_failed": False,
                "include_upstream": False, "include_downstream": True, "include_future": False, "include_past": False}
        cleared = self.call("POST", f"/api/v2/dags/{quote(dag_id)}/clearTaskInstances", json=body)
        return sorted(ti["task_id"] for ti in cleared["task_instances"])

    # -- connections and jobs -------------------------------------------------------------------

    def hook_meta(self) -> list[dict[str, Any]]:
        """What the connection form is built from."""
        return self.call("GET", "/ui/connections/hook_meta")

    def test_connection(self, connection: dict[str, Any]) -> dict[str, Any]:
        """The connection form's Test button."""
        return self.call("POST", "/api/v2/connections/test", json=connection)

    def save_connection(self, connection: dict[str, Any]) -> None:
        self.call("POST", "/api/v2/connections", json=connection)

    def set_variable(self, key: str, value: str) -> None:
        """Create the Variable, or give the one there ``value``."""
        body = {"key": key, "value": value}
        if self.client.post("/api/v2/variables", json=body).status_code == 409:
            self.call("PATCH", f"/api/v2/variables/{quote(key)}", json=body)
        else:
            assert self.call("GET", f"/api/v2/variables/{quote(key)}")["value"] == value

    def live_jobs(self, job_type: str) -> list[dict[str, Any]]:
        """Running jobs of a type (``TriggererJob``, ``SchedulerJob``) with a recent heartbeat."""
        return self.call("GET", "/api/v2/jobs", params={"job_type": job_type, "is_alive": True})["jobs"]

    # -- waiting --------------------------------------------------------------------------------

    def wait(self, what: str, probe: Callable[[], Any], timeout: float,
             check: Callable[[], None] = lambda: None) -> Any:
        """Poll ``probe`` every second until it returns something truthy; ``check`` may raise meanwhile."""
        deadline = time.monotonic() + timeout
        last: Any = None
        while True:
            check()
            last = probe()
            if last:
                return last
            if time.monotonic() > deadline:
                raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}; last: {last!r}\n"
                                     f"{self.on_timeout()}")
            time.sleep(1)

    def wait_task(self, dag_id: str, run_id: str, task_id: str, states: tuple[str, ...],
                  timeout: float = 300.0) -> dict[str, Any]:
        """Wait until the task instance is in one of ``states``; a different finished state fails at once."""
        def probe() -> dict[str, Any] | None:
            ti = self.task(dag_id, run_id, task_id)
            if ti["state"] in states:
                return ti
            if ti["state"] in FINISHED_TASK:
                raise AssertionError(f"{dag_id}/{run_id}/{task_id} ended {ti['state']}, expected {states}\n"
                                     f"{self.run_report(dag_id, run_id)}")
            return None

        return self.wait(f"{dag_id}/{task_id} in {states}", probe, timeout)

    def wait_run(self, dag_id: str, run_id: str, timeout: float = 600.0) -> str:
        """Wait until the DAG run has finished; its state."""
        run = self.wait(f"run {dag_id}/{run_id} to finish",
                        lambda: (r := self.run(dag_id, run_id))["state"] in FINISHED_RUN and r, timeout)
        return run["state"]

    def run_report(self, dag_id: str, run_id: str, log_lines: int = 25) -> str:
        """Every task's state and try, and the log tail of each task that did not succeed."""
        tasks = self.call("GET", f"{self._run_path(dag_id, run_id)}/taskInstances")["task_instances"]
        lines = [f"run {dag_id}/{run_id}:"]
        for ti in sorted(tasks, key=lambda t: t["task_id"]):
            lines.append(f"  {ti['task_id']}: {ti['state']} (try {ti['try_number']})")
            if ti["state"] not in (None, "success", "scheduled", "queued") and ti["try_number"]:
                with_log = self.log(dag_id, run_id, ti["task_id"], ti["try_number"])
                lines += [f"    | {line}" for line in with_log[-log_lines:]]
        return "\n".join(lines)

    @staticmethod
    def _run_path(dag_id: str, run_id: str) -> str:
        return f"/api/v2/dags/{quote(dag_id)}/dagRuns/{quote(run_id, safe='')}"


def _record_text(record: dict[str, Any]) -> str:
    extra = {k: v for k, v in record.items() if k not in ("event", "timestamp", "level", "logger")}
    text = str(record.get("event", ""))
    return f"{text} {extra}" if extra else text
