"""The dashboard in a real headless Chromium (Debian's, driven by Selenium) against the live
server: the page asks for the API key, then shows a running request, its blocks turning from
free to in use, and once it ends its full blocks cached; and the simulator's replay file plays its
policies' runs. Screenshots go to the tests' temp dirs. Skipped, saying why, where no browser could
be installed (tools/install_browser.sh)."""

import shutil
import threading
import time

import openai
import pytest

from tests.live_server import API_KEY, MODEL

CHROMIUM, DRIVER = shutil.which("chromium"), shutil.which("chromedriver")


@pytest.fixture
def browser():
    webdriver = pytest.importorskip("selenium.webdriver", reason="selenium is not installed (make setup installs it)")
    if CHROMIUM is None or DRIVER is None:
        pytest.skip("no Chromium / chromedriver on this machine (tools/install_browser.sh installs them as root)")
    from selenium.webdriver.chrome.options import Options
    from selenium.webdriver.chrome.service import Service

    options = Options()
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--window-size=1300,900"):
        options.add_argument(arg)
    options.binary_location = CHROMIUM
    driver = webdriver.Chrome(options=options, service=Service(DRIVER))
    driver.set_page_load_timeout(120)
    yield driver
    driver.quit()


def wait_for(driver, what: str, condition, timeout_s: float = 180):
    """condition(driver) until truthy (returned), or fail naming `what` (deadline: 3x a slow start)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = condition(driver)
        if value:
            return value
        time.sleep(0.1)
    pytest.fail(f"waited {timeout_s:.0f} s for the dashboard to show {what}")


def cells(driver) -> str:
    return driver.find_element("id", "pool").get_attribute("data-cells") or ""


def test_the_page_shows_a_request_run_and_its_blocks_cached(browser, live_server, tmp_path):
    browser.get(f"{live_server.url}/dashboard")
    wait_for(browser, "the API key form", lambda d: d.find_element("id", "keyform").is_displayed())
    browser.find_element("id", "key").send_keys(API_KEY)
    browser.find_element("css selector", "#keyform button").click()
    wait_for(browser, "a live connection", lambda d: d.find_element("id", "status").text == "live")
    wait_for(browser, "the block pool", cells)

    client = openai.OpenAI(base_url=f"{live_server.url}/v1", api_key=API_KEY)
    prompt = "Write the numbers from one to two hundred in words, separated by commas: one, two, three, " * 3
    done = threading.Event()
    threading.Thread(target=lambda: (client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=200, temperature=0, extra_body={"ignore_eos": True}), done.set()),
        daemon=True).start()

    def running_row(d):
        rows = d.find_elements("css selector", "#requests tbody tr[data-status='running']")
        return [(r.get_attribute("data-blocks"), int(r.get_attribute("data-prompt"))) for r in rows
                if r.get_attribute("data-blocks")]

    blocks_text, num_prompt = wait_for(browser, "the request running", running_row)[0]
    blocks = [int(b) for b in blocks_text.split(",")]
    in_use = wait_for(browser, "its blocks in use", lambda d: (c := cells(d)) and all(c[b] in "us" for b in blocks) and c)
    assert len(blocks) >= 4 and "u" in in_use
    browser.save_screenshot(str(tmp_path / "dashboard-running.png"))
    assert done.wait(180), "the request did not finish"
    full = blocks[: num_prompt // 16]  # the blocks its prompt filled
    wait_for(browser, "the finished request's full blocks cached",
             lambda d: not running_row(d) and all(cells(d)[b] == "c" for b in full))
    browser.save_screenshot(str(tmp_path / "dashboard-after.png"))
    assert (tmp_path / "dashboard-after.png").stat().st_size > 10_000


def test_the_simulators_replay_plays_in_the_browser(browser, tmp_path):
    """`octavo simulate --dashboard FILE.html`: one file, opened without a server, plays each
    policy's run on the same page (static batching and reserved memory among them)."""
    import subprocess
    import sys

    from selenium.webdriver.support.ui import Select

    page = tmp_path / "replay.html"
    subprocess.run([sys.executable, "-m", "octavo.cli", "simulate", "--num-requests", "16", "--kv-tokens", "2048",
                    "--max-num-seqs", "8", "--dashboard", str(page)], check=True, capture_output=True, timeout=600)
    browser.get(page.as_uri())
    options = wait_for(browser, "the policies", lambda d: [o.text for o in d.find_elements("css selector", "#policy option")])
    assert "static batching" in options and "reserve max length" in options
    Select(browser.find_element("id", "policy")).select_by_visible_text("reserve max length")
    info = wait_for(browser, "a reserved-memory frame", lambda d: "blocks of 2048 tokens" in d.find_element("id", "poolinfo").text)
    assert info
    first = browser.find_element("id", "frameinfo").text
    wait_for(browser, "the replay advancing", lambda d: d.find_element("id", "frameinfo").text != first, timeout_s=30)
    browser.save_screenshot(str(tmp_path / "replay.png"))
