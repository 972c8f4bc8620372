"""The timeline page's files and the workflow listing, over real sockets to a real gateway
(`kvgate serve` in front of two `kvgate sim` engines); the browser test is test_ui_browser.py."""

from __future__ import annotations

import asyncio
import http.client
import json
import re
import time
import urllib.error
import urllib.parse
import urllib.request
from typing import Any

import pytest

from kvgate.demo import run_workflow
from kvgate.procs import Child
from tests.conftest import MODEL


def fetch(url: str, path: str) -> tuple[int, dict[str, str], bytes]:
    """GET `path` exactly as written (no client-side normalisation of `..` or escapes)."""
    parts = urllib.parse.urlsplit(url)
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=30)
    try:
        conn.request("GET", path)
        resp = conn.getresponse()
        return resp.status, {k.lower(): v for k, v in resp.getheaders()}, resp.read()
    finally:
        conn.close()


def submit(url: str, spec: dict[str, Any]) -> dict[str, Any]:
    req = urllib.request.Request(f"{url}/v1/workflows", data=json.dumps(spec).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as r:
        doc: dict[str, Any] = json.loads(r.read())
        return doc


def small_workflow(name: str) -> dict[str, Any]:
    ask = [{"role": "user", "content": "Say something."}]
    return {"id": name, "model": MODEL, "tasks": [
        {"id": "a", "output_tokens": 4, "messages": ask},
        {"id": "b", "after": ["a"], "output_tokens": 4, "messages": ask}]}


def wait_over(url: str, wf_id: str) -> dict[str, Any]:
    deadline = time.monotonic() + 60
    while True:
        status, _, body = fetch(url, f"/v1/workflows/{wf_id}")
        snap: dict[str, Any] = json.loads(body)
        assert status == 200, snap
        if snap["state"] != "running":
            return snap
        assert time.monotonic() < deadline, snap
        time.sleep(0.1)


# -- the page's files -----------------------------------------------------------------------------


def test_the_page_is_served_at_ui_with_a_strict_content_security_policy(gateway: Child) -> None:
    status, headers, body = fetch(gateway.url, "/ui/")
    assert status == 200
    assert headers["content-type"] == "text/html; charset=utf-8"
    csp = headers["content-security-policy"]
    assert "script-src 'self'" in csp and "default-src 'none'" in csp
    assert headers["x-content-type-options"] == "nosniff"
    page = body.decode()
    # Everything it loads is its own, by relative path: no CDN, no other host.
    assert "static/timeline.js" in page and "static/timeline.css" in page
    assert not re.search(r"""(src|href)=["'](https?:)?//""", page)


def test_ui_without_the_slash_redirects_keeping_the_query(gateway: Child) -> None:
    status, headers, _ = fetch(gateway.url, "/ui?workflow=wf-1")
    assert status == 302
    assert headers["location"] == "/ui/?workflow=wf-1"


@pytest.mark.parametrize(("name", "content_type"), [
    ("timeline.js", "text/javascript; charset=utf-8"),
    ("timeline.css", "text/css; charset=utf-8"),
    ("favicon.svg", "image/svg+xml"),
])
def test_each_asset_has_its_content_type(gateway: Child, name: str, content_type: str) -> None:
    status, headers, body = fetch(gateway.url, f"/ui/static/{name}")
    assert status == 200
    assert headers["content-type"] == content_type
    assert body and b"http://" not in body.replace(b"http://www.w3.org/2000/svg", b"")
    assert b"https://" not in body


def test_an_unknown_asset_is_a_404_naming_it(gateway: Child) -> None:
    status, headers, body = fetch(gateway.url, "/ui/static/nope.js")
    assert status == 404
    assert headers["content-type"].startswith("application/json")
    error = json.loads(body)["error"]
    assert error["code"] == "asset_not_found" and "nope.js" in error["message"]


@pytest.mark.parametrize("path", [
    "/ui/static/../ui.py",
    "/ui/static/..%2Fui.py",
    "/ui/static/%2e%2e%2fui.py",
    "/ui/static/..%2F..%2Fpyproject.toml",
    "/ui/static/..%5C..%5Cpyproject.toml",
    "/ui/static/%2Fetc%2Fpasswd",
    "/ui/static/ui_static%2Ftimeline.js",
    "/ui/static/.",
])
def test_paths_outside_the_shipped_files_are_not_found(gateway: Child, path: str) -> None:
    status, _, body = fetch(gateway.url, path)
    assert status == 404, (path, body[:200])
    assert b"import" not in body and b"root:" not in body and b"[project]" not in body


# -- GET /v1/workflows ----------------------------------------------------------------------------


def test_the_listing_shows_submitted_workflows_newest_first(gateway: Child) -> None:
    first = submit(gateway.url, small_workflow("list-a"))
    wait_over(gateway.url, first["id"])
    second = submit(gateway.url, small_workflow("list-b"))
    snap = wait_over(gateway.url, second["id"])
    status, headers, body = fetch(gateway.url, "/v1/workflows?limit=500")
    assert status == 200 and headers["content-type"].startswith("application/json")
    listing = json.loads(body)
    assert listing["object"] == "list"
    ids = [w["id"] for w in listing["data"]]
    assert ids.index(second["id"]) < ids.index(first["id"])
    created = [w["created_s"] for w in listing["data"]]
    assert created == sorted(created, reverse=True)
    entry = next(w for w in listing["data"] if w["id"] == second["id"])
    engines = sorted({t["engine"] for t in snap["tasks"].values()})
    assert entry == {**{k: v for k, v in snap.items() if k != "tasks"},
                     "tasks": 2, "task_states": {"done": 2}, "engines": engines,
                     "prompt_tokens": sum(t["prompt_tokens"] for t in snap["tasks"].values()),
                     "cached_tokens": sum(t["cached_tokens"] or 0
                                          for t in snap["tasks"].values())}
    status, _, body = fetch(gateway.url, "/v1/workflows?limit=1")
    assert status == 200 and [w["id"] for w in json.loads(body)["data"]] == [ids[0]]


@pytest.mark.parametrize("limit", ["0", "-3", "abc", "501", "1.5", ""])
def test_a_bad_limit_is_a_400_naming_it(gateway: Child, limit: str) -> None:
    status, _, body = fetch(gateway.url, f"/v1/workflows?limit={limit}")
    assert status == 400
    error = json.loads(body)["error"]
    assert error["param"] == "limit"
    assert "limit must be an integer from 1 to 500" in error["message"]


def test_the_demo_workflow_is_recorded_for_the_timeline(gateway: Child) -> None:
    """`kvgate demo` streams hinted calls; the record has what the page draws for each task:
    engine, times (first token included) and the cache numbers of the streamed usage."""
    name = f"demo-test-{time.monotonic_ns()}"
    results, _ = asyncio.run(run_workflow(gateway.url, MODEL, workers=2, workflow=name))
    snap = wait_over(gateway.url, name)
    assert snap["source"] == "hints" and snap["state"] == "done"
    tasks = snap["tasks"]
    assert set(tasks) == {"plan", "research-1", "research-2", "reduce"}
    assert tasks["reduce"]["after"] == ["research-1", "research-2"]
    for r in results:
        rec = tasks[r.task]
        assert rec["engine"] == r.engine
        assert rec["ready_s"] <= rec["dispatched_s"] <= rec["first_token_s"] <= rec["finished_s"]
        assert rec["cached_tokens"] == r.cached_tokens
        assert rec["output_tokens"] == r.completion_tokens
    status, _, body = fetch(gateway.url, "/v1/workflows")
    assert status == 200 and name in [w["id"] for w in json.loads(body)["data"]]
