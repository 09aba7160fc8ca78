"""What a person does in a browser, against the tier's real Airflow UI: fill and save the ``raytpu`` connection
form and find it again as entered, test it, open each extra link a task offers, and read a task's log page.

The browser is headless Chromium from Debian's packages (``make browser``), driven by Playwright's Python
driver: Playwright downloads no browser.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import quote

import pytest

from tests.deployment.deployment import AirflowDeployment
from tests.deployment.rest import AirflowApi

if TYPE_CHECKING:
    from playwright.sync_api import Browser, Page

pytestmark = pytest.mark.timeout(1200)

CHROMIUM = Path("/usr/bin/chromium")
# No sandbox: the tier runs as root. No GPU, no background updates or pings: nothing but the pages under test.
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update"]
CONNECTION_ID = "raytpu_browser"
DAG_ID = "raytpu_jobs"
SECRET = "browser-credential-7f3a"
ANSI = re.compile(r"\x1b\[")


@pytest.fixture(scope="module")
def browser() -> Iterator[Browser]:
    from playwright.sync_api import sync_playwright

    if not CHROMIUM.is_file():
        pytest.fail(f"{CHROMIUM} is missing: `make browser` installs Debian's chromium package")
    with sync_playwright() as playwright:
        chromium = playwright.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
        try:
            yield chromium
        finally:
            chromium.close()


@pytest.fixture(scope="module")
def page(browser: Browser, deployment: AirflowDeployment) -> Iterator[Page]:
    """A page signed in to the UI as the deployment's admin."""
    context = browser.new_context(viewport={"width": 1400, "height": 1000})
    context.set_default_timeout(30_000)
    signed_in = context.new_page()
    signed_in.goto(f"{deployment.url}/auth/login")
    signed_in.get_by_label("Username").fill("admin")
    signed_in.get_by_label("Password").fill(deployment.admin_password())
    signed_in.get_by_role("button", name="Sign in").click()
    signed_in.wait_for_url(lambda url: "/auth/login" not in url)
    try:
        yield signed_in
    finally:
        context.close()


# -- the connection form --------------------------------------------------------------------------------


def entered(deployment: AirflowDeployment) -> dict[str, Any]:
    """What the test types into the form's extra fields, by field name."""
    return {"namespace": "ml-team", "deployment": "prod-eu", "local_home": str(deployment.raytpu_home),
            "local_max_hosts": 4}


def fill_connection_form(page: Page, deployment: AirflowDeployment) -> None:
    page.goto(f"{deployment.url}/connections")
    page.get_by_role("button", name="Add Connection").click()
    dialog = page.get_by_role("dialog")
    dialog.locator("input[name=connection_id]").fill(CONNECTION_ID)
    dialog.get_by_role("combobox").first.fill("Ray on TPU")
    page.keyboard.press("Enter")
    dialog.get_by_role("button", name="Extra Fields", exact=True).click()
    for name, value in entered(deployment).items():
        if name == "local_max_hosts":
            dialog.get_by_role("spinbutton").fill(str(value))
        else:
            dialog.locator(f"input[name=element_{name}]").fill(value)
    # A Chakra checkbox: its input is hidden, the control beside it takes the click.
    dialog.locator("input[name=element_insecure_dashboard_http]").locator("xpath=..").click()
    dialog.get_by_role("button", name="Save").click()
    page.get_by_text("Connection has been successfully created").wait_for()


def form_values(page: Page, deployment: AirflowDeployment) -> dict[str, Any]:
    """The saved connection's extra fields as its edit dialog shows them."""
    page.goto(f"{deployment.url}/connections")
    page.get_by_role("row").filter(has_text=CONNECTION_ID).get_by_role("button").nth(1).click()
    dialog = page.get_by_role("dialog")
    dialog.get_by_role("button", name="Extra Fields", exact=True).click()
    values: dict[str, Any] = {}
    for field in dialog.locator("input[name^=element_]").all():
        name = str(field.get_attribute("name")).removeprefix("element_")
        values[name] = field.is_checked() if field.get_attribute("type") == "checkbox" else field.input_value()
    values["local_max_hosts"] = dialog.get_by_role("spinbutton").input_value()
    page.keyboard.press("Escape")
    return values


