"""The timeline page in a real headless browser (Debian's chromium, driven by Playwright) against
a real gateway in front of three real simulated engines that move KV over the NixlConnector legs.

Screenshots are saved as test artifacts under $KVGATE_ARTIFACTS (default: test-artifacts/ at the
repository root). A missing chromium fails these tests: it is a CI dependency (.ci/run installs
it), not an optional one.
"""

from __future__ import annotations

import json
import os
import time
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from kvgate.procs import Child, free_port, spawn, wait_healthy
from tests.conftest import MODEL

CHROMIUM = Path("/usr/bin/chromium")
SYSTEM = "You are a careful researcher who cites sources and checks every figure twice. " * 60
CONNECTOR = json.dumps({"kv_connector": "NixlConnector", "kv_role": "kv_both"})
WORKERS = 5


def _playwright() -> Any:
    """The Playwright sync API; its absence fails the test (it is in the dev extra)."""
    try:
        from playwright import sync_api
    except ImportError as e:
        pytest.fail(f"playwright is not installed (pip install -e '.[dev]'): {e}")
    return sync_api


def artifacts_dir() -> Path:
    path = Path(os.environ.get("KVGATE_ARTIFACTS")
                or Path(__file__).resolve().parent.parent / "test-artifacts")
    path.mkdir(parents=True, exist_ok=True)
    return path


@pytest.fixture(scope="module")
def pool(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Child]:
    """A gateway (policy kvgate, RDMA link, KV events) in front of four simulated engines (the
    setup of test_kv_moves_live.py, where a fan-out's parent is prefetched to its children)."""
    logs = tmp_path_factory.mktemp("ui-browser")
    events = free_port()
    sim_ports = [free_port() for _ in range(4)]
    sims: list[Child] = []
    gateway = None
    try:
        # The gateway first, so it binds the KV-event port at once (the engines' PUBs connect
        # and retry until it does): a CI run saw that port taken while four engines started.
        port = free_port()
        config = {"host": "127.0.0.1", "port": port, "policy": "kvgate",
                  "kv_events_bind": f"tcp://127.0.0.1:{events}", "scrape_interval_s": 0.2,
                  "health_interval_s": 0.5, "kv_transfer": {"link": "rdma"},
                  "engines": [{"url": f"http://127.0.0.1:{p}"} for p in sim_ports]}
        path = logs / "gateway.yaml"
        path.write_text(yaml.safe_dump(config))
        gateway = spawn("gateway", ["serve", "--config", str(path)],
                        f"http://127.0.0.1:{port}", logs)
        for i, sim_port in enumerate(sim_ports):
            sims.append(spawn(f"sim-{i}", [
                "sim", "--host", "127.0.0.1", "--port", str(sim_port), "--model", MODEL,
                "--seed", str(i), "--kv-events", f"tcp://127.0.0.1:{events}",
                "--kv-transfer-config", CONNECTOR, "--kv-link", "rdma",
                "--enable-prompt-tokens-details"], f"http://127.0.0.1:{sim_port}", logs))
        for sim in sims:
            wait_healthy(sim)
        wait_healthy(gateway)
        yield gateway
    finally:
        if gateway is not None:
            gateway.stop()
        for sim in sims:
            sim.stop()


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    if not CHROMIUM.is_file():
        pytest.fail(f"{CHROMIUM} is missing (apt-get install -y chromium); the timeline page "
                    "is tested in a real browser")
    sync_api = _playwright()
    with sync_api.sync_playwright() as p:
        b = p.chromium.launch(executable_path=str(CHROMIUM), headless=True)
        yield b
        b.close()


@pytest.fixture
def page(browser: Any) -> Iterator[Any]:
    context = browser.new_context(viewport={"width": 1400, "height": 900})
    pg = context.new_page()
    errors: list[str] = []
    pg.on("pageerror", lambda e: errors.append(str(e)))
    # A 404 from the API is a page state the tests ask for (an unknown workflow); one for the
    # page's own files is a bug.
    pg.on("console", lambda m: errors.append(m.text)
          if m.type == "error" and not m.text.startswith("Failed to load resource") else None)
    pg.on("response", lambda r: errors.append(f"{r.status} {r.url}")
          if r.status >= 400 and urllib.parse.urlsplit(r.url).path.startswith("/ui") else None)
    yield pg
    context.close()
    assert not errors, errors


