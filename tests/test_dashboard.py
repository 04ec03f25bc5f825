"""The web dashboard (`/dashboard`) in a real headless browser.

The real service (a `ServiceHost` behind uvicorn on a free localhost port) runs a tenant's small SFT
job; headless Chromium, driven by Selenium through Debian's chromedriver, then shows what a person
would see: the job and its state, the learning curve drawn point by point, the usage, the admin's
tenants and utilisation, and an error for a bad key. Skipped only where `chromium` and
`chromium-driver` are not installed (`scripts/setup-system.sh` installs them).
"""

from __future__ import annotations

import re
import time
from pathlib import Path

import pytest

from vlamux.sdk.http import call as _call

CHROMIUM = Path("/usr/bin/chromium")
CHROMEDRIVER = Path("/usr/bin/chromedriver")

pytestmark = pytest.mark.skipif(
    not (CHROMIUM.exists() and CHROMEDRIVER.exists()),
    reason=f"needs Debian's chromium and chromium-driver ({CHROMIUM}, {CHROMEDRIVER}); "
           "run scripts/setup-system.sh as root",
)

# 400 steps: on a 2-core machine a few hundred steps take several seconds, so the page's 2-second
# polls see the curve grow (60 steps finished between two polls on a quiet CI machine).
STEPS = 400
JOB = {"name": "t", "kind": "sft", "head": {"kind": "gaussian", "action_dim": 4, "horizon": 4, "state_dim": 8},
       "sft": {"dataset": "tiny", "steps": STEPS, "batch_size": 8}, "checkpoint_every": 100}


@pytest.fixture(scope="module")
def service(tmp_path_factory):
    from api_server import running_server

    from demos import demo_dataset

    data = tmp_path_factory.mktemp("service")
    demo_dataset(data / "datasets" / "tiny", 4)
    with running_server(data) as (url, admin, host):
        yield {"url": url, "admin": admin, "host": host}


@pytest.fixture(scope="module")
def browser():
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    opts = webdriver.ChromeOptions()
    opts.binary_location = str(CHROMIUM)
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                "--window-size=1280,900"):
        opts.add_argument(arg)
    driver = webdriver.Chrome(service=Service(str(CHROMEDRIVER)), options=opts)
    driver.set_page_load_timeout(30)
    try:
        yield driver
    finally:
        driver.quit()


def _wait(driver, what: str, cond, timeout: float = 30.0):
    """Polls `cond()` until it returns something truthy; on timeout, fails with what the page shows."""
    deadline = time.monotonic() + timeout
    last_exc = None
    while time.monotonic() < deadline:
        try:
            value = cond()
            if value:
                return value
        except Exception as e:  # noqa: BLE001 - an element not there yet
            last_exc = e
        time.sleep(0.2)
    body = driver.find_element("tag name", "body").text
    pytest.fail(f"timed out waiting for {what} (last error: {last_exc!r}); the page shows:\n{body[:3000]}")


def _css(driver, selector: str):
    return driver.find_element("css selector", selector)


def _attr(driver, selector: str, name: str) -> str | None:
    """An attribute read in the page in one step: the charts are redrawn on every refresh, so a node found
    first and read after may already have been replaced (a stale element)."""
    return driver.execute_script("const n = document.querySelector(arguments[0]);"
                                 "return n && n.getAttribute(arguments[1]);", selector, name)


def _visible_text(driver, selector: str) -> str:
    node = _css(driver, selector)
    return node.text if node.is_displayed() else ""


