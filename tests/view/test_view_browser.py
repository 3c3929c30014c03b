"""The view as a person opens it: the HTML file in headless Chromium (Debian's ``chromium``; installed
here with apt-get where it is missing and this process may, as in CI, else the test is skipped saying
why). No console error, no script error, every panel drawn, the token strips rendered; a screenshot
is saved under the test's tmp dir."""

from __future__ import annotations

import os
import re
import shutil
import subprocess

import pytest

import osdn_diag

PANELS = ("contraction", "layer-head", "head-curve", "by-layer", "eps-vs-q", "d-trajectory")


def _chromium() -> str:
    found = shutil.which("chromium") or shutil.which("chromium-browser")
    if found:
        return found
    if os.geteuid() != 0 or not shutil.which("apt-get"):
        pytest.skip("headless Chromium is not installed, and this process cannot install it "
                    "(needs root and apt-get): apt-get install chromium")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    for cmd in (["apt-get", "update", "-qq"], ["apt-get", "install", "-y", "-qq", "chromium"]):
        done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
        if done.returncode != 0:
            pytest.skip(f"could not install chromium ({' '.join(cmd)}: {done.stderr.strip()[-200:]})")
    found = shutil.which("chromium")
    if not found:
        pytest.skip("apt-get installed chromium, but no chromium is on PATH")
    return found


def _open(browser, page, *extra, fragment=""):
    return subprocess.run([browser, "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run",
                           "--enable-logging=stderr", "--v=0", "--virtual-time-budget=20000",
                           "--window-size=1400,2600", *extra, page.as_uri() + fragment],
                          capture_output=True, text=True, timeout=300)


def test_the_page_opens_without_errors_and_shows_every_panel(lm_run, tmp_path):
    browser = _chromium()
    page = osdn_diag.view({"OSDN-APF": lm_run, "again": lm_run}).save(tmp_path / "view.html")
    dom = _open(browser, page, "--dump-dom")
    assert dom.returncode == 0, dom.stderr[-2000:]
    console = [ln for ln in dom.stderr.splitlines() if "CONSOLE" in ln]
    assert not [ln for ln in console if re.search(r"error|uncaught", ln, re.I)], console
    html = dom.stdout
    assert not re.search(r"<html[^>]*data-errors", html) and '<pre id="osdn-view-errors"' not in html
    for panel in PANELS:  # plotly marks every div it drew into
        assert re.search(rf'<div id="{panel}" class="[^"]*js-plotly-plot', html), panel
    strips = html[html.index('id="strips"'):]
    assert strips.count("<span") >= 2 * 32  # the first prompt's 32 tokens, once per run
    assert "Layer 0, head 0: q_geo" in html  # the head curve, until a cell is clicked
    # A link to a head (what a click on the heat map sets) draws that head's curve
    linked = _open(browser, page, "--dump-dom", fragment="#head=2.1")
    assert linked.returncode == 0 and "Layer 2, head 1: q_geo" in linked.stdout
    assert not re.search(r"<html[^>]*data-errors", linked.stdout)
    shot = tmp_path / "view.png"
    done = _open(browser, page, f"--screenshot={shot}")
    assert done.returncode == 0 and shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", done.stderr[-2000:]
