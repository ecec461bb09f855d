"""The HTTP front's API page in a real headless browser: served locally, no outside asset, every route shown."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import pytest
import yaml

from shardrouter.core.rpcs import RPCS
from shardrouter.core.shardmap import even_shard_map, shard_map_document
from shardrouter.router.server import start_router_thread
from shardrouter.router.settings import RouterSettings

_BROWSER = Path("/usr/bin/chromium").exists() and Path("/usr/bin/chromedriver").exists()


@pytest.mark.skipif(
    not _BROWSER and not os.environ.get("SHARD_ROUTER_REQUIRE_BROWSER"),
    reason="needs Debian's chromium and chromium-driver (apt-get install -y chromium chromium-driver)",
)
def test_the_api_page_renders_every_route_in_chromium(tmp_path) -> None:
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service
    from selenium.webdriver.support.ui import WebDriverWait

    shard_map = tmp_path / "shard-map.yaml"
    # No shard needs to answer: the page and its document are the router's own.
    shard_map.write_text(yaml.safe_dump(shard_map_document(even_shard_map({"shard-0": "127.0.0.1:1"}))))
    router = start_router_thread(
        RouterSettings(
            listen="127.0.0.1:0", http_listen="127.0.0.1:0", shard_map=str(shard_map), dev_mode=True, metrics_port=0
        )
    )
    options = webdriver.ChromeOptions()
    options.binary_location = "/usr/bin/chromium"
    for flag in ("--headless=new", "--no-sandbox", "--disable-gpu", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--window-size=1200,900"):
        options.add_argument(flag)
    try:
        with tempfile.TemporaryDirectory(prefix="chromium-") as profile:
            options.add_argument(f"--user-data-dir={profile}")
            driver = webdriver.Chrome(options=options, service=Service(executable_path="/usr/bin/chromedriver"))
            try:
                driver.get(f"http://127.0.0.1:{router.http_port}/docs")
                WebDriverWait(driver, 20).until(lambda d: d.find_elements("css selector", "section.op"))
                text = driver.find_element("tag name", "body").text
                # Every resource a page loaded came from the router itself.
                loaded = driver.execute_script(
                    "return performance.getEntriesByType('resource').map(e => e.name)"
                )
                driver.save_screenshot(str(tmp_path / "api-page.png"))
                if os.environ.get("SHARD_ROUTER_KEEP_SCREENSHOT"):
                    driver.save_screenshot(os.environ["SHARD_ROUTER_KEEP_SCREENSHOT"])
            finally:
                driver.quit()
    finally:
        router.stop(1.0)
    for declaration in RPCS:
        if declaration.http is not None:
            assert declaration.http.path in text, f"{declaration.http.path} not shown"
    assert "/transfers" in text
    assert "Idempotency-Key" in text
    assert loaded, "the page did not fetch its document"
    assert all(url.startswith(f"http://127.0.0.1:{router.http_port}/") for url in loaded), loaded
    assert (tmp_path / "api-page.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
