"""The README's picture of the dashboard: a server, a shared-prefix run (a few long system prompts,
several questions on each, all at once), the page in headless Chromium with one request hovered
(its blocks outlined, its block table listed), saved as a small palette PNG.

    .venv/bin/python tools/dashboard_screenshot.py docs/dashboard.png

Needs Chromium and chromedriver (tools/install_browser.sh) and selenium (the test extras).
"""

from __future__ import annotations

import argparse
import os
import shutil
import threading
import time

import httpx
from dashboard_memory import start_server  # tools/ is the script's folder, first on sys.path

SYSTEMS = [
    "You are a patient maths tutor. Explain each step, check the arithmetic twice, and end with a short summary. ",
    "You are a travel planner for trains in Europe. Prefer night trains, list changes and give times in local time. ",
    "You are a code reviewer for Python. Point out bugs first, then style, and suggest the smallest fix for each. ",
    "You are a chef who cooks with what is in season. Give quantities in grams and keep every recipe under an hour. ",
]
QUESTIONS = ["What should I do first?", "Give me three ideas.", "What is the most common mistake?"]


def browser():
    from selenium import webdriver
    from selenium.webdriver.chrome.options import Options
    from selenium.webdriver.chrome.service import Service

    options = Options()
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--window-size=1300,940"):
        options.add_argument(arg)
    options.binary_location = shutil.which("chromium")
    return webdriver.Chrome(options=options, service=Service(shutil.which("chromedriver")))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", help="PNG to write")
    ap.add_argument("--colours", type=int, default=96, help="palette size of the PNG (smaller file)")
    args = ap.parse_args()
    from PIL import Image
    from selenium.webdriver.common.action_chains import ActionChains

    server, url = start_server(["--kv-cache-memory", "160MiB", "--max-model-len", "1024"], num_threads=1)
    driver = browser()
    try:
        driver.get(f"{url}/dashboard")
        # warm the cache with each system prompt once, so that the run shows prefix hits
        for system in SYSTEMS:
            httpx.post(f"{url}/v1/completions", json={"prompt": system * 6, "max_tokens": 1}, timeout=300)
        body = lambda s, q: {"prompt": s * 6 + q, "max_tokens": 600, "temperature": 0, "ignore_eos": True}  # noqa: E731
        for system in SYSTEMS:
            for question in QUESTIONS:
                threading.Thread(target=httpx.post, args=(f"{url}/v1/completions",),
                                 kwargs={"json": body(system, question), "timeout": 600}, daemon=True).start()
        deadline = time.monotonic() + 300
        while len(driver.find_elements("css selector", "#requests tbody tr[data-status='running']")) < 8:
            if time.monotonic() > deadline:
                raise SystemExit("8 requests never ran at once within 300 s")
            time.sleep(0.2)
        time.sleep(2)  # a few decode steps into the run
        rows = driver.find_elements("css selector", "#requests tbody tr[data-status='running']")
        ActionChains(driver).move_to_element(rows[1]).click().perform()  # keep one request selected
        time.sleep(1.5)
        driver.save_screenshot(args.out)
    finally:
        driver.quit()
        server.terminate()
        server.wait(60)
    image = Image.open(args.out).convert("RGB")
    image.quantize(colors=args.colours, method=Image.Quantize.MEDIANCUT).save(args.out, optimize=True)
    print(f"{args.out}: {image.width} x {image.height}, {os.path.getsize(args.out) / 1024:.0f} KiB")


if __name__ == "__main__":
    main()