def test_dashboard_in_a_browser(service, browser):
    url, admin = service["url"], service["admin"]
    acme = _call(url, "POST", "/v1/tenants", admin, {"name": "acme"})
    key, tenant_id = acme["api_key"], acme["tenant"]["id"]

    # ---- the tenant's view, opened before the job exists: it must pick the job up live --------
    browser.get(f"{url}/dashboard#key={key}")
    _wait(browser, "the tenant's view", lambda: _css(browser, "#tenant-view").is_displayed())
    assert "#key=" not in browser.current_url, "the key must not stay in the address bar"
    _wait(browser, "the tenant's id in the header", lambda: tenant_id in _css(browser, "#who").text)
    _wait(browser, "the empty jobs notice", lambda: "No jobs yet" in _visible_text(browser, "#jobs-empty"))

    job_id = _call(url, "POST", "/v1/jobs", key, JOB)["job"]["id"]
    deadline = time.monotonic() + 90
    while _call(url, "GET", f"/v1/jobs/{job_id}", key)["job"]["state"] != "succeeded":
        assert time.monotonic() < deadline, "the SFT job did not succeed"
        time.sleep(0.3)
    service["host"].meter.tick()  # usage lands in the store every few seconds; now, for the test
    rows = _call(url, "GET", f"/v1/jobs/{job_id}/metrics", key)["rows"]
    assert len(rows) == STEPS

    row = f'#jobs-table tbody tr[data-job-id="{job_id}"]'
    _wait(browser, "the job succeeded in the jobs table", lambda: _css(browser, f"{row} .state").text == "succeeded")
    assert _css(browser, f"{row} .name").text.startswith("t ")
    assert f"step {STEPS} / {STEPS}" in _css(browser, f"{row} .progress-cell").text
    assert "sft" in _css(browser, f"{row} .phase").text
    assert float(_css(browser, f"{row} .loss").text) == pytest.approx(rows[-1]["loss"], rel=1e-3)

    # the learning curve: pushed by the job's event stream when the page saw the job live, polled when it
    # first saw it ended (the job may finish between two refreshes); either way every row drawn once
    _wait(browser, f"{STEPS} points on the loss curve",
          lambda: _attr(browser, "#loss-chart", "data-points") == str(STEPS))
    assert _attr(browser, "#loss-chart path.series", "d").count("L") == STEPS - 1
    def fetched():  # a stream's resource entry appears once it has ended (at the job's `end` event)
        return browser.execute_script("return performance.getEntriesByType('resource').map(e => e.name)")

    _wait(browser, "the curve's event stream or its polls", lambda: any(
        u.endswith(f"/v1/jobs/{job_id}/events") or f"/v1/jobs/{job_id}/metrics?since=" in u for u in fetched()))
    since = [int(u.rsplit("=", 1)[1]) for u in fetched() if f"/v1/jobs/{job_id}/metrics?since=" in u]
    assert since == sorted(since) and (not since or since[-1] <= STEPS), since
    assert "Learning curve · t" in _css(browser, "#curve-title").text
    assert _attr(browser, "#success-chart", "data-points") == "0"
    assert "no environment steps" in _css(browser, "#success-chart").text
    _wait(browser, "the job's result", lambda: "final SFT loss" in _css(browser, "#job-detail").text)

    # usage: the job's compute and its checkpoint on disk
    stored = '#usage [data-kind="stored_bytes"] .value'
    _wait(browser, "the usage cards", lambda: _css(browser, stored).text.endswith("MB"))
    head = _css(browser, '#usage [data-kind="head_s"] .value').text
    assert re.fullmatch(r"\d+(\.\d+)? (ms|s)", head) and head not in ("0 ms",), head
    assert re.fullmatch(r"\d+(\.\d+)? (ms|s)", _css(browser, '#usage [data-kind="backbone_s"] .value').text)
    assert _css(browser, '#usage [data-kind="jobs"] .value').text == "1"
    # the job's policy, at the version the job left it
    policy = f'#policies-table tbody tr[data-policy-id="{job_id}"]'
    assert _css(browser, policy).text.split()[-1] == str(STEPS)
    # the datasets its jobs may name: the service's, marked public
    datasets = [r.get_attribute("data-dataset") for r in browser.find_elements("css selector", "#datasets-table tbody tr")]
    assert datasets == [d["name"] for d in _call(url, "GET", "/v1/datasets", key)["datasets"]] and datasets
    assert "public" in _css(browser, "#datasets-table tbody tr").text

    # ---- the admin's view --------------------------------------------------------------------
    browser.get(f"{url}/dashboard#key={admin}")  # a new fragment on the same page: hashchange
    _wait(browser, "the admin's view", lambda: _css(browser, "#admin-view").is_displayed())
    assert not _css(browser, "#tenant-view").is_displayed()
    tenant_row = f'#tenants-table tbody tr[data-tenant-id="{tenant_id}"]'
    _wait(browser, "acme in the tenants table", lambda: _css(browser, f"{tenant_row} .name").text == "acme")
    assert _css(browser, f'{tenant_row} [data-kind="stored_bytes"]').text.endswith("MB")
    pct = _wait(browser, "the training service's utilisation",
                lambda: _css(browser, '#util .util-row[data-service="training"] .pct').text)
    assert re.fullmatch(r"\d+\.\d %", pct) and float(pct.split()[0]) > 0, pct
    assert _css(browser, '#admin-cards [data-kind="jobs_done"] .value').text == "1"
    _wait(browser, "the utilisation chart", lambda: int(_attr(browser, "#util-chart", "data-points")) > 0)
    assert "training" in _css(browser, "#queues-table tbody").text

    # ---- a bad key: a clear error, no data ------------------------------------------------------
    browser.get(f"{url}/dashboard#key=vmx_not_a_key")
    msg = _wait(browser, "the error message", lambda: _visible_text(browser, "#error"))
    assert "401" in msg and "not accepted" in msg, msg
    assert not _css(browser, "#admin-view").is_displayed() and not _css(browser, "#tenant-view").is_displayed()
    assert browser.execute_script("return sessionStorage.getItem('vlamux.apiKey')") is None

    # a tenant's key is refused on the admin's /metrics with 403 (the dashboard never asks it for it)
    from vlamux.sdk import PermissionDeniedError

    with pytest.raises(PermissionDeniedError):
        _call(url, "GET", "/metrics", key)
