"""The dashboard (server/static/dashboard.html) in a real headless browser: it asks for the API key, draws the KV
pool block by block as /debug/kv describes it, shows a running request filling the pool, lists the requests and
draws the chosen one's timeline, and its figures equal the debug routes' JSON.

Needs Playwright (a dev dependency) and a Chromium: Debian's (``apt-get install chromium``, which ``.ci/run``
installs), or the one named by ``HARPOON_CHROMIUM``. ``HARPOON_DASHBOARD_SCREENSHOT=path.png`` saves what the
browser drew (the README's picture is made so)."""

from __future__ import annotations

import os
import shutil
import threading

import httpx
import pytest

from tests.server_process import ServerProcess

playwright_api = pytest.importorskip("playwright.sync_api")
CHROMIUM = os.environ.get("HARPOON_CHROMIUM") or shutil.which("chromium") or shutil.which("chromium-browser")
if CHROMIUM is None:
    pytest.skip("no Chromium to drive: apt-get install chromium, or set HARPOON_CHROMIUM", allow_module_level=True)

KEY = "dash"
AUTH = {"Authorization": f"Bearer {KEY}"}
POOL_BYTES = 48_000_000  # ~65 blocks of SmolLM2's 16 tokens in fp32: a map small enough to compare cell by cell


@pytest.fixture(scope="module")
def server():
    s = ServerProcess("--enable-debug-routes", "--api-key", KEY, "--kv-cache-memory", str(POOL_BYTES),
                      "--dtype", "float32")
    yield s
    s.stop_checking_the_engine_never_died()


@pytest.fixture(scope="module")
def page():
    with playwright_api.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox", "--disable-gpu"])
        yield browser.new_page(viewport={"width": 1400, "height": 1000})
        browser.close()


def debug(server: ServerProcess, path: str) -> dict:
    r = httpx.get(f"{server.base_url}{path}", headers=AUTH, timeout=30)
    assert r.status_code == 200, r.text
    return r.json()


def polls(page) -> int:
    return int(page.evaluate("document.body.dataset.polls || 0"))


def wait_polls(page, n: int = 2) -> None:
    """Until the page has finished ``n`` more polls (each reads every route once)."""
    target = polls(page) + n
    page.wait_for_function(f"Number(document.body.dataset.polls || 0) >= {target}", timeout=30_000)


def complete(server: ServerProcess, prompt: str, max_tokens: int) -> dict:
    r = httpx.post(f"{server.base_url}/v1/completions", headers=AUTH, timeout=120,
                   json={"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True})
    assert r.status_code == 200, r.text
    return r.json()


def test_the_dashboard_draws_the_pool_the_queue_and_a_timeline_as_the_json_says(server, page):
    shared = "Harpoon serves language models to many users at once, and this prompt is long enough to fill blocks. "
    for i in range(3):  # the same long prefix thrice: its blocks are cached and then reused
        complete(server, shared + f"Question {i}:", max_tokens=4 + 4 * i)
    complete(server, "A short one", max_tokens=40)

    assert httpx.get(f"{server.base_url}/debug/stats").status_code == 401  # the data needs the key, the page not
    page.goto(f"{server.base_url}/dashboard")
    page.wait_for_selector("#key-form", state="visible", timeout=30_000)  # the routes answered 401: the key is asked
    page.fill("#key", KEY)
    page.click("#key-form button")
    wait_polls(page, 2)

    # Idle now, so the page's last poll and this read agree block for block.
    kv = debug(server, "/debug/kv")
    cells = page.eval_on_selector_all("#pool rect", "rs => rs.map(r => r.dataset.state).join('')")
    assert len(cells) == kv["num_blocks"] and cells == kv["block_states"]
    assert "c" in cells  # the shared prefix's blocks, free but cached
    for card, key in [("free-blocks", "free_blocks"), ("used-blocks", "used_blocks"),
                      ("cached-blocks", "cached_evictable_blocks"), ("empty-slots", "empty_slots")]:
        assert page.text_content(f"#{card}") == str(kv[key]), card
    assert page.text_content("#hit-rate") == f"{100 * kv['prefix_cache_hit_rate']:.1f}%"
    assert kv["prefix_cache_hit_rate"] > 0
    stats = debug(server, "/debug/stats")
    assert page.text_content("#num-running") == "0" and page.text_content("#num-waiting") == "0"
    assert stats["model"] in page.text_content("#model")

    # The requests, newest first, the slowest chosen, and its timeline drawn from its events.
    recent = debug(server, "/debug/requests")["requests"]
    ids = page.eval_on_selector_all("#requests tbody tr", "rs => rs.map(r => r.dataset.id)")
    assert ids == [r["request_id"] for r in recent] and len(ids) == 4  # the start-up's warm-up is not kept
    slowest = max(recent, key=lambda r: r["e2e_s"])
    assert page.get_attribute("#requests tr.slow", "data-id") == slowest["request_id"]
    page.wait_for_function("document.querySelectorAll('#gantt rect.segment').length >= 2", timeout=10_000)
    kinds = page.eval_on_selector_all("#gantt rect.segment", "rs => rs.map(r => r.dataset.kind)")
    assert kinds[0] == "queued" and any(k.startswith("prompt chunk") for k in kinds)
    assert any("decode steps" in k for k in kinds)
    timeline = debug(server, f"/debug/requests/{slowest['request_id']}")
    rows = page.eval_on_selector_all("#events tbody tr", "rs => rs.length")
    assert rows == sum(len(s["events"]) for s in timeline["samples"])

    # Choosing another request draws its story instead.
    other = recent[-1]["request_id"]
    page.click(f"#requests tr[data-id='{other}']")
    page.wait_for_function(f"document.getElementById('timeline-caption').textContent.startsWith('{other}')",
                           timeout=10_000)

    # A request running now: the page shows it and the blocks it holds.
    started, seen = threading.Event(), threading.Event()

    def long_stream() -> None:  # most of the pool; the client leaves once the page has been checked
        with httpx.stream("POST", f"{server.base_url}/v1/completions", headers=AUTH, timeout=300,
                          json={"prompt": "Count slowly:", "max_tokens": 900, "ignore_eos": True,
                                "stream": True}) as s:
            for _ in s.iter_lines():
                started.set()
                if seen.is_set():
                    break

    worker = threading.Thread(target=long_stream)
    worker.start()
    try:
        assert started.wait(60)
        page.wait_for_function("document.getElementById('num-running').textContent === '1'", timeout=30_000)
        held = page.eval_on_selector_all("#pool rect[data-state='u']", "rs => rs.length")
        assert held >= 1
        assert page.text_content("#requests tbody tr:first-child td:last-child") == "running"
        assert all(r["state"] == "finished" for r in recent)
        memory = page.eval_on_selector_all("#memory tbody tr td:first-child", "tds => tds.map(t => t.textContent)")
        assert memory[:4] == ["runtime", "weights", "kv_pool", "workspace"] and "remainder" in memory
        if os.environ.get("HARPOON_DASHBOARD_SCREENSHOT"):
            page.screenshot(path=os.environ["HARPOON_DASHBOARD_SCREENSHOT"], full_page=True)
    finally:
        seen.set()
        worker.join(300)
