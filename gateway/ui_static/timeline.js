// kvgate timeline: the recent workflows, and one workflow as a Gantt chart (a lane per engine).
// Reads the gateway's workflow API; every piece of workflow text reaches the page through
// textContent or setAttribute, never as markup.
"use strict";

(() => {
  const API = new URL("../v1/workflows", window.location.href).pathname;
  const LIST_REFRESH_MS = 2000;
  const LIVE_REFRESH_MS = 1000;
  // A hint-mode workflow reads "done" whenever no call of it is open (its agent may be
  // between calls): its page keeps looking, less often.
  const HINTS_REFRESH_MS = 5000;
  // Placements do not change once made: the trace is read again only when more tasks have
  // been placed, and no more often than this.
  const TRACE_REFRESH_MS = 5000;
  const KEY_STORAGE = "kvgate.timeline.apiKey";
  const SVG_NS = "http://www.w3.org/2000/svg";
  const TERMINAL = new Set(["done", "failed", "skipped", "cancelled"]);
  const STATES = ["blocked", "thinking", "ready", "awaiting_kv", "running", "done", "failed",
                  "skipped", "cancelled"];
  const LEGEND_STATES = ["ready", "running", "done", "failed", "skipped", "cancelled"];

  const app = document.getElementById("app");
  const crumbs = document.getElementById("crumbs");
  const live = document.getElementById("live");
  const tooltip = document.getElementById("tooltip");
  const auth = document.getElementById("auth");

  let timer = null;
  let view = null; // {kind: "list"} | {kind: "workflow", id, snapshot}
  let hovered = null; // {kind: "task"|"move", key}

  // -- small DOM helpers ----------------------------------------------------------------------

  function h(tag, attrs, ...children) {
    const node = document.createElement(tag);
    for (const [k, v] of Object.entries(attrs || {})) {
      if (v !== null && v !== undefined && v !== false) node.setAttribute(k, String(v));
    }
    for (const c of children.flat()) {
      if (c === null || c === undefined || c === false) continue;
      node.append(c instanceof Node ? c : document.createTextNode(String(c)));
    }
    return node;
  }

  function s(tag, attrs, ...children) {
    const node = document.createElementNS(SVG_NS, tag);
    for (const [k, v] of Object.entries(attrs || {})) {
      if (v !== null && v !== undefined) node.setAttribute(k, String(v));
    }
    for (const c of children.flat()) {
      if (c === null || c === undefined) continue;
      node.append(c instanceof Node ? c : document.createTextNode(String(c)));
    }
    return node;
  }

  // -- formatting -----------------------------------------------------------------------------

  function fmtDur(seconds) {
    if (seconds === null || seconds === undefined || !isFinite(seconds)) return "–";
    if (seconds < 1) return `${(seconds * 1000).toFixed(seconds < 0.01 ? 1 : 0)} ms`;
    if (seconds < 60) return `${seconds.toFixed(seconds < 10 ? 2 : 1)} s`;
    const m = Math.floor(seconds / 60);
    return `${m} min ${Math.round(seconds - 60 * m)} s`;
  }

  function fmtInt(n) {
    return n === null || n === undefined ? "–" : Number(n).toLocaleString("en-US");
  }

  function fmtPct(part, whole) {
    return whole && part !== null && part !== undefined
      ? `${((100 * part) / whole).toFixed(1)} %` : "–";
  }

  function fmtBytes(n) {
    if (n === null || n === undefined) return "–";
    const units = ["B", "KiB", "MiB", "GiB"];
    let i = 0;
    let v = n;
    while (v >= 1024 && i < units.length - 1) { v /= 1024; i += 1; }
    return `${v.toFixed(i ? 1 : 0)} ${units[i]}`;
  }

  function fmtClock(epoch) {
    if (!epoch) return "–";
    return new Date(epoch * 1000).toLocaleTimeString([], { hour12: false });
  }

  function fmtAgo(epoch) {
    if (!epoch) return "–";
    const s = Math.max(0, Date.now() / 1000 - epoch);
    if (s < 60) return `${Math.round(s)} s ago`;
    if (s < 3600) return `${Math.round(s / 60)} min ago`;
    return `${(s / 3600).toFixed(1)} h ago`;
  }

  function badge(state) {
    return h("span", { class: `badge s-${state}` }, state.replace("_", " "));
  }

  // -- the API --------------------------------------------------------------------------------

  class AuthNeeded extends Error {}
  class NotFound extends Error {}

  async function getJson(path) {
    const headers = { Accept: "application/json" };
    // Per tab, gone when it closes: the key may be the gateway's admin key.
    const key = window.sessionStorage.getItem(KEY_STORAGE);
    if (key) headers.Authorization = `Bearer ${key}`;
    const resp = await fetch(path, { headers, cache: "no-store" });
    if (resp.status === 401 || resp.status === 403) throw new AuthNeeded();
    let doc = null;
    try { doc = await resp.json(); } catch (e) { doc = null; }
    const message = doc && doc.error && doc.error.message;
    if (resp.status === 404) throw new NotFound(message || "not found");
    if (!resp.ok) throw new Error(message || `HTTP ${resp.status}`);
    return doc;
  }

  function showAuth() {
    auth.hidden = false;
    document.getElementById("auth-key").focus();
  }

  auth.addEventListener("submit", (ev) => {
    ev.preventDefault();
    const value = document.getElementById("auth-key").value.trim();
    if (value) window.sessionStorage.setItem(KEY_STORAGE, value);
    else window.sessionStorage.removeItem(KEY_STORAGE);
    auth.hidden = true;
    route();
  });

  // -- routing: #/ (the list) and #/workflow/ID -----------------------------------------------

  function route() {
    const params = new URLSearchParams(window.location.search);
    if (params.has("workflow")) {
      // ?workflow=ID deep links become the hash form, so the back button works as usual.
      const id = params.get("workflow");
      window.history.replaceState(null, "", `${window.location.pathname}#/workflow/${encodeURIComponent(id)}`);
    }
    if (timer !== null) window.clearTimeout(timer);
    timer = null;
    hideTooltip();
    const match = window.location.hash.match(/^#\/workflow\/(.+)$/);
    if (match) {
      let id;
      try { id = decodeURIComponent(match[1]); } catch (e) { id = match[1]; }
      view = { kind: "workflow", id, snapshot: null };
      document.title = `${id} · kvgate timeline`;
      crumbs.replaceChildren(h("a", { href: "#/" }, "workflows"), " / ", id);
      app.replaceChildren(h("p", { class: "muted" }, "Loading…"));
      refreshWorkflow(view);
    } else {
      view = { kind: "list" };
      document.title = "kvgate timeline";
      crumbs.replaceChildren("recent workflows");
      refreshList(view);
    }
  }

  function schedule(fn, current, ms) {
    if (view !== current) return;
    timer = window.setTimeout(() => fn(current), ms);
  }

  function showError(current, err, retry) {
    if (view !== current) return;
    live.hidden = true;
    if (err instanceof AuthNeeded) {
      showAuth();
      app.replaceChildren(h("p", { class: "muted" }, "Waiting for a key."));
      return;
    }
    const text = err instanceof NotFound && current.kind === "workflow"
      ? `No workflow ${JSON.stringify(current.id)}: unknown or expired. `
      : `Could not read the gateway: ${err.message}. Retrying. `;
    app.replaceChildren(h("div", { class: "error-box" }, text, h("a", { href: "#/" }, "All workflows")));
    if (retry) schedule(retry, current, LIST_REFRESH_MS);
  }

  // -- the list of recent workflows -----------------------------------------------------------

  async function refreshList(current) {
    let doc;
    try {
      doc = await getJson(`${API}?limit=100`);
    } catch (err) {
      showError(current, err, refreshList);
      return;
    }
    if (view !== current) return;
    live.hidden = !doc.data.some((w) => w.state === "running");
    app.replaceChildren(renderList(doc.data));
    schedule(refreshList, current, LIST_REFRESH_MS);
  }

  function progress(w) {
    const bar = h("span", { class: "progress" });
    for (const state of STATES) {
      const n = (w.task_states || {})[state] || 0;
      if (!n) continue;
      const seg = h("span", { class: `fill-${state}`, title: `${n} ${state}` });
      seg.style.width = `${(100 * n) / Math.max(1, w.tasks)}%`;
      bar.append(seg);
    }
    const done = (w.task_states || {}).done || 0;
    return h("td", {}, bar, `${done}/${w.tasks}`);
  }

  function renderList(workflows) {
    const panel = h("section", { class: "panel" },
      h("h2", {}, "Recent workflows",
        h("span", { class: "muted" }, `${workflows.length} shown, newest first, refreshed every 2 s`)));
    if (!workflows.length) {
      panel.append(h("p", { class: "muted summary" },
        "No workflows yet. Submit one with POST /v1/workflows, or send calls with workflow hints."));
      return panel;
    }
    const rows = workflows.map((w) => {
      const href = `#/workflow/${encodeURIComponent(w.id)}`;
      const end = w.finished_s || (w.state === "running" ? Date.now() / 1000 : null);
      const tr = h("tr", { class: "row-link", "data-workflow": w.id },
        h("td", { class: "id" }, h("a", { href }, w.id)),
        h("td", {}, badge(w.state)),
        h("td", {}, w.source),
        h("td", {}, w.model || "–"),
        progress(w),
        h("td", { class: "num" }, (w.engines || []).length),
        h("td", { class: "num" }, fmtPct(w.cached_tokens, w.prompt_tokens)),
        h("td", { title: fmtClock(w.created_s) }, fmtAgo(w.created_s)),
        h("td", { class: "num" }, end && w.created_s ? fmtDur(end - w.created_s) : "–"));
      tr.addEventListener("click", (ev) => {
        if (ev.target.closest("a")) return;
        window.location.hash = href;
      });
      return tr;
    });
    panel.append(h("table", { class: "grid" },
      h("thead", {}, h("tr", {},
        h("th", {}, "Workflow"), h("th", {}, "State"), h("th", {}, "Source"), h("th", {}, "Model"),
        h("th", {}, "Tasks done"), h("th", { class: "num" }, "Engines"),
        h("th", { class: "num" }, "Cache hit"), h("th", {}, "Created"),
        h("th", { class: "num" }, "Duration"))),
      h("tbody", {}, rows)));
    return panel;
  }

  // -- one workflow ---------------------------------------------------------------------------

  async function refreshWorkflow(current) {
    let snap;
    try {
      snap = await getJson(`${API}/${encodeURIComponent(current.id)}`);
    } catch (err) {
      showError(current, err, err instanceof NotFound ? null : refreshWorkflow);
      return;
    }
    if (view !== current) return;
    current.snapshot = snap;
    const running = snap.state === "running";
    const placed = Object.values(snap.tasks || {}).filter((t) => t.engine).length;
    const now = Date.now();
    const due = !running || now - (current.traceRead || 0) >= TRACE_REFRESH_MS;
    // Once more when the workflow is over: a call's placement is in the trace once the call
    // ends, so the last ones are there only then.
    const last = !running && !current.readWhenOver;
    if (current.placements === undefined || last
        || (placed > (current.placedSeen || 0) && due)) {
      current.placedSeen = placed;
      current.traceRead = now;
      current.readWhenOver = !running;
      current.placements = await placementsOf(current.id);
      if (view !== current) return;
    }
    if (running) current.readWhenOver = false;
    live.hidden = !running;
    renderWorkflow(current);
    if (running) schedule(refreshWorkflow, current, LIVE_REFRESH_MS);
    else if (snap.source === "hints") schedule(refreshWorkflow, current, HINTS_REFRESH_MS);
  }

  // The planner's decision for each task's call, from the gateway's trace store (the
  // `placement` span under the task's call): the engine it chose, its estimate, and the
  // runners-up. Absent when the gateway keeps no traces or the policy makes no estimate.
  async function placementsOf(id) {
    let trace;
    try {
      trace = await getJson(`${API}/${encodeURIComponent(id)}/trace`);
    } catch (err) {
      if (err instanceof AuthNeeded) throw err;
      return {};
    }
    const byId = new Map((trace.spans || []).map((sp) => [sp.span_id, sp]));
    const taskOf = (sp) => {
      for (let cur = sp; cur; cur = byId.get(cur.parent_span_id)) {
        const task = cur.attributes && cur.attributes["kvgate.task.id"];
        if (task) return task;
      }
      return null;
    };
    const out = {};
    for (const sp of trace.spans || []) {
      const a = sp.attributes || {};
      if (sp.name !== "placement" || a["kvgate.placement.cost_s"] === undefined) continue;
      const task = taskOf(sp);
      if (!task) continue;
      const engines = a["kvgate.placement.runner_up.engines"] || [];
      const costs = a["kvgate.placement.runner_up.costs_s"] || [];
      out[task] = {
        engine: a["kvgate.engine"],
        cost: a["kvgate.placement.cost_s"],
        runnersUp: engines.map((e, i) => ({ engine: e, cost: costs[i] })),
      };
    }
    return out;
  }

  function placementText(p) {
    if (!p) return null;
    return `${p.engine} ${fmtDur(p.cost)}`;
  }

  function runnersUpText(p) {
    if (!p || !p.runnersUp.length) return null;
    return p.runnersUp.map((r) => `${r.engine} ${fmtDur(r.cost)}`).join(", ");
  }

  function totals(tasks) {
    let prompt = 0, cached = 0, output = 0, moves = 0;
    for (const t of tasks) {
      prompt += t.prompt_tokens || 0;
      cached += t.cached_tokens || 0;
      output += t.output_tokens || 0;
      moves += (t.kv_moves || []).length;
    }
    return { prompt, cached, output, moves };
  }

  function stat(value, label) {
    return h("div", { class: "stat" }, h("b", { title: value }, value), h("small", {}, label));
  }

  function renderWorkflow(current) {
    const snap = current.snapshot;
    const tasks = Object.entries(snap.tasks).map(([id, t]) => ({ id, ...t }));
    const now = Date.now() / 1000;
    const end = snap.finished_s || now;
    const sum = totals(tasks);
    const anyCached = tasks.some((t) => t.cached_tokens !== null && t.cached_tokens !== undefined);
    const done = tasks.filter((t) => t.state === "done").length;
    const engines = new Set(tasks.map((t) => t.engine).filter(Boolean));

    const summary = h("section", { class: "panel summary" },
      h("h1", {}, snap.id, badge(snap.state)),
      stat(fmtDur(end - snap.created_s), snap.state === "running" ? "elapsed" : "duration"),
      stat(`${done}/${tasks.length}`, "tasks done"),
      stat(engines.size, "engines"),
      stat(anyCached ? fmtPct(sum.cached, sum.prompt) : "–", "cache hit"),
      stat(`${anyCached ? fmtInt(sum.cached) : "–"} / ${fmtInt(sum.prompt)}`, "cached / prompt tokens"),
      stat(fmtInt(sum.output), "output tokens"),
      stat(sum.moves, "KV moves"),
      stat(snap.model || "–", "model"),
      stat(snap.source, "source"),
      stat(fmtClock(snap.created_s), "created"));

    const chartBox = h("div", { class: "chart" });
    const gantt = h("section", { class: "panel" },
      h("h2", {}, "Timeline", h("span", { class: "muted" }, "one lane per engine; hover a bar for its timings")),
      legend(), chartBox);
    const table = taskTable(tasks);
    app.replaceChildren(summary, gantt, table);
    const width = Math.max(760, chartBox.clientWidth - 2);
    chartBox.append(drawGantt(snap, tasks, width, now));
    refreshTooltip();
  }

  function legend() {
    const items = LEGEND_STATES.map((st) =>
      h("span", {}, h("i", { class: `fill-${st}` }), st));
    items.push(
      h("span", {}, h("i", { class: "wait" }), "waiting (ready → sent)"),
      h("span", {}, h("i", { class: "mark" }), "first token"),
      h("span", {}, h("i", { class: "cache" }), "cached share of prompt"),
      h("span", {}, h("i", { class: "transfer" }), "KV transfer"),
      h("span", {}, h("i", { class: "warm" }), "warm-up"));
    return h("div", { class: "legend" }, items);
  }

  function taskTable(tasks) {
    const sorted = [...tasks].sort((a, b) => startOf(a) - startOf(b) || a.id.localeCompare(b.id));
    const rows = sorted.map((t) => {
      const tm = timings(t);
      return h("tr", { "data-task": t.id },
        h("td", { class: "id" }, t.id),
        h("td", {}, badge(t.state)),
        h("td", { class: "id" }, t.engine || "–"),
        h("td", { class: "num" }, fmtDur(tm.wait)),
        h("td", { class: "num" }, fmtDur(tm.ttft)),
        h("td", { class: "num" }, fmtDur(tm.duration)),
        h("td", { class: "num" }, fmtInt(t.prompt_tokens)),
        h("td", { class: "num" }, fmtInt(t.cached_tokens)),
        h("td", { class: "num" }, fmtPct(t.cached_tokens, t.prompt_tokens)),
        h("td", { class: "num" }, fmtInt(t.output_tokens)),
        h("td", { class: "wrap" }, t.error || ""));
    });
    return h("section", { class: "panel" }, h("h2", {}, "Tasks"),
      h("table", { class: "grid" },
        h("thead", {}, h("tr", {},
          h("th", {}, "Task"), h("th", {}, "State"), h("th", {}, "Engine"),
          h("th", { class: "num" }, "Wait"), h("th", { class: "num" }, "TTFT"),
          h("th", { class: "num" }, "Duration"), h("th", { class: "num" }, "Prompt"),
          h("th", { class: "num" }, "Cached"), h("th", { class: "num" }, "Hit"),
          h("th", { class: "num" }, "Output"), h("th", {}, "Error"))),
        h("tbody", {}, rows)));
  }

  // -- the Gantt chart ------------------------------------------------------------------------

  const LABEL_W = 190;
  const ROW_H = 26;
  const BAR_H = 18;
  const LANE_PAD = 7;
  const AXIS_H = 26;
  const RIGHT_PAD = 24;
  const GHOST_W = 84;
  const MIN_INSIDE_LABEL = 26;
  const LABEL_CHAR_PX = 6.8;
  const OUTSIDE_LABEL_MAX = 150;

  function labelWidth(text) {
    return Math.min(OUTSIDE_LABEL_MAX, text.length * LABEL_CHAR_PX);
  }

  function startOf(t) {
    return t.ready_s ?? t.dispatched_s ?? t.finished_s ?? Infinity;
  }

  function timings(t) {
    const wait = t.ready_s != null && t.dispatched_s != null ? t.dispatched_s - t.ready_s : null;
    const ttft = t.dispatched_s != null && t.first_token_s != null
      ? t.first_token_s - t.dispatched_s : null;
    const duration = t.dispatched_s != null && t.finished_s != null
      ? t.finished_s - t.dispatched_s : null;
    return { wait, ttft, duration };
  }

  function movesOf(tasks) {
    const out = [];
    for (const t of tasks) {
      for (const m of t.kv_moves || []) {
        const ended = m.ended_s;
        const started = m.started_s ?? (ended != null ? ended - (m.seconds || 0) : null);
        if (ended == null || started == null) continue;
        const source = m.kind === "transfer" ? m.source : t.engine;
        out.push({ ...m, origin: t.id, started, ended, from: source, to: m.destination });
      }
    }
    return out;
  }

  // Lanes: engines in order of first use (a lane never moves once drawn while the workflow
  // runs), then one lane for tasks not placed on an engine (not yet sent, or never sent).
  function lanesOf(tasks, moves) {
    const first = new Map();
    const note = (engine, at) => {
      if (!engine) return;
      const prev = first.get(engine);
      if (prev === undefined || at < prev) first.set(engine, at);
    };
    for (const t of tasks) note(t.engine, t.dispatched_s ?? startOf(t));
    for (const m of moves) { note(m.from, m.started); note(m.to, m.started); }
    const names = [...first.keys()].sort((a, b) => first.get(a) - first.get(b) || a.localeCompare(b));
    const lanes = names.map((name) => ({
      name, kind: "engine", items: [], rows: 0, copies: moves.filter((m) => m.to === name).length }));
    const unplaced = { name: "not placed", kind: "unplaced", items: [], rows: 0 };
    const byName = new Map(lanes.map((l) => [l.name, l]));
    for (const t of tasks) (t.engine ? byName.get(t.engine) : unplaced).items.push(t);
    if (unplaced.items.length) lanes.push(unplaced);
    return lanes;
  }

  // Tasks overlapping in time on one engine get rows of their own (first fit by start).
  function packRows(lane, x, now) {
    const timed = [];
    const ghosts = [];
    for (const t of lane.items) {
      const start = startOf(t);
      if (start === Infinity) ghosts.push(t);
      else {
        const x0 = x(start);
        const x1 = Math.max(x(t.finished_s ?? now), x0 + 4);
        // A bar too short for its name is labelled to its right: the label takes room too.
        const runX0 = t.dispatched_s != null ? x(t.dispatched_s) : x1 - 4;
        const outside = x1 - runX0 - 10 < MIN_INSIDE_LABEL;
        timed.push({ t, x0, x1, outside, end: outside ? x1 + 6 + labelWidth(t.id) : x1 });
      }
    }
    timed.sort((a, b) => a.x0 - b.x0 || a.t.id.localeCompare(b.t.id));
    const rowEnds = [];
    for (const item of timed) {
      let row = rowEnds.findIndex((endX) => endX + 3 <= item.x0);
      if (row < 0) { row = rowEnds.length; rowEnds.push(0); }
      rowEnds[row] = item.end;
      item.row = row;
    }
    // Tasks with no time yet (blocked, thinking) queue up as chips from the left.
    const perRow = Math.max(1, Math.floor((x.width - 8) / (GHOST_W + 6)));
    ghosts.sort((a, b) => a.id.localeCompare(b.id));
    ghosts.forEach((t, i) => {
      timed.push({ t, ghost: true, row: rowEnds.length + Math.floor(i / perRow),
                   x0: x.left + 4 + (i % perRow) * (GHOST_W + 6) });
    });
    lane.placed = timed;
    lane.rows = Math.max(1, rowEnds.length + Math.ceil(ghosts.length / perRow));
  }

  function niceStep(span, target) {
    const raw = span / target;
    const pow = 10 ** Math.floor(Math.log10(raw));
    for (const m of [1, 2, 2.5, 5, 10]) if (raw <= m * pow) return m * pow;
    return 10 * pow;
  }

  function drawGantt(snap, tasks, width, now) {
    const moves = movesOf(tasks);
    const t0 = snap.created_s;
    let t1 = snap.finished_s || now;
    for (const t of tasks) t1 = Math.max(t1, t.finished_s || 0, t.first_token_s || 0);
    for (const m of moves) t1 = Math.max(t1, m.ended);
    const span = Math.max(t1 - t0, 0.05);
    const plotW = width - LABEL_W - RIGHT_PAD;
    const x = (t) => LABEL_W + ((t - t0) / span) * plotW;
    x.left = LABEL_W;
    x.width = plotW;

    const lanes = lanesOf(tasks, moves);
    let y = AXIS_H;
    for (const lane of lanes) {
      packRows(lane, x, now);
      lane.y = y;
      lane.h = lane.rows * ROW_H + 2 * LANE_PAD;
      y += lane.h;
    }
    const height = y + 6;
    const root = s("svg", { width, height, viewBox: `0 0 ${width} ${height}`, class: "gantt",
                            role: "img", "aria-label": `timeline of workflow ${snap.id}` });
    root.append(s("defs", {},
      ["transfer", "warm", "failed"].map((kind) => s("marker", {
        id: `arrow-${kind}`, viewBox: "0 0 10 10", refX: 9, refY: 5, markerWidth: 7,
        markerHeight: 7, orient: "auto-start-reverse" },
      s("path", { d: "M0,0 L10,5 L0,10 z", class: `arrow-${kind}` })))));

    // Lanes and their labels.
    const laneLayer = s("g", { class: "lanes" });
    lanes.forEach((lane, i) => {
      const g = s("g", { class: `lane ${lane.kind}`, "data-kind": lane.kind, "data-engine": lane.kind === "engine" ? lane.name : null });
      const bgClass = lane.kind === "unplaced" ? "unplaced" : i % 2 ? "odd" : "even";
      g.append(
        s("rect", { x: 0, y: lane.y, width, height: lane.h, class: `lane-bg ${bgClass}` }),
        s("line", { x1: 0, x2: width, y1: lane.y + lane.h, y2: lane.y + lane.h, class: "lane-sep" }),
        s("text", { x: 12, y: lane.y + LANE_PAD + ROW_H / 2, "dominant-baseline": "middle", class: "lane-label" },
          clipText(lane.name, LABEL_W - 20, 7.3)),
        s("text", { x: 12, y: lane.y + LANE_PAD + ROW_H / 2 + 15, "dominant-baseline": "middle", class: "lane-count" },
          `${lane.items.length} task${lane.items.length === 1 ? "" : "s"}`
          + (lane.copies ? ` · ${lane.copies} KV in` : "")));
      laneLayer.append(g);
    });
    root.append(laneLayer);

    // Time axis and grid.
    const axis = s("g", { class: "axis" });
    const step = niceStep(span, Math.max(3, Math.floor(plotW / 110)));
    for (let v = 0; v <= span + 1e-9; v += step) {
      const px = x(t0 + v);
      axis.append(
        s("line", { x1: px, x2: px, y1: AXIS_H - 4, y2: height - 6, class: "grid-line" }),
        s("text", { x: px, y: AXIS_H - 10, "text-anchor": "middle", class: "axis-label" }, fmtTick(v, step)));
    }
    axis.append(s("text", { x: 12, y: AXIS_H - 10, class: "axis-label" }, "time since created"));
    root.append(axis);
    if (snap.state === "running") {
      const px = x(now);
      root.append(s("g", { class: "now" },
        s("line", { x1: px, x2: px, y1: AXIS_H - 4, y2: height - 6, class: "now-line" }),
        s("text", { x: px - 4, y: AXIS_H + 8, "text-anchor": "end", class: "now-label" }, "now")));
    }

    // Task bars.
    const barLayer = s("g", { class: "bars" });
    for (const lane of lanes) {
      for (const item of lane.placed) barLayer.append(drawTask(item, lane, x, now));
    }
    root.append(barLayer);

    // KV moves, drawn over the bars, from the source lane to the destination lane.
    const laneOf = new Map(lanes.map((l) => [l.name, l]));
    const moveLayer = s("g", { class: "moves" });
    moves.forEach((m, i) => {
      const dst = laneOf.get(m.to);
      if (!dst) return;
      const src = laneOf.get(m.from) || dst;
      moveLayer.append(drawMove(m, i, src, dst, x));
    });
    root.append(moveLayer);
    return root;
  }

  function fmtTick(v, step) {
    if (step < 1) return v === 0 ? "0" : `${Math.round(v * 1000)} ms`;
    return `${v.toFixed(step < 10 && !Number.isInteger(step) ? 1 : 0)} s`;
  }

  function clipText(text, maxPx, charPx) {
    const max = Math.floor(maxPx / charPx);
    if (text.length <= max) return text;
    return max > 1 ? `${text.slice(0, max - 1)}…` : "";
  }

  function drawTask(item, lane, x, now) {
    const t = item.t;
    const top = lane.y + LANE_PAD + item.row * ROW_H + (ROW_H - BAR_H) / 2;
    const g = s("g", { class: `task${item.ghost ? " ghost" : ""}`, "data-task": t.id, "data-state": t.state });
    if (item.ghost) {
      g.append(
        s("rect", { x: item.x0, y: top, width: GHOST_W, height: BAR_H, rx: 4, class: `bar s-${t.state}` }),
        s("text", { x: item.x0 + 6, y: top + BAR_H / 2, "dominant-baseline": "central", class: "label" },
          clipText(t.id, GHOST_W - 10, 6.6)));
    } else {
      const runStart = t.dispatched_s;
      const runEnd = t.finished_s ?? now;
      if (t.ready_s != null) {
        const waitEnd = runStart ?? t.finished_s ?? now;
        if (waitEnd > t.ready_s) {
          g.append(s("rect", { x: x(t.ready_s), y: top, width: Math.max(1, x(waitEnd) - x(t.ready_s)),
                               height: BAR_H, rx: 3, class: `wait s-${runStart == null ? t.state : "running"}` }));
        }
      }
      let bx0;
      let bx1;
      if (runStart != null) {
        bx0 = x(runStart);
        bx1 = Math.max(x(runEnd), bx0 + 3);
      } else {
        // Never sent (skipped, cancelled, failed before dispatch) or still waiting: a short
        // bar where its wait ends.
        bx1 = x(t.finished_s ?? now);
        bx0 = bx1 - 4;
      }
      g.append(s("rect", { x: bx0, y: top, width: bx1 - bx0, height: BAR_H, rx: 3, class: `bar s-${t.state}` }));
      if (t.prompt_tokens && t.cached_tokens && runStart != null) {
        const share = Math.min(1, t.cached_tokens / t.prompt_tokens);
        g.append(s("rect", { x: bx0, y: top + BAR_H - 4, width: Math.max(1, (bx1 - bx0) * share), height: 4,
                             class: "cache" }));
      }
      if (t.first_token_s != null && runStart != null) {
        const fx = x(t.first_token_s);
        g.append(s("line", { x1: fx, x2: fx, y1: top - 2, y2: top + BAR_H + 2, class: "ttft" }));
      }
      const room = bx1 - bx0 - 10;
      if (!item.outside && room >= MIN_INSIDE_LABEL) {
        g.append(s("text", { x: bx0 + 6, y: top + BAR_H / 2 - 1, "dominant-baseline": "central", class: "label" },
          clipText(t.id, room, LABEL_CHAR_PX)));
      } else {
        // To the bar's right, or to its left where the chart ends.
        const right = bx1 + 5 + labelWidth(t.id) <= x.left + x.width + RIGHT_PAD;
        g.append(s("text", { x: right ? bx1 + 5 : (item.ghost ? bx0 : Math.min(bx0, x(startOf(t)))) - 5,
                             y: top + BAR_H / 2 - 1, "dominant-baseline": "central",
                             "text-anchor": right ? "start" : "end", class: "label outside" },
          clipText(t.id, OUTSIDE_LABEL_MAX, LABEL_CHAR_PX)));
      }
    }
    g.addEventListener("mouseenter", (ev) => { hovered = { kind: "task", key: t.id }; showTooltip(ev); });
    g.addEventListener("mousemove", moveTooltip);
    g.addEventListener("mouseleave", hideTooltip);
    return g;
  }

  function drawMove(m, i, src, dst, x) {
    const key = m.id || `${m.origin}:${i}`;
    const failed = m.outcome !== "done";
    const cls = `move ${m.kind === "transfer" ? "transfer" : "warm"}${failed ? " failed" : ""}`;
    const g = s("g", { class: cls, "data-move": key, "data-kind": m.kind });
    const x0 = x(m.started);
    const x1 = Math.max(x(m.ended), x0 + 2);
    // Leave the source lane by its edge facing the destination, so the curve crosses no bar
    // of its own lane.
    const down = src.y <= dst.y;
    const y0 = src === dst ? src.y + 4 : down ? src.y + src.h - 2 : src.y + 2;
    const y1 = src === dst ? dst.y + dst.h - 4 : down ? dst.y + 5 : dst.y + dst.h - 5;
    const marker = failed ? "failed" : m.kind === "transfer" ? "transfer" : "warm";
    const mid = (y0 + y1) / 2;
    const d = `M${x0},${y0} C${x0 + (x1 - x0) * 0.5},${y0} ${x0 + (x1 - x0) * 0.5},${mid} ${x1},${y1}`;
    g.append(
      s("rect", { x: x0, y: dst.y + 1, width: x1 - x0, height: 3, class: "span" }),
      s("path", { d, "marker-end": `url(#arrow-${marker})` }),
      s("path", { d, class: "hit" }));
    g.addEventListener("mouseenter", (ev) => { hovered = { kind: "move", key, move: m }; showTooltip(ev); });
    g.addEventListener("mousemove", moveTooltip);
    g.addEventListener("mouseleave", hideTooltip);
    return g;
  }

  // -- tooltip --------------------------------------------------------------------------------

  function rows(pairs) {
    return h("dl", {}, pairs.filter(([, v]) => v !== null && v !== undefined)
      .flatMap(([k, v]) => [h("dt", {}, k), h("dd", {}, v)]));
  }

  function taskTooltip(t) {
    const tm = timings(t);
    const parts = [
      h("h3", {}, t.id, badge(t.state)),
      rows([
        ["engine", t.engine || "not placed"],
        ["ready", t.ready_s ? fmtClock(t.ready_s) : null],
        ["wait", fmtDur(tm.wait)],
        ["TTFT", fmtDur(tm.ttft)],
        ["duration", fmtDur(tm.duration)],
        ["prompt tokens", fmtInt(t.prompt_tokens)],
        ["cached tokens", fmtInt(t.cached_tokens)],
        ["cache hit", fmtPct(t.cached_tokens, t.prompt_tokens)],
        ["output tokens", fmtInt(t.output_tokens)],
        ["after", (t.after || []).length ? t.after.join(", ") : null],
        ["KV moves", (t.kv_moves || []).length ? String(t.kv_moves.length) : null],
        ["placed at (estimate)", placementText(t.placement)],
        ["runners-up", runnersUpText(t.placement)],
      ]),
    ];
    if (t.error) parts.push(h("div", { class: "err" }, t.error));
    return parts;
  }

  function moveInfo(m) {
    const parts = [
      h("h3", {}, m.kind === "transfer" ? "KV transfer" : "Warm-up", badge(m.outcome === "done" ? "done" : "failed")),
      rows([
        ["reason", m.reason],
        ["from", m.kind === "transfer" ? m.from : null],
        ["to", m.to],
        ["origin task", m.origin],
        ["tokens", fmtInt(m.tokens)],
        ["bytes", m.bytes != null ? fmtBytes(m.bytes) : null],
        ["took", fmtDur(m.ended - m.started)],
      ]),
    ];
    if (m.error) parts.push(h("div", { class: "err" }, m.error));
    return parts;
  }

  function fillTooltip() {
    if (!hovered || !view || view.kind !== "workflow" || !view.snapshot) return false;
    if (hovered.kind === "task") {
      const t = view.snapshot.tasks[hovered.key];
      if (!t) return false;
      const placement = (view.placements || {})[hovered.key];
      tooltip.replaceChildren(...taskTooltip({ id: hovered.key, ...t, placement }));
    } else {
      tooltip.replaceChildren(...moveInfo(hovered.move));
    }
    return true;
  }

  let lastMouse = { x: 0, y: 0 };

  function showTooltip(ev) {
    if (!fillTooltip()) return;
    tooltip.hidden = false;
    for (const el of document.querySelectorAll(".task.hover")) el.classList.remove("hover");
    if (hovered.kind === "task") ev.currentTarget.classList.add("hover");
    moveTooltip(ev);
  }

  function moveTooltip(ev) {
    lastMouse = { x: ev.clientX, y: ev.clientY };
    placeTooltip();
  }

  function placeTooltip() {
    const pad = 14;
    const w = tooltip.offsetWidth;
    const hgt = tooltip.offsetHeight;
    let left = lastMouse.x + pad;
    let top = lastMouse.y + pad;
    if (left + w > window.innerWidth - 8) left = Math.max(8, lastMouse.x - w - pad);
    if (top + hgt > window.innerHeight - 8) top = Math.max(8, lastMouse.y - hgt - pad);
    tooltip.style.left = `${left}px`;
    tooltip.style.top = `${top}px`;
  }

  function refreshTooltip() {
    if (tooltip.hidden || !hovered) return;
    if (fillTooltip()) {
      if (hovered.kind === "task") {
        const g = document.querySelector(`.task[data-task="${CSS.escape(hovered.key)}"]`);
        if (g) g.classList.add("hover");
      }
      placeTooltip();
    } else {
      hideTooltip();
    }
  }

  function hideTooltip() {
    hovered = null;
    tooltip.hidden = true;
    for (const el of document.querySelectorAll(".task.hover")) el.classList.remove("hover");
  }

  // -- start ------------------------------------------------------------------------------------

  window.addEventListener("hashchange", route);
  // A chart redrawn under a resting pointer gets no mouseleave from the old bar: the next
  // move anywhere else hides the tooltip.
  document.addEventListener("mousemove", (ev) => {
    if (!tooltip.hidden && !(ev.target instanceof Element && ev.target.closest(".task, .move"))) {
      hideTooltip();
    }
  });
  let resizeTimer = null;
  let drawnWidth = window.innerWidth;
  window.addEventListener("resize", () => {
    if (window.innerWidth === drawnWidth) return; // the chart depends on the width alone
    window.clearTimeout(resizeTimer);
    resizeTimer = window.setTimeout(() => {
      drawnWidth = window.innerWidth;
      if (view && view.kind === "workflow" && view.snapshot) renderWorkflow(view);
    }, 150);
  });
  route();
})();
