"""The Ray dashboard as an operator opens it: headless Chromium (Debian's `chromium`; the test skips,
saying why, without it) loads the dashboard of a local Tandem cluster with Ray's token (the cookie
the dashboard's own prompt sets), finds the five actors by name on its Actors page, and saves a
screenshot of it and of the Overview and Cluster pages (docs/images/ray-dashboard-*.png are ones it
took). Without the token Ray's API answers 401, as docs/operations.md says."""

from __future__ import annotations

import asyncio
import base64
import itertools
import json
import shutil
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from cluster.config import parse_config
from cluster.pools import ray_cluster
from cluster.pools.ray_observe import TOKEN_COMMAND, ray_view
from tests.net import free_port

ROOT = Path(__file__).resolve().parents[1]
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
ACTORS = ("controller", "pool-prefill", "pool-decode", "prefill-0", "decode-0")
OTHER_PAGES = {"overview": "Cluster", "cluster": "ALIVE"}  # page -> text it shows once loaded
COOKIE = "ray-authentication-token"  # what the dashboard's token prompt sets (POST /api/authenticate)

pytestmark = [
    pytest.mark.slow,
    pytest.mark.ray,
    pytest.mark.skipif(CHROMIUM is None, reason="no chromium binary (apt-get install chromium)"),
]


@pytest.fixture(scope="module")
def dashboard():
    config = parse_config({
        "model": {"path": str(ROOT / "models" / "tandem-demo-code"), "dtype": "float32"},
        "cache": {"block_size": 16, "num_blocks": 64},
        "prefill": {"num_cpus": 1}, "decode": {"num_cpus": 1},
    })  # fmt: skip
    cluster = ray_cluster.start(
        config, num_cpus=4, log_to_driver=False, include_dashboard=True, dashboard_port=free_port()
    )
    try:
        view = ray_view()
        assert view.dashboard_url and view.token_auth
        yield view.dashboard_url
    finally:
        cluster.shutdown()


_CALLS = itertools.count(1)


async def _cdp(ws, method: str, params: dict | None = None):  # type: ignore[no-untyped-def]
    """One Chrome DevTools Protocol call on a page's websocket; events in between are skipped."""
    call = next(_CALLS)
    await ws.send_json({"id": call, "method": method, "params": params or {}})
    while True:
        message = json.loads((await ws.receive()).data)
        if message.get("id") == call:
            assert "error" not in message, message
            return message.get("result", {})


async def _actors_page(devtools: int, url: str, token: str, shot: Path, timeout_s: float) -> str:
    import aiohttp

    async with aiohttp.ClientSession() as session:
        async with session.get(f"http://127.0.0.1:{devtools}/json/list") as r:
            page = next(t for t in await r.json() if t["type"] == "page")
        async with session.ws_connect(page["webSocketDebuggerUrl"], max_msg_size=0) as ws:
            await _cdp(ws, "Network.enable")
            await _cdp(ws, "Network.setCookie", {"name": COOKIE, "value": token, "url": url, "httpOnly": True})
            await _cdp(ws, "Emulation.setDeviceMetricsOverride",
                       {"width": 1280, "height": 940, "deviceScaleFactor": 1, "mobile": False})  # fmt: skip
            await _cdp(ws, "Page.navigate", {"url": f"{url}/#/actors"})
            deadline = time.monotonic() + timeout_s
            text = ""
            while not all(name in text for name in ACTORS) and time.monotonic() < deadline:
                await asyncio.sleep(1)
                answer = await _cdp(ws, "Runtime.evaluate", {"expression": "document.body.innerText"})
                text = answer.get("result", {}).get("value", "")
            await asyncio.sleep(1)  # the table's last rows render
            await _screenshot(ws, shot)
            for page, marker in OTHER_PAGES.items():  # the pages docs/operations.md shows beside it
                await _cdp(ws, "Page.navigate", {"url": f"{url}/#/{page}"})
                seen, deadline = "", time.monotonic() + 30
                while marker not in seen and time.monotonic() < deadline:
                    await asyncio.sleep(1)
                    answer = await _cdp(ws, "Runtime.evaluate", {"expression": "document.body.innerText"})
                    seen = answer.get("result", {}).get("value", "")
                await asyncio.sleep(2)  # its charts and tables fill in
                await _screenshot(ws, shot.with_name(f"ray-dashboard-{page}.png"))
            return text


async def _screenshot(ws, path: Path) -> None:  # type: ignore[no-untyped-def]
    png = await _cdp(ws, "Page.captureScreenshot", {"format": "png"})
    path.write_bytes(base64.b64decode(png["data"]))


def test_the_dashboard_with_the_token_shows_the_five_actors_by_name(dashboard, tmp_path):
    with pytest.raises(urllib.error.HTTPError) as refused:  # no token, no API
        urllib.request.urlopen(f"{dashboard}/api/v0/actors", timeout=10)
    assert refused.value.code == 401
    ray_cli = [str(Path(sys.executable).parent / "ray"), *TOKEN_COMMAND.split()[1:]]  # `ray get-auth-token`
    token = subprocess.run(ray_cli, capture_output=True, text=True, check=True).stdout.strip()
    port = free_port()
    browser = subprocess.Popen(
        [CHROMIUM, "--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
         f"--remote-debugging-port={port}", f"--user-data-dir={tmp_path / 'profile'}", "about:blank"],
        stdout=subprocess.DEVNULL, stderr=(tmp_path / "chromium.log").open("w"),
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/json/version", timeout=2).close()
                break
            except OSError:
                assert browser.poll() is None and time.monotonic() < deadline, (tmp_path / "chromium.log").read_text()
                time.sleep(0.5)
        shot = tmp_path / "ray-dashboard-actors.png"
        text = asyncio.run(_actors_page(port, dashboard, token, shot, timeout_s=120))
        print(f"screenshot: {shot} ({shot.stat().st_size} bytes)")
        missing = [name for name in ACTORS if name not in text]
        assert not missing, f"the Actors page lacks {missing}: {text[:2000]}"
        for png in (shot, *(tmp_path / f"ray-dashboard-{page}.png" for page in OTHER_PAGES)):
            assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    finally:
        browser.terminate()
        browser.wait(30)
