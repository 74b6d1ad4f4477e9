"""The document-QA app in a real browser: Debian's chromium driven by Selenium against ``streamlit run``.

Uploads two sample documents plus an empty and a binary file, asks a question side by side
(full cache vs SnapKV), waits for both streamed answers, their sources and the kept-entries
picture, and saves screenshots under ``test-artifacts/`` (or ``$SNAPKV_RAG_TEST_ARTIFACTS``).
Skipped when chromium or its driver is missing, unless ``SNAPKV_RAG_REQUIRE_BROWSER=1``
(scripts/test.sh sets it where it could install them).
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
APP = ROOT / "apps" / "docqa" / "app.py"
CORPUS = ROOT / "examples" / "sample_corpus"
CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
CHROMEDRIVER = shutil.which("chromedriver") or "/usr/bin/chromedriver"
QUESTION = "When does the first ferry leave Marrowick on weekdays?"

pytestmark = pytest.mark.integration


def _browser_available() -> bool:
    return Path(CHROMIUM).exists() and Path(CHROMEDRIVER).exists()


if not _browser_available() and os.environ.get("SNAPKV_RAG_REQUIRE_BROWSER") != "1":
    pytest.skip("chromium and chromium-driver are not installed (apt-get install chromium chromium-driver)", allow_module_level=True)
webdriver = pytest.importorskip("selenium.webdriver")


def artifacts_dir() -> Path:
    folder = Path(os.environ.get("SNAPKV_RAG_TEST_ARTIFACTS", ROOT / "test-artifacts"))
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def app_url(tmp_path_factory):
    """``streamlit run`` on a free loopback port with a fresh store; yields its URL."""
    tmp = tmp_path_factory.mktemp("browser-app")
    port = free_port()
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "PYTHONPATH": str(ROOT)}
    log = open(tmp / "streamlit.log", "wb")
    server = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "streamlit",
            "run",
            str(APP),
            "--server.address",
            "127.0.0.1",
            "--server.port",
            str(port),
            "--server.headless",
            "true",
            "--browser.gatherUsageStats",
            "false",
            "--server.fileWatcherType",
            "none",
            "--client.toolbarMode",
            "minimal",
            "--",
            "--store",
            str(tmp / "chroma"),
            "--uploads",
            str(tmp / "uploads"),
            "--collection",
            "browser-test",
        ],
        cwd=ROOT,
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                with urllib.request.urlopen(f"{url}/_stcore/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            if server.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"streamlit did not start:\n{(tmp / 'streamlit.log').read_text()[-3000:]}")
            time.sleep(0.5)
        yield url
    finally:
        server.terminate()
        try:
            server.wait(timeout=20)
        except subprocess.TimeoutExpired:
            server.kill()
        log.close()
        shutil.copy(tmp / "streamlit.log", artifacts_dir() / "app-browser-streamlit.log")


@pytest.fixture(scope="module")
def driver():
    from selenium.webdriver.chrome.options import Options
    from selenium.webdriver.chrome.service import Service

    options = Options()
    options.binary_location = CHROMIUM
    for arg in (
        "--headless=new",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-dev-shm-usage",
        "--disable-background-networking",
        "--disable-component-update",
        "--no-first-run",
        "--disable-sync",
        "--window-size=1600,1000",
    ):
        options.add_argument(arg)
    browser = webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)
    browser.set_page_load_timeout(120)
    try:
        yield browser
    finally:
        browser.quit()


def wait_for(driver, predicate, timeout: float, what: str):
    from selenium.common.exceptions import StaleElementReferenceException, WebDriverException

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            value = predicate()
            if value:
                return value
        except (StaleElementReferenceException, WebDriverException):
            pass
        time.sleep(0.5)
    save_screenshot(driver, f"app-browser-timeout-{what.replace(' ', '-')}")
    raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")


def page_text(driver) -> str:
    return driver.find_element("tag name", "body").text


def save_screenshot(driver, name: str) -> Path:
    """A screenshot of the whole app: the window is grown to the height of the scrolled content."""
    height = driver.execute_script("return Math.max(...Array.from(document.querySelectorAll('*'), e => e.scrollHeight));")
    driver.set_window_size(1600, min(max(1000, int(height) + 200), 6000))  # room for the pinned chat input
    time.sleep(1.0)
    driver.execute_script("document.querySelectorAll('*').forEach(e => { if (e.scrollTop) e.scrollTop = 0; }); window.scrollTo(0, 0);")
    time.sleep(0.5)
    path = artifacts_dir() / f"{name}.png"
    driver.save_screenshot(str(path))
    driver.set_window_size(1600, 1000)
    return path


def click_text(driver, xpath_text: str, tag: str = "button") -> None:
    element = driver.find_element("xpath", f"//{tag}[contains(normalize-space(.), '{xpath_text}')]")
    driver.execute_script("arguments[0].scrollIntoView({block: 'center'});", element)
    driver.execute_script("arguments[0].click();", element)


def set_number(driver, label: str, value: int) -> None:
    from selenium.webdriver.common.keys import Keys

    box = driver.find_element("css selector", f"input[aria-label='{label}']")
    box.send_keys(Keys.CONTROL, "a")
    box.send_keys(str(value), Keys.ENTER)
    wait_for(driver, lambda: driver.find_element("css selector", f"input[aria-label='{label}']").get_attribute("value") == str(value), 30, f"{label} = {value}")


def test_upload_ask_side_by_side_and_screenshot(app_url, driver, tmp_path):
    from selenium.webdriver.common.keys import Keys

    driver.get(app_url)
    wait_for(driver, lambda: "Document QA" in page_text(driver), 180, "the app to render")
    wait_for(driver, lambda: "parameters" in page_text(driver), 300, "the model to load")

    # Upload two documents and two bad files in one go.
    (tmp_path / "empty.txt").write_bytes(b"")
    (tmp_path / "image.md").write_bytes(b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR" + bytes(range(256)))
    files = [CORPUS / "harbour-ferry.md", CORPUS / "public-library.md", tmp_path / "empty.txt", tmp_path / "image.md"]
    upload = wait_for(driver, lambda: driver.find_element("css selector", "input[type=file]"), 60, "the file input")
    upload.send_keys("\n".join(str(f) for f in files))
    wait_for(driver, lambda: "public-library.md" in page_text(driver), 60, "the files to be listed in the uploader")
    click_text(driver, "Add files")
    wait_for(driver, lambda: "2 skipped" in page_text(driver), 240, "the ingest summary")
    wait_for(driver, lambda: "Marrowick Public Library" in page_text(driver), 30, "the collection's documents table")
    text = page_text(driver)
    assert "2 files" in text and "empty file" in text and "binary file" in text
    assert "harbour-ferry.md" in text and "public-library.md" in text
    save_screenshot(driver, "app-browser-ingest")

    # Side by side: full cache vs SnapKV (budget 256, question-aligned window), short enough for a busy CPU.
    set_number(driver, "Context tokens to stuff", 600)
    set_number(driver, "Max new tokens", 24)
    toggle = driver.find_element("xpath", "//label[contains(normalize-space(.), 'Side by side with the full cache')]")
    toggle.click()
    wait_for(
        driver, lambda: driver.find_element("css selector", "input[aria-label='Side by side with the full cache']").is_selected(), 30, "the side-by-side toggle"
    )
    box = wait_for(driver, lambda: driver.find_element("css selector", "textarea[data-testid=stChatInputTextArea]"), 30, "the chat input")
    box.send_keys(QUESTION)
    box.send_keys(Keys.ENTER)
    wait_for(driver, lambda: "Citation agreement F1" in page_text(driver), 600, "both streamed answers")
    wait_for(driver, lambda: "What SnapKV kept of each stuffed document" in page_text(driver), 60, "the kept-entries picture")
    wait_for(
        driver, lambda: driver.find_elements("css selector", "[data-testid=stVegaLiteChart] canvas, [data-testid=stVegaLiteChart] svg"), 60, "the chart to draw"
    )
    text = page_text(driver)
    assert text.count("Sources") >= 2 or "No document supports" in text
    assert "Prefill" in text and "Time to first token" in text and "KV cache kept / full" in text

    # Open the first source of each answer: the cited chunk and its file.
    summaries = [s for s in driver.find_elements("css selector", "details summary") if " · chunk " in s.text]
    assert summaries, "no numbered source to open"
    for summary in summaries[:1] + summaries[len(summaries) // 2 : len(summaries) // 2 + 1]:
        driver.execute_script("arguments[0].click();", summary)  # the pinned chat input may cover it
    time.sleep(1.0)
    save_screenshot(driver, "app-browser-side-by-side")
    assert "File: " in page_text(driver)
    shot = save_screenshot(driver, "app-browser-side-by-side")
    assert shot.stat().st_size > 20_000
