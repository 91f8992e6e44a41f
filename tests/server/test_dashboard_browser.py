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
    """condition(driver) until truthy (returned), or fail naming `what` (deadline: 3x a slow start).
    The page redraws its rows 4 times a second: an element gone stale meanwhile means try again."""
    from selenium.common.exceptions import StaleElementReferenceException

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            value = condition(driver)
        except StaleElementReferenceException:
            value = None
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
        model=MODEL, prompt=prompt, max_tokens=320, temperature=0, extra_body={"ignore_eos": True}), done.set()),
        daemon=True).start()

    def running_row(d):
        rows = d.find_elements("css selector", "#requests tbody tr[data-status='running']")
        return [(r.get_attribute("data-blocks"), int(r.get_attribute("data-prompt"))) for r in rows
                if r.get_attribute("data-blocks")]

    blocks_text, num_prompt = wait_for(browser, "the request running", running_row)[0]
    blocks = [int(b) for b in blocks_text.split(",")]
    in_use = wait_for(browser, "its blocks in use", lambda d: (c := cells(d)) and all(c[b] in "us" for b in blocks) and c)
    assert len(blocks) >= 4 and "u" in in_use
    # hovering over the request outlines its blocks in the pool and lists its block table
    from selenium.webdriver.common.action_chains import ActionChains

    wait_for(browser, "the pointer over the running request", lambda d: ActionChains(d).move_to_element(
        d.find_element("css selector", "#requests tbody tr[data-status='running']")).perform() or True)

    def outlined(d):
        rows = d.find_elements("css selector", "#requests tbody tr[data-status='running']")
        if not rows:
            return None
        held = sorted(int(b) for b in rows[0].get_attribute("data-blocks").split(","))
        return d.find_element("id", "pool").get_attribute("data-highlight") == ",".join(map(str, held)) and held
    assert set(blocks) <= set(wait_for(browser, "the hovered request's blocks outlined", outlined))
    table = wait_for(browser, "its block table", lambda d: d.find_element("css selector", "#tablepanel .strip")
                     .get_attribute("data-ids")).split(",")
    assert table[: len(blocks)] == [str(b) for b in blocks]
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


def windows_and_tier_frames():
    """Frames of a model with a global and a sliding-window KV group (window 5, blocks of 4) and a
    second tier, from the real scheduler and block manager (no model): the window gives blocks
    back as the request decodes; tier slots written, ready and being read."""
    from octavo.config import SchedulerConfig
    from octavo.dashboard.replay import ReplayRecorder
    from octavo.kv_cache.manager import KVCacheManager
    from octavo.kv_cache.tier import TierIndex
    from octavo.outputs import ModelRunnerOutput
    from octavo.scheduler import Scheduler
    from tests.helpers import make_request

    cfg = SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=4, max_model_len=64, admission_headroom_steps=0)
    tier = TierIndex(10)
    s = Scheduler(cfg, KVCacheManager(24, 4, group_windows=(None, 5), tier=tier))
    keys = [(0, bytes([i])) for i in range(4)]
    slots = [tier.reserve(k) for k in keys]
    for slot in slots[:3]:
        tier.commit(slot, True)
    tier.pin(keys[0])  # "lrrw......"
    s.add_request(make_request("w", list(range(12)), max_tokens=12))
    recorder = ReplayRecorder()
    for i in range(10):
        out = s.schedule()
        s.update(out, ModelRunnerOutput(tokens={sid: [7] for e in out.scheduled for sid in e.sample_ids}))
        recorder(s, out, 0.05 * (i + 1), 0.05)
    return recorder.frames


def test_window_groups_tier_and_block_tables_in_the_browser(browser, tmp_path):
    """A request's block table per KV group (the window's given-back entries hatched), its blocks
    outlined in the pool on hover, blocks just given back by the window marked, the tier's slots."""
    from selenium.webdriver.common.action_chains import ActionChains

    from octavo.dashboard.replay import replay_html

    frames = windows_and_tier_frames()
    totals = [f["pool"]["window_freed"]["total"] for f in frames]
    k = next(i for i in range(1, len(frames)) if totals[i] > totals[i - 1])  # a step where the window gave back blocks
    page = tmp_path / "windows.html"
    page.write_text(replay_html({"windows": frames}, "sliding windows and a tier"))
    browser.get(page.as_uri())
    wait_for(browser, "the replay", lambda d: cells(d))
    browser.find_element("id", "play").click()  # pause: the test moves the slider itself

    def show(index):
        browser.execute_script("const s = document.getElementById('frame'); s.value = arguments[0];"
                               "s.dispatchEvent(new Event('input'));", index)

    show(k - 1)
    show(k)
    fresh = frames[k]["pool"]["window_freed"]["recent"][-(totals[k] - totals[k - 1]):]
    assert browser.find_element("id", "pool").get_attribute("data-window-freed") == ",".join(map(str, fresh))
    assert browser.find_element("id", "tier").get_attribute("data-cells") == "lrrw......" == frames[k]["tier"]["cells"]
    assert browser.find_element("id", "tiersection").is_displayed()

    row = browser.find_element("css selector", "#requests tbody tr[data-seq='w']")
    ActionChains(browser).move_to_element(row).perform()
    (request,) = frames[k]["running"]
    held = sorted({b for t in request["tables"] for b in t["ids"] if b is not None})
    wait_for(browser, "the request's blocks outlined",
             lambda d: d.find_element("id", "pool").get_attribute("data-highlight") == ",".join(map(str, held)))
    assert browser.find_element("id", "tablepanel").get_attribute("data-seq") == "w"
    strips = [s.get_attribute("data-ids") for s in browser.find_elements("css selector", "#tablepanel .strip")]
    expected = [",".join("-" if b is None else str(b) for b in t["ids"]) for t in request["tables"]]
    assert strips == expected and "-" not in strips[0] and strips[1].startswith("-,")
    browser.save_screenshot(str(tmp_path / "windows.png"))