def test_the_form_saved_connection_reads_back_as_entered_and_passes_the_providers_test(
        page: Page, deployment: AirflowDeployment, api: AirflowApi) -> None:
    fill_connection_form(page, deployment)
    typed = entered(deployment)

    shown = form_values(page, deployment)
    assert {name: shown[name] for name in typed} == {**typed, "local_max_hosts": "4"}
    assert (shown["backend"], shown["dashboard"], shown["insecure_dashboard_http"]) == ("local", "proxy", True)
    assert "***" not in shown.values(), shown  # no field of the provider is a secret

    stored = api.call("GET", f"/api/v2/connections/{CONNECTION_ID}")
    extra = json.loads(stored["extra"])
    assert {name: extra[name] for name in typed} == typed
    assert extra["insecure_dashboard_http"] is True and extra["backend"] == "local"
    assert "***" not in json.dumps(stored), stored

    # The provider's Test with exactly what was stored (the list page's Test button cannot: see below).
    answer = api.test_connection({key: value for key, value in stored.items() if key != "team_name"})
    assert answer["status"] is True, answer
    assert "This Airflow deployment records itself as 'prod-eu'" in answer["message"], answer


def test_the_list_pages_test_button_sends_an_empty_host_and_port_0_and_is_refused(
        page: Page, deployment: AirflowDeployment, api: AirflowApi) -> None:
    """Airflow 3.3.2's own button, as docs/troubleshooting.md describes it: when Airflow fixes it, this fails."""
    if not any(c["connection_id"] == CONNECTION_ID for c in api.call("GET", "/api/v2/connections")["connections"]):
        fill_connection_form(page, deployment)
    page.goto(f"{deployment.url}/connections")
    with page.expect_response(lambda response: response.url.endswith("/api/v2/connections/test")) as tested:
        page.get_by_role("row").filter(has_text=CONNECTION_ID).get_by_role("button").first.click()
    sent = json.loads(tested.value.request.post_data or "{}")
    assert (sent["host"], sent["port"], tested.value.status) == ("", 0, 400)
    page.get_by_text("Test Connection Failed").wait_for()


# -- a task's links and log ----------------------------------------------------------------------------


def task_page(deployment: AirflowDeployment, run_id: str, task_id: str, tab: str = "") -> str:
    return f"{deployment.url}/dags/{DAG_ID}/runs/{quote(run_id, safe='')}/tasks/{task_id}{tab}"


def offered_links(page: Page, url: str, expected: str) -> dict[str, str]:
    """The extra links on a task's Details tab, once ``expected`` shows: the links that open in a new tab."""
    page.goto(url)
    page.get_by_role("link", name=expected).wait_for()
    return {link.inner_text().strip(): str(link.get_attribute("href"))
            for link in page.locator("a[target=_blank]").all() if link.get_attribute("href")}


def test_each_extra_link_opens_a_page_and_the_task_log_page_reads_cleanly(
        page: Page, deployment: AirflowDeployment, api: AirflowApi, tmp_path: Path) -> None:
    from playwright.sync_api import expect

    api.set_variable("job_credential", SECRET)
    api.unpause(DAG_ID)
    run_id = api.trigger(DAG_ID, {"accelerator": "v4", "topology": "2x2x1", "release_dir": str(tmp_path)})
    # Beside the control-plane tier the cluster took 4 min to be ready and the job was submitted after 5 min.
    try:
        api.wait("count_job's Ray job link", lambda: api.links(DAG_ID, run_id, "count_job")["Ray job"], 600)
        expected = {"create_cluster": "Ray dashboard", "wait_ready": "Ray dashboard", "count_job": "Ray job"}
        for task_id, name in expected.items():
            links = offered_links(page, task_page(deployment, run_id, task_id, "/details"), name)
            assert list(links) == [name], (task_id, links)
            assert links[name] == api.links(DAG_ID, run_id, task_id)[name]
            opened = page.context.new_page()
            try:
                response = opened.goto(links[name])
                assert response is not None and response.status == 200, (task_id, links[name])
                expect(opened).to_have_title(re.compile(r"\| Ray Dashboard$"), timeout=30_000)
                if name == "Ray job":  # the dashboard's own page of the task's job
                    job_id = links[name].rsplit("/", 1)[1]
                    opened.get_by_text(job_id).first.wait_for()
            finally:
                opened.close()
    finally:  # the jobs end either way: a run left waiting would keep its cluster busy for the rest of the tier
        for task_id in ("count_job", "hold_job"):
            (tmp_path / task_id).touch()
    assert api.wait_run(DAG_ID, run_id, timeout=300) == "success", api.run_report(DAG_ID, run_id)

    page.goto(task_page(deployment, run_id, "count_job"))
    page.get_by_text(re.compile(r"released after \d+ ticks")).first.wait_for()
    shown = page.locator("body").inner_text()
    assert not ANSI.search(shown)
    assert "token ***" in shown and SECRET not in shown, shown[-3000:]