def post(url: str, body: Any) -> Any:
    req = urllib.request.Request(url, data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as r:
        return json.loads(r.read())


def get(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=60) as r:
        return json.loads(r.read())


def wait_over(url: str, wf_id: str, timeout: float = 90) -> Any:
    deadline = time.monotonic() + timeout
    snap = get(f"{url}/v1/workflows/{wf_id}")
    while snap["state"] == "running":
        assert time.monotonic() < deadline, snap
        time.sleep(0.1)
        snap = get(f"{url}/v1/workflows/{wf_id}")
    return snap


def fanout(name: str, think_s: float = 0.0) -> dict[str, Any]:
    """plan -> WORKERS workers that extend the plan's conversation -> reduce."""
    head = [{"segment": "sys"}, {"role": "user", "content": "Plan the survey in steps."}]
    workers = [{"id": f"w{i}", "after": ["plan"], "output_tokens": 12 + 6 * i,
                "think_time_s": think_s * (i + 1),
                "messages": [*head, {"output_of": "plan"},
                             {"role": "user", "content": f"Now do step {i}."}]}
               for i in range(WORKERS)]
    return {
        "id": name, "model": MODEL,
        "segments": {"sys": {"kind": "static", "content": SYSTEM}},
        "tasks": [
            {"id": "plan", "output_tokens": 32, "messages": head},
            *workers,
            {"id": "reduce", "output_tokens": 16, "think_time_s": think_s,
             "messages": [{"segment": "sys"}, *({"output_of": w["id"]} for w in workers)]},
        ],
    }


def test_a_finished_fanout_shows_one_bar_per_task_and_one_lane_per_engine(
        pool: Child, page: Any) -> None:
    snap = wait_over(pool.url, post(f"{pool.url}/v1/workflows", fanout("browser-fanout"))["id"])
    assert snap["state"] == "done", snap
    tasks = snap["tasks"]
    moves = [m for t in tasks.values() for m in t.get("kv_moves", [])]
    engines = {t["engine"] for t in tasks.values()}
    engines |= {e for m in moves for e in (m.get("source"), m["destination"]) if e}

    # The list shows it; a click opens its chart.
    page.goto(f"{pool.url}/ui/")
    row = page.locator(f'tr[data-workflow="{snap["id"]}"]')
    row.wait_for()
    assert row.locator(".badge").inner_text() == "done"
    row.locator("a").click()
    page.wait_for_function("n => document.querySelectorAll('g.task').length === n",
                           arg=len(tasks))
    assert page.url.endswith(f"#/workflow/{urllib.parse.quote(snap['id'])}")

    assert page.locator("g.task").count() == len(tasks)
    assert page.locator('g.task[data-state="done"]').count() == len(tasks)
    assert page.locator("g.task.ghost").count() == 0
    lanes = page.locator('g.lane[data-kind="engine"]')
    assert lanes.count() == len(engines)
    assert {lanes.nth(i).get_attribute("data-engine") for i in range(lanes.count())} == engines
    assert page.locator('g.lane[data-kind="unplaced"]').count() == 0
    # Every recorded KV move is drawn between lanes; no finished workflow shows a "now" line.
    assert moves, tasks["plan"]
    assert page.locator("g.move").count() == len(moves)
    assert page.locator('g.move[data-kind="transfer"]').count() == sum(
        m["kind"] == "transfer" for m in moves)
    assert page.locator("g.now").count() == 0
    assert page.locator("#live").is_hidden()

    # The marks drawn on a bar (first token, cached share) let the pointer through to it, so
    # the bar is what the pointer finds even where a mark lies over its middle.
    marked = page.evaluate("""() => [...document.querySelectorAll('g.task line.ttft')].map(l => {
        const r = l.getBoundingClientRect();
        const at = document.elementFromPoint(r.x + r.width / 2, r.y + r.height / 2);
        return at && at.classList.contains('bar');
    })""")
    assert marked and all(marked), marked
    # Hovering a worker's bar shows its timings and cache numbers.
    worker = tasks["w1"]
    page.locator('g.task[data-task="w1"] rect.bar').hover()
    tip = page.locator("#tooltip")
    tip.wait_for(state="visible")
    text = tip.inner_text()
    assert "w1" in text and worker["engine"] in text
    assert "cached tokens" in text and f"{worker['cached_tokens']:,}" in text
    assert f"{worker['prompt_tokens']:,}" in text
    hit = 100 * worker["cached_tokens"] / worker["prompt_tokens"]
    assert f"cache hit\n{hit:.1f} %" in text or f"cache hit\t{hit:.1f} %" in text, text
    assert "wait" in text and "duration" in text
    # The planner's decision, read from the gateway's trace store: the engine it chose with its
    # estimate, and the engines it weighed against it.
    spans = get(f"{pool.url}/v1/workflows/{snap['id']}/trace")["spans"]
    call = next(sp for sp in spans if sp["name"].startswith("chat")
                and sp["attributes"].get("kvgate.task.id") == "w1")
    placement = next(sp for sp in spans if sp["name"] == "placement"
                     and sp["parent_span_id"] == call["span_id"])
    runners_up = placement["attributes"]["kvgate.placement.runner_up.engines"]
    assert runners_up and worker["engine"] not in runners_up
    assert f"placed at (estimate)\n{worker['engine']} " in text.replace("\t", "\n"), text
    assert "runners-up" in text and all(e in text for e in runners_up), text
    page.screenshot(path=str(artifacts_dir() / "timeline-fanout.png"), full_page=True)
    page.mouse.move(2, 2)
    tip.wait_for(state="hidden")

    # Hovering a move's landing mark shows what was moved, where, and why.
    page.locator("g.move rect.span").first.hover(force=True)
    tip.wait_for(state="visible")
    text = tip.inner_text()
    assert "KV transfer" in text or "Warm-up" in text, text
    assert any(m["reason"] in text and m["destination"] in text for m in moves), text


def test_a_deep_link_opens_the_workflow(pool: Child, page: Any) -> None:
    snap = wait_over(pool.url, post(f"{pool.url}/v1/workflows", fanout("browser-link"))["id"])
    page.goto(f"{pool.url}/ui?workflow={urllib.parse.quote(snap['id'])}")
    page.wait_for_function("n => document.querySelectorAll('g.task').length === n",
                           arg=len(snap["tasks"]))
    assert page.url.endswith(f"/ui/#/workflow/{urllib.parse.quote(snap['id'])}")
    assert snap["id"] in page.locator(".summary h1").inner_text()
    # A workflow that does not exist says so.
    page.goto(f"{pool.url}/ui/#/workflow/no-such-workflow")
    page.locator(".error-box").wait_for()
    assert "unknown or expired" in page.locator(".error-box").inner_text()


def test_a_running_workflow_fills_in_live(pool: Child, page: Any) -> None:
    wf_id = post(f"{pool.url}/v1/workflows", fanout("browser-live", think_s=0.6))["id"]
    reads: list[str] = []
    page.on("request", lambda r: reads.append(urllib.parse.urlsplit(r.url).path)
            if "/v1/workflows/" in r.url else None)
    page.goto(f"{pool.url}/ui/#/workflow/{urllib.parse.quote(wf_id)}")
    page.locator("g.task").first.wait_for()
    total = page.locator("g.task").count()
    assert total == WORKERS + 2
    seen: list[int] = []
    saw_live = False
    shot = False
    deadline = time.monotonic() + 90
    while True:
        placed = page.locator('g.task[data-state="done"]').count()
        if not seen or placed != seen[-1]:
            seen.append(placed)
        running = get(f"{pool.url}/v1/workflows/{wf_id}")["state"] == "running"
        if running and page.locator("g.now").count():
            saw_live = saw_live or page.locator("#live").is_visible()
            if not shot and 0 < placed < total:
                page.screenshot(path=str(artifacts_dir() / "timeline-live.png"), full_page=True)
                shot = True
        if not running and placed == total:
            break
        assert time.monotonic() < deadline, seen
        time.sleep(0.1)
    # Bars turned done one after another while the page stayed open, without a reload.
    assert seen[0] < total and seen[-1] == total, seen
    assert len(seen) >= 3, seen
    assert saw_live and shot
    page.locator("#live").wait_for(state="hidden")
    page.wait_for_function("() => document.querySelectorAll('g.now').length === 0")
    # The snapshot is read every second; the trace (placements, which do not change once
    # made) only as more tasks are placed, at most every 5 s, and once at the end.
    snapshots = reads.count(f"/v1/workflows/{wf_id}")
    traces = reads.count(f"/v1/workflows/{wf_id}/trace")
    assert 1 <= traces <= 2 + snapshots // 5 and traces < snapshots, (snapshots, traces)


def test_the_last_tasks_placement_is_shown_on_a_page_left_open(pool: Child, page: Any) -> None:
    """A call's placement is in the trace once the call ends. The page reads the trace as
    tasks are placed (at most every 5 s): `long`, placed more than 5 s in, is read while it
    runs, so its placement shows only if the page reads the trace once more at the end."""
    head = [{"role": "user", "content": "Plan the survey in steps."}]
    wf_id = post(f"{pool.url}/v1/workflows", {"id": "browser-last", "model": MODEL, "tasks": [
        {"id": "plan", "output_tokens": 4, "messages": head},
        {"id": "long", "after": ["plan"], "output_tokens": 150, "think_time_s": 5.5,
         "messages": [*head, {"output_of": "plan"}]}]})["id"]
    page.goto(f"{pool.url}/ui/#/workflow/{urllib.parse.quote(wf_id)}")
    page.locator("g.task").first.wait_for()
    snap = wait_over(pool.url, wf_id)
    page.locator("#live").wait_for(state="hidden")
    page.locator('g.task[data-task="long"] rect.bar').hover()
    tip = page.locator("#tooltip")
    tip.wait_for(state="visible")
    engine = snap["tasks"]["long"]["engine"]
    page.wait_for_function(
        "e => document.querySelector('#tooltip').innerText.includes('placed at')", arg=engine,
        timeout=5000)
    assert f"placed at (estimate)\n{engine} " in tip.inner_text().replace("\t", "\n")


def test_a_hint_mode_workflow_keeps_filling_in_between_its_agents_calls(
        pool: Child, page: Any) -> None:
    """A hint-mode workflow reads "done" while its agent thinks between calls: the open page
    still shows the calls that come after."""
    def ask(task: str) -> None:
        post(f"{pool.url}/v1/chat/completions", {
            "model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": task}],
            "kvgate": {"workflow": "browser-agent", "task": task}})

    ask("think")
    page.goto(f"{pool.url}/ui/#/workflow/browser-agent")
    page.locator('g.task[data-task="think"]').wait_for()
    assert get(f"{pool.url}/v1/workflows/browser-agent")["state"] == "done"
    time.sleep(1.5)  # the page has read "done" at least once
    ask("act")
    page.locator('g.task[data-task="act"]').wait_for(timeout=20_000)
    assert page.locator("g.task").count() == 2


def test_workflow_text_is_shown_as_text_never_run(pool: Child, page: Any) -> None:
    """Hint-mode ids are any string: markup in them must reach the page as plain text."""
    workflow = 'xss-"><img src=x onerror="window.__xss=1">'
    task = "<script>window.__xss=2</script><b>bold</b>"
    body = {"model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}],
            "kvgate": {"workflow": workflow, "task": task}}
    post(f"{pool.url}/v1/chat/completions", body)
    page.goto(f"{pool.url}/ui/")
    row = page.locator("tr.row-link", has_text=workflow)
    row.wait_for()
    row.locator("a").click()
    page.locator("g.task").first.wait_for()
    assert page.locator("g.task").get_attribute("data-task") == task
    assert task in page.locator("table.grid").inner_text()
    assert workflow in page.locator(".summary h1").inner_text()
    page.locator("g.task rect.bar").hover()
    page.locator("#tooltip").wait_for(state="visible")
    assert task in page.locator("#tooltip").inner_text()
    assert page.evaluate("() => window.__xss") is None
    assert page.locator("img[src='x'], b:text('bold')").count() == 0
