"""The status page in a real headless Chromium: sign in, see a policy set through the API, roll back.

A screenshot of the page is written to build/test-output/status-page.png (and the test's tmp dir).
"""

from __future__ import annotations

import re
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
from selenium import webdriver
from selenium.webdriver.common.by import By
from selenium.webdriver.support.ui import WebDriverWait

from meshcache.contract.paths import REPO_ROOT
from meshcache.ctl import launchers, procs
from tests.helpers.control_plane import READ_TOKEN, WRITE_TOKEN, start_control_plane
from tests.helpers.kserve import grpc_call, mlp_request
from tests.helpers.signals import stopped
from tests.status import browser
from tests.status.helpers import RunningMesh

pytestmark = pytest.mark.skipif(browser.available() is not None, reason=str(browser.available()))
OUTPUT = REPO_ROOT / "build" / "test-output"
MODEL = "mlp-classifier"


@pytest.fixture
def driver(tmp_path: Path) -> Iterator[webdriver.Chrome]:
    d = browser.chromium(tmp_path)
    try:
        yield d
    finally:
        d.quit()


def _text(d: webdriver.Chrome, css: str) -> str:
    return str(d.find_element(By.CSS_SELECTOR, css).text)


def _wait(d: webdriver.Chrome, check: object, timeout: float = 20) -> None:
    WebDriverWait(d, timeout, poll_frequency=0.1).until(check)


def _policy_ttl(d: webdriver.Chrome, version: int) -> str | None:
    if d.find_element(By.TAG_NAME, "body").get_attribute("data-version") != str(version):
        return None
    return _text(d, f'#policies tr[data-model="{MODEL}"] td.ttl')


def test_page_shows_policies_stats_history_and_rolls_back(running_mesh: RunningMesh, driver: webdriver.Chrome,
                                                          tmp_path: Path) -> None:
    app = running_mesh.endpoints["app"]
    with running_mesh.client() as api:
        before = api.get("/v1/snapshot").json()["version"]
        spec = {"ttl_s": 123, "max_ttl_s": 456, "coalesce_timeout_ms": 0, "stale_if_error_s": 45}
        changed = api.put(f"/v1/policies/{MODEL}", json=spec).json()["version"]
    request = mlp_request(8101).SerializeToString()
    grpc_call(app, request)
    grpc_call(app, request)

    # Not signed in: only the form, no data, and the API refuses a wrong token.
    driver.get(f"{running_mesh.api_url}/status")
    _wait(driver, lambda d: d.find_element(By.ID, "login").is_displayed())
    assert not driver.find_element(By.ID, "main").is_displayed()
    assert browser.console_errors(driver) == []
    driver.find_element(By.ID, "token").send_keys("not-a-valid-token-at-all")
    driver.find_element(By.CSS_SELECTOR, "#login-form button").click()
    _wait(driver, lambda d: "Token refused" in _text(d, "#login-error"))
    refused = browser.console_errors(driver)  # Chromium logs the refused request itself, nothing else
    assert refused and all("/v1/whoami" in str(e["message"]) and "401" in str(e["message"]) for e in refused)

    driver.find_element(By.ID, "token").send_keys(running_mesh.token)
    driver.find_element(By.CSS_SELECTOR, "#login-form button").click()
    _wait(driver, lambda d: _policy_ttl(d, changed) == "123")
    assert "mesh (write)" in _text(driver, "#who")
    assert f"(version {changed})" in _text(driver, "#snapshot-version")
    policy_row = f'#policies tr[data-model="{MODEL}"]'
    assert (_text(driver, f"{policy_row} td.coalesce"), _text(driver, f"{policy_row} td.stale-if-error"),
            _text(driver, f"{policy_row} td.stale-while-revalidate")) == ("off", "45", "0")

    # History: the change with its diff; proxies: the server sidecar has ACKed it; stats read.
    row = f'#history tr[data-version="{changed}"]'
    assert "ttl_s 300 → 123" in _text(driver, row) and "max_ttl_s 1800 → 456" in _text(driver, row)
    assert "stale_if_error_s 0 → 45" in _text(driver, row) and "coalesce_timeout_ms 5000 → 0" in _text(driver, row)
    _wait(driver, lambda d: "current" in _text(d, '#proxies tr[data-node="meshcache-server-sidecar"] td.acked'))
    _wait(driver, lambda d: _text(d, f'#models tr[data-model="{MODEL}"] td.hit-ratio') not in ("", "—"))
    assert "read" in _text(driver, '#proxies tr[data-node="meshcache-server-sidecar"] td.stats')
    # Entries and bytes per model, as the filter accounts them per policy.
    _wait(driver, lambda d: _text(d, f'#models tr[data-model="{MODEL}"] td.entries') not in ("", "—", "0"))
    assert int(_text(driver, f'#models tr[data-model="{MODEL}"] td.entries').replace(",", "")) >= 1
    assert _text(driver, f'#models tr[data-model="{MODEL}"] td.bytes').endswith(("B", "KiB", "MiB"))
    assert "what each policy holds" in _text(driver, "#stats-note")
    # Tokens saved (LLM answers served from the cache): a count where the filter reports one,
    # else "—" (unknown, never a made-up 0); the policy's semantic layer is off.
    for cell in ("tokens-prompt", "tokens-completion"):
        assert re.fullmatch(r"—|[0-9,]+", _text(driver, f'#models tr[data-model="{MODEL}"] td.{cell}')), cell
    assert _text(driver, f"{policy_row} td.semantic") == "off"

    # Roll back to the version before the change: two clicks (arm, confirm).
    button = driver.find_element(By.CSS_SELECTOR, f'#history tr[data-version="{before}"] button.rollback')
    button.click()
    assert "Confirm" in button.text
    button.click()
    _wait(driver, lambda d: _policy_ttl(d, changed + 1) == "300")
    rolled_back = (_text(driver, f"{policy_row} td.coalesce"), _text(driver, f"{policy_row} td.stale-if-error"))
    assert rolled_back == ("5000", "0")
    assert f"Rolled back to version {before}" in _text(driver, "#message")
    assert f"rollback to {before}" in _text(driver, f'#history tr[data-version="{changed + 1}"]')
    with running_mesh.client() as api:
        now = api.get(f"/v1/policies/{MODEL}").json()
    assert now["version"] == changed + 1 and now["policy"]["ttl_s"] == 300
    _wait(driver, lambda d: "current" in _text(d, '#proxies tr[data-node="meshcache-server-sidecar"] td.acked'))

    OUTPUT.mkdir(parents=True, exist_ok=True)
    shot = tmp_path / "status-page.png"
    assert driver.save_screenshot(str(shot))
    shutil.copy(shot, OUTPUT / "status-page.png")
    errors = browser.console_errors(driver)  # since the refused token: none
    assert errors == [], errors


