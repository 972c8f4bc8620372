"""The Grafana dashboard in configs/grafana names only metrics a running gateway exports.

Every PromQL expression of the dashboard (panel targets and template-variable queries) is
reduced to the metric names it selects, and each must be a sample name the gateway's `/metrics`
writes after some traffic (a real `kvgate serve` in front of real `kvgate sim` engines), spelled
exactly as the exposition writes it: counters with `_total`, histograms as `_bucket`, `_sum`,
`_count`.
"""

from __future__ import annotations

import json
import re
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvgate.procs import Child
from tests.conftest import MODEL

ROOT = Path(__file__).resolve().parent.parent
DASHBOARD = ROOT / "configs" / "grafana" / "kvgate-dashboard.json"

# PromQL words that are not metric names (operators and modifiers; functions and aggregations
# are recognised by the `(` that follows them).
KEYWORDS = frozenset({
    "by", "without", "on", "ignoring", "group_left", "group_right", "bool", "and", "or",
    "unless", "offset", "atan2", "inf", "nan", "start", "end",
})
_STRING = re.compile(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'|`[^`]*`')
_GROUPING = re.compile(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)")
_TOKEN = re.compile(r"""
    (?P<number>(?:0x[0-9a-fA-F]+|\d+(?:\.\d*)?(?:[eE][+-]?\d+)?|\.\d+(?:[eE][+-]?\d+)?)
               (?:ms|[smhdwy])*)
  | (?P<ident>[a-zA-Z_:][a-zA-Z0-9_:]*)
  | (?P<other>.)
""", re.VERBOSE | re.DOTALL)
_LABEL_VALUES = re.compile(r"^\s*label_values\s*\((?P<selector>.*?)(?:,\s*[a-zA-Z_]\w*\s*)?\)\s*$",
                           re.DOTALL)


def _strip_brackets(expr: str, open_: str, close: str) -> str:
    """`expr` without anything between `open_` and its matching `close` (label matchers,
    range and subquery selectors)."""
    out = []
    depth = 0
    for ch in expr:
        if ch == open_:
            depth += 1
        elif ch == close and depth:
            depth -= 1
        elif not depth:
            out.append(ch)
    return "".join(out)


def metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression (or Grafana's `label_values(selector, label)`)
    selects: identifiers that are not functions, keywords or grouping label lists."""
    m = _LABEL_VALUES.match(expr)
    if m:
        expr = m.group("selector")
    expr = _STRING.sub("", expr)
    expr = re.sub(r"\$\{[^}]*\}|\$\w+", "", expr)  # Grafana variables
    expr = _strip_brackets(expr, "{", "}")
    expr = _strip_brackets(expr, "[", "]")
    expr = _GROUPING.sub(" ", expr)
    expr = re.sub(r"\boffset\s+-?[0-9a-z.]+", " ", expr)
    names: set[str] = set()
    tokens = [(t.lastgroup, t.group()) for t in _TOKEN.finditer(expr)]
    tokens = [(kind, text) for kind, text in tokens if not text.isspace()]
    for i, (kind, text) in enumerate(tokens):
        if kind != "ident" or text.lower() in KEYWORDS:
            continue
        if i + 1 < len(tokens) and tokens[i + 1][1] == "(":
            continue  # a function or an aggregation
        names.add(text)
    return names


def dashboard_exprs(dashboard: dict[str, Any]) -> Iterator[tuple[str, str]]:
    """(where, expression) for every panel target and template-variable query."""
    def panels(items: list[dict[str, Any]]) -> Iterator[dict[str, Any]]:
        for p in items:
            yield p
            yield from panels(p.get("panels", []))

    for p in panels(dashboard.get("panels", [])):
        for t in p.get("targets", []):
            if "expr" in t:
                yield f"panel {p.get('title')!r} target {t.get('refId')}", t["expr"]
    for var in dashboard.get("templating", {}).get("list", []):
        query = var.get("query")
        if isinstance(query, dict):
            query = query.get("query")
        if var.get("type") == "query" and isinstance(query, str):
            yield f"variable {var.get('name')!r}", query


def exported_names(text: str) -> set[str]:
    """Sample names the exposition writes, and those its families will write once they have
    series (a labelled counter with no child yet still declares its TYPE)."""
    suffixes = {"counter": ("_total", "_created"), "gauge": ("",),
                "histogram": ("_bucket", "_sum", "_count", "_created"),
                "summary": ("", "_sum", "_count", "_created"), "info": ("_info",)}
    out: set[str] = set()
    for family in text_string_to_metric_families(text):
        out.update(s.name for s in family.samples)
        out.update(family.name + sfx for sfx in suffixes.get(family.type, ("",)))
    return out


def unexported(dashboard: dict[str, Any], exported: set[str]) -> list[str]:
    """Every `where: name` of a metric the dashboard names that is not exported."""
    return [f"{where}: {name}" for where, expr in dashboard_exprs(dashboard)
            for name in sorted(metric_names(expr)) if name not in exported]


@pytest.fixture(scope="module")
def exposition(gateway: Child) -> str:
    """The shared gateway's `/metrics` after a streamed and a plain call."""
    for stream in (False, True):
        body = {"model": MODEL, "max_tokens": 3, "stream": stream,
                "messages": [{"role": "user", "content": "Say something short."}]}
        req = urllib.request.Request(f"{gateway.url}/v1/chat/completions",
                                     data=json.dumps(body).encode(), method="POST",
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=60) as r:
            assert r.status == 200
            r.read()
    with urllib.request.urlopen(f"{gateway.url}/metrics", timeout=10) as r:
        return str(r.read().decode())


def test_the_tokenizer_finds_metric_names_and_nothing_else() -> None:
    expr = ('histogram_quantile(0.95, sum by (le, engine) (rate(kvgate_x_bucket{engine=~"$e",'
            ' route="/v1/chat"}[$__rate_interval] offset 5m))) / on (engine) group_left (route)'
            ' kvgate_y_total > bool 1e3 unless sum without (instance) (kvgate_z) or vector(0)'
            ' + max_over_time(kvgate_w[5m:30s])')
    assert metric_names(expr) == {"kvgate_x_bucket", "kvgate_y_total", "kvgate_z", "kvgate_w"}
    assert metric_names('label_values(kvgate_engine_healthy{instance=~"$instance"}, engine)'
                        ) == {"kvgate_engine_healthy"}
    assert metric_names("{__name__=~\"kvgate_.*\"}") == set()


def test_a_dashboard_naming_an_unexported_metric_fails_the_check(exposition: str) -> None:
    exported = exported_names(exposition)
    doctored = {"panels": [{"title": "bad", "targets": [
        {"refId": "A", "expr": "sum(rate(kvgate_requests[1m]))"},  # a counter without _total
        {"refId": "B", "expr": "rate(kvgate_no_such_metric_total[1m])"},
        {"refId": "C", "expr": "sum(rate(kvgate_requests_total[1m]))"}]}]}
    assert unexported(doctored, exported) == [
        "panel 'bad' target A: kvgate_requests",
        "panel 'bad' target B: kvgate_no_such_metric_total"]


def test_every_metric_the_dashboard_names_is_exported(exposition: str) -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    exprs = list(dashboard_exprs(dashboard))
    assert len(exprs) >= 20
    assert unexported(dashboard, exported_names(exposition)) == []


def test_every_panel_has_a_unique_id_and_a_place_on_the_grid() -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    for p in dashboard["panels"]:
        pos = p["gridPos"]
        assert pos["x"] + pos["w"] <= 24, p["title"]
        if p["type"] != "row":
            assert p["targets"] and p["datasource"]["uid"] == "${DS_PROMETHEUS}", p["title"]

