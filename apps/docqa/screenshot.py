"""Make the docs screenshot (docs/app.md): the sample corpus, one question side by side, sources open.

    python apps/docqa/screenshot.py [--out docs/app-side-by-side.png] [--question "..."]

Starts the app headless on a free loopback port with a throwaway store, drives Debian's
chromium with Selenium (as tests/test_app_browser.py does) and saves a full-page PNG.
"""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=str(ROOT / "docs" / "app-side-by-side.png"))
    p.add_argument("--question", default="How much does an adult single ferry ticket cost?")
    p.add_argument("--context-tokens", type=int, default=1024)
    p.add_argument("--max-new-tokens", type=int, default=48)
    p.add_argument("--budget", type=int, default=256)
    args = p.parse_args()

    from selenium import webdriver
    from selenium.webdriver.chrome.options import Options
    from selenium.webdriver.chrome.service import Service
    from selenium.webdriver.common.keys import Keys

    tmp = Path(tempfile.mkdtemp(prefix="docqa-shot-"))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "PYTHONPATH": str(ROOT)}
    server = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "streamlit",
            "run",
            str(ROOT / "apps" / "docqa" / "app.py"),
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
            "marrowick",
        ],
        cwd=ROOT,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    options = Options()
    options.binary_location = "/usr/bin/chromium"
    for a in (
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
        options.add_argument(a)
    driver = None
    try:
        url = f"http://127.0.0.1:{port}"
        for _ in range(240):
            try:
                if urllib.request.urlopen(f"{url}/_stcore/health", timeout=2).status == 200:
                    break
            except OSError:
                time.sleep(0.5)
        driver = webdriver.Chrome(service=Service("/usr/bin/chromedriver"), options=options)
        driver.get(url)

        def text() -> str:
            return driver.find_element("tag name", "body").text

        def until(pred, timeout=600):
            end = time.monotonic() + timeout
            while time.monotonic() < end:
                try:
                    if pred():
                        return
                except Exception:
                    pass
                time.sleep(0.5)
            raise TimeoutError("the app did not get there in time")

        def number(label: str, value: int) -> None:
            box = driver.find_element("css selector", f"input[aria-label='{label}']")
            box.send_keys(Keys.CONTROL, "a")
            box.send_keys(str(value), Keys.ENTER)
            until(lambda: driver.find_element("css selector", f"input[aria-label='{label}']").get_attribute("value") == str(value), 30)

        until(lambda: "parameters" in text(), 300)
        folder = "input[aria-label='Or a folder on this machine']"
        until(lambda: driver.find_elements("css selector", folder), 120)
        driver.find_element("css selector", folder).send_keys(str(ROOT / "examples" / "sample_corpus"))
        button = driver.find_element("xpath", "//button[contains(normalize-space(.), 'Add folder')]")
        driver.execute_script("arguments[0].click();", button)
        until(lambda: "files (" in text() and "skipped" in text(), 600)
        number("Context tokens to stuff", args.context_tokens)
        number("Max new tokens", args.max_new_tokens)
        number("KV budget (entries per layer and head)", args.budget)
        driver.find_element("xpath", "//label[contains(normalize-space(.), 'Side by side with the full cache')]").click()
        until(lambda: driver.find_element("css selector", "input[aria-label='Side by side with the full cache']").is_selected(), 60)
        chat = "textarea[data-testid=stChatInputTextArea]"
        until(lambda: driver.find_elements("css selector", chat), 60)
        driver.find_element("css selector", chat).send_keys(args.question, Keys.ENTER)
        until(lambda: "Citation agreement F1" in text() and "kept of each stuffed document" in text(), 1200)
        until(lambda: driver.find_elements("css selector", "[data-testid=stVegaLiteChart] canvas, [data-testid=stVegaLiteChart] svg"), 60)
        sources = [s for s in driver.find_elements("css selector", "details summary") if " · chunk " in s.text]
        for s in sources[:1] + sources[len(sources) // 2 : len(sources) // 2 + 1]:
            driver.execute_script("arguments[0].click();", s)
        # Collapse the documents panel so the answer is the focus.
        panel = driver.find_element("xpath", "//details[.//summary[contains(normalize-space(.), 'Documents in')]]")
        if panel.get_attribute("open") is not None:
            driver.execute_script("arguments[0].click();", panel.find_element("css selector", "summary"))
        time.sleep(1.5)
        height = driver.execute_script("return Math.max(...Array.from(document.querySelectorAll('*'), e => e.scrollHeight));")
        driver.set_window_size(1600, min(int(height) + 200, 6000))  # room for the pinned chat input
        time.sleep(1.5)
        driver.execute_script("document.querySelectorAll('*').forEach(e => { if (e.scrollTop) e.scrollTop = 0; }); window.scrollTo(0, 0);")
        time.sleep(0.5)
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        driver.save_screenshot(args.out)
        print(args.out)
        return 0
    finally:
        if driver is not None:
            driver.quit()
        server.terminate()
        server.wait(timeout=30)


if __name__ == "__main__":
    sys.exit(main())