def test_read_token_and_unreadable_proxy_stats(driver: webdriver.Chrome, tmp_path: Path) -> None:
    """A read token sees everything but cannot roll back; a proxy whose stats can't be read says why."""
    redis, port = launchers.start_redis(tmp_path / "redis")
    dead = f"http://127.0.0.1:{procs.free_port()}/stats/prometheus"
    cp = start_control_plane(tmp_path / "logs", port, extra_env={"MESHCACHE_CP_PROXY_STATS": f"ghost-proxy={dead}"})
    try:
        with cp.client(WRITE_TOKEN) as c:
            c.put("/v1/policies/m1", json={"ttl_s": 5})
            c.put("/v1/policies/m1", json={"ttl_s": 6})
        driver.get(f"{cp.url}/status")
        _wait(driver, lambda d: d.find_element(By.ID, "login").is_displayed())
        driver.find_element(By.ID, "token").send_keys(READ_TOKEN)
        driver.find_element(By.CSS_SELECTOR, "#login-form button").click()
        _wait(driver, lambda d: "unavailable" in _text(d, '#proxies tr[data-node="ghost-proxy"] td.stats'))
        row = _text(driver, '#proxies tr[data-node="ghost-proxy"]')
        assert dead in row and "not connected" in row and "?" in row
        assert "could not be read" in _text(driver, "#stats-note")
        assert _text(driver, '#models tr[data-model="m1"] td.entries') == "—", "unknown, not 0"
        assert "viewer (read)" in _text(driver, "#who")
        button = driver.find_element(By.CSS_SELECTOR, '#history tr[data-version="1"] button.rollback')
        assert not button.is_enabled()
        assert not driver.find_element(By.ID, "serving").is_displayed()
        # Redis stalls: the page says the control plane is degraded and what it serves, then recovers.
        with stopped(redis):
            _wait(driver, lambda d: d.find_element(By.ID, "serving").is_displayed())
            assert _text(driver, "#serving") == ("Degraded: policy store (Redis) unreachable: serving snapshot 2 "
                                                 "from memory. Changes are refused (503) until it is back.")
            assert _text(driver, '#models tr[data-model="m1"] td.entries') == "—"  # the rest still shown
        _wait(driver, lambda d: not d.find_element(By.ID, "serving").is_displayed())
        assert browser.console_errors(driver) == []
    finally:
        cp.proc.stop()
        redis.stop()
