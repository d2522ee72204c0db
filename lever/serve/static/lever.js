// Lever's live page (served by lever/serve/page.py; no build step, nothing from elsewhere).
// Two streams, both read with fetch so an API key can ride along: /live, the server's events of
// every cycle (lever/pipelines/watch.py), and the answer to a request made from the form, through
// the same OpenAI-compatible endpoints any client uses. Token text only ever reaches the page as
// textContent, never as markup.
"use strict";

const KEEP_CYCLES = 300;   // cycles kept for the charts and for stepping back through trees
const CHART_CYCLES = 120;  // cycles a chart shows
const COL_W = 104, ROW_H = 24, NODE_W = 92, NODE_H = 18;  // the tree's grid, px
const SVG = "http://www.w3.org/2000/svg";

const state = {
  key: sessionStorage.getItem("lever-key") || "",
  cycles: [],        // decode cycles, oldest first (prefill passes are counted, not drawn)
  shown: -1,         // index into cycles of the tree on screen; -1: none
  pending: null,     // a tree being verified (its "tree" event), until its cycle comes
  passes: 0, tokens: 0, lastRun: null, drawQueued: false, live: null, ask: null,
};

const $ = (id) => document.getElementById(id);

function headers(json) {
  const h = {};
  if (json) h["Content-Type"] = "application/json";
  if (state.key) h["Authorization"] = "Bearer " + state.key;
  return h;
}

function needKey(message) {
  $("key-row").hidden = false;
  setStatus("key", message || "live: this server needs an API key");
}

function setStatus(s, text) {
  $("status").dataset.state = s;
  $("status").textContent = text;
}

// Server-sent events from a fetch body: calls onEvent(dataText) for each event's data.
async function readEvents(response, onEvent) {
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buf = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buf += decoder.decode(value, { stream: true });
    let cut;
    while ((cut = buf.indexOf("\n\n")) >= 0) {
      const block = buf.slice(0, cut);
      buf = buf.slice(cut + 2);
      const data = block.split("\n").filter((l) => l.startsWith("data:")).map((l) => l.slice(5).trimStart());
      if (data.length) onEvent(data.join("\n"));
    }
  }
}

// -- the live events

async function follow() {
  for (;;) {
    try {
      const r = await fetch("/live", { headers: headers(false), cache: "no-store" });
      if (r.status === 401) { needKey(); return; }
      if (!r.ok) throw new Error("HTTP " + r.status);
      setStatus("live", "live");
      await readEvents(r, (text) => onLive(JSON.parse(text)));
      setStatus("error", "live: the server closed the stream; reconnecting");
    } catch (e) {
      setStatus("error", "live: " + e.message + "; reconnecting");
    }
    await new Promise((ok) => setTimeout(ok, 1000));
  }
}

function onLive(ev) {
  if (ev.type === "run") {
    state.runStart = state.cycles.length;
  } else if (ev.type === "tree") {  // the tree on its way to verification: drawn until its cycle comes
    state.pending = ev;
    if ($("follow").checked) queueDraw();
  } else if (ev.type === "cycle") {
    if (state.pending && state.pending.pass === ev.pass) state.pending = null;
    state.passes += 1;
    state.tokens += ev.emitted.length;
    if (ev.n_given > 1 || !ev.nodes) return;  // a prefill pass: the prompt, nothing drafted
    state.cycles.push(ev);
    if (state.cycles.length > KEEP_CYCLES) {
      state.cycles.shift();
      if (state.shown > 0 && !$("follow").checked) state.shown -= 1;
    }
    if ($("follow").checked) state.shown = state.cycles.length - 1;
    queueDraw();
  } else if (ev.type === "end") {
    state.lastRun = ev;
    state.pending = null;
    queueDraw();
  }
}

function queueDraw() {
  if (state.drawQueued) return;
  state.drawQueued = true;
  requestAnimationFrame(() => { state.drawQueued = false; draw(); });
}

function draw() {
  const c = state.cycles[state.shown];
  if (state.pending && $("follow").checked) drawTree(state.pending);
  else if (c) drawTree(c);
  if (c) drawTimeline(c);
  drawCharts();
  const last = state.lastRun;
  $("counters").textContent = `${state.passes} passes, ${state.tokens} tokens` +
    (last && last.tokens_per_pass !== null ? `; last run ${last.tokens_per_pass.toFixed(2)} tokens/pass` +
      (last.tok_per_s !== null ? `, ${last.tok_per_s.toFixed(1)} tok/s` : "") : "");
  $("cycle-pos").textContent = state.cycles.length ? `${state.shown + 1} / ${state.cycles.length}` : "";
}

// -- the tree: depth to the right, leaves one row each, a parent beside the middle of its children

function shown(text) {
  return text.replace(/\n/g, "⏎").replace(/\t/g, "⇥").replace(/ /g, "·");
}

function el(name, attrs, parent) {
  const e = document.createElementNS(SVG, name);
  for (const [k, v] of Object.entries(attrs || {})) e.setAttribute(k, v);
  if (parent) parent.appendChild(e);
  return e;
}

function layoutTree(nodes) {
  const kids = nodes.map(() => []);
  nodes.forEach((n, i) => { if (n.parent >= 0 && n.parent < nodes.length) kids[n.parent].push(i); });
  const depth = new Array(nodes.length).fill(0), y = new Array(nodes.length).fill(0);
  let row = 0;
  const order = [[0, 0, false]];  // an explicit stack: (node, depth, children placed)
  while (order.length) {
    const [i, d, placed] = order.pop();
    if (!placed) {
      depth[i] = d;
      if (!kids[i].length) { y[i] = row++; continue; }
      kids[i].sort((a, b) => rank(nodes[b]) - rank(nodes[a]));
      order.push([i, d, true]);
      for (let k = kids[i].length - 1; k >= 0; k--) order.push([kids[i][k], d + 1, false]);
    } else {
      y[i] = (y[kids[i][0]] + y[kids[i][kids[i].length - 1]]) / 2;
    }
  }
  return { depth, y, rows: Math.max(row, 1) };
}

function rank(n) {  // the accepted path on top, then by gain
  return (n.state === "kept" ? 2 : 0) + (n.gain === null ? 0 : n.gain);
}

function drawTree(c) {
  const verifying = c.type === "tree";
  const nodes = c.nodes.slice();
  // the target's own token: the last emitted, after the deepest kept node
  const keptNodes = nodes.map((n, i) => (n.state === "kept" ? i : -1)).filter((i) => i >= 0);
  const tail = keptNodes.length ? keptNodes[keptNodes.length - 1] : 0;
  if (!verifying && c.own > 0) nodes.push({ parent: tail, text: c.emitted[c.emitted.length - 1], gain: null, q: null,
                                     state: "target" });
  const { depth, y, rows } = layoutTree(nodes);
  const svg = $("tree");
  svg.replaceChildren();
  const cols = Math.max(...depth) + 1;
  svg.setAttribute("width", cols * COL_W + 8);
  svg.setAttribute("height", rows * ROW_H + 8);
  const at = (i) => [4 + depth[i] * COL_W, 4 + y[i] * ROW_H];
  nodes.forEach((n, i) => {
    if (n.parent < 0) return;
    const [x0, y0] = at(n.parent), [x1, y1] = at(i);
    const kept = n.state === "kept" || n.state === "target";
    el("path", { d: `M${x0 + NODE_W},${y0 + NODE_H / 2} C${x1 - 8},${y0 + NODE_H / 2} ${x0 + NODE_W + 8},` +
                    `${y1 + NODE_H / 2} ${x1},${y1 + NODE_H / 2}`, class: "edge" + (kept ? " kept" : "") }, svg);
  });
  nodes.forEach((n, i) => {
    const [x, yy] = at(i);
    const g = el("g", { class: "node " + (i === 0 ? "kept root" : n.state), transform: `translate(${x},${yy})` }, svg);
    g.style.animationDelay = `${Math.min(i, 60) * 4}ms`;  // in the order TreeExpand added them
    const r = el("rect", { width: NODE_W, height: NODE_H }, g);
    if (n.state === "drafted") r.setAttribute("fill-opacity", String(0.15 + 0.85 * Math.min(1, (n.gain || 0) * 2)));
    const t = el("text", { x: 4, y: 13 }, g);
    const label = shown(n.text);
    t.textContent = label.length > 11 ? label.slice(0, 10) + "…" : label;
    const tip = el("title", {}, g);
    tip.textContent = `${JSON.stringify(n.text)}  ${n.state}` + (n.gain !== null ? `  gain ${n.gain.toFixed(3)}` : "") +
      (n.q !== null ? `  draft p ${n.q.toFixed(3)}` : "");
  });
  svg.dataset.pass = c.pass;
  svg.dataset.nodes = c.nodes.length;
  svg.dataset.state = verifying ? "verifying" : "accepted";
  const n = c.n_drafted, cut = c.n_nodes > c.nodes.length ? ` (first ${c.nodes.length} of ${c.n_nodes} drawn)` : "";
  $("tree-title").textContent = verifying ? `pass ${c.pass}: ${n} drafted nodes, the target verifying them…${cut}` :
    `pass ${c.pass}: ${n} drafted nodes, ${c.drafted_kept} taken, ${c.emitted.length} tokens out, ` +
    `${c.cycle_ms.toFixed(1)} ms${cut}`;
}

// -- the charts over time: the last CHART_CYCLES decode cycles

function drawChart(id, values, maxValue, bars) {
  const svg = $(id);
  svg.replaceChildren();
  const w = svg.clientWidth || 360, h = svg.clientHeight || 70, top = Math.max(maxValue, 1e-9);
  svg.setAttribute("viewBox", `0 0 ${w} ${h}`);
  el("line", { x1: 0, y1: h - 12, x2: w, y2: h - 12, class: "axis" }, svg);
  const step = w / CHART_CYCLES, yOf = (v) => (h - 12) - (h - 24) * (v / top);
  if (bars) {
    values.forEach((v, i) => el("rect", { x: i * step, y: yOf(v), width: Math.max(step - 1, 1), height: (h - 12) - yOf(v),
                                          class: "bar" }, svg));
  } else if (values.length) {
    el("polyline", { points: values.map((v, i) => `${(i + 0.5) * step},${yOf(v)}`).join(" "),
                     class: "line" + (id === "chart-flash" ? " flash" : "") }, svg);
  }
  const label = el("text", { x: 2, y: 10 }, svg);
  label.textContent = bars ? `max ${top.toFixed(1)}` : "100%";
  svg.dataset.points = values.length;
}

function drawCharts() {
  const recent = state.cycles.slice(-CHART_CYCLES);
  const tpp = recent.map((c) => c.emitted.length);
  drawChart("chart-tpp", tpp, Math.max(...tpp, 1), true);
  drawChart("chart-acc", recent.map((c) => (c.n_drafted ? c.drafted_kept / c.n_drafted : 0)), 1, false);
  drawChart("chart-flash", recent.map((c) => c.flash_busy), 1, false);
}

// -- one cycle's timeline: a lane per stage, its spans in ms from the cycle's start

function drawTimeline(c) {
  const svg = $("timeline");
  svg.replaceChildren();
  const w = svg.clientWidth || 600, laneH = 22, left = 86, span = Math.max(c.cycle_ms, 1e-3);
  const stages = [...new Set(c.spans.map((s) => s.stage))];
  const h = Math.max(stages.length, 1) * laneH + 20;
  svg.setAttribute("viewBox", `0 0 ${w} ${h}`);
  svg.style.height = h + "px";
  const xOf = (ms) => left + (w - left - 4) * Math.min(Math.max(ms, 0), span) / span;
  stages.forEach((stage, k) => {
    const label = el("text", { x: 2, y: k * laneH + 15 }, svg);
    label.textContent = stage;
    for (const s of c.spans.filter((x) => x.stage === stage)) {
      const kind = ["io", "compute", "pass"].includes(s.kind) ? s.kind : "other";
      const x0 = xOf(s.start_ms), x1 = xOf(s.end_ms);
      const r = el("rect", { x: x0, y: k * laneH + 3 + (kind === "pass" ? 0 : 2), width: Math.max(x1 - x0, 0.8),
                             height: kind === "pass" ? laneH - 4 : laneH - 8, class: kind }, svg);
      el("title", {}, r).textContent = `${s.stage}: ${s.what} ${(s.end_ms - s.start_ms).toFixed(2)} ms`;
    }
  });
  const axis = el("text", { x: left, y: h - 4 }, svg);
  axis.textContent = `0 … ${c.cycle_ms.toFixed(1)} ms` + (c.timing ? `; read ${c.timing.read_mb.toFixed(1)} MB, ` +
    `flash busy ${(100 * c.flash_busy).toFixed(0)}%` : "");
  svg.dataset.spans = c.spans.length;
  $("timeline-title").textContent = `pass ${c.pass}`;
}

// -- asking: the form's request through /v1/chat/completions or /v1/completions, streamed

async function ask(event) {
  event.preventDefault();
  const out = $("output"), chat = $("chat").checked;
  const body = { max_tokens: Number($("max-tokens").value), temperature: Number($("temperature").value),
                 stream: true, stream_options: { include_usage: true } };
  if (chat) body.messages = [{ role: "user", content: $("prompt").value }];
  else body.prompt = $("prompt").value;
  out.textContent = "";
  out.dataset.state = "streaming";
  $("result").textContent = "";
  $("send").disabled = true;
  $("stop").disabled = false;
  state.ask = new AbortController();
  try {
    const r = await fetch(chat ? "/v1/chat/completions" : "/v1/completions",
                          { method: "POST", headers: headers(true), body: JSON.stringify(body), signal: state.ask.signal });
    if (r.status === 401) { needKey("this server needs an API key"); throw new Error("this server needs an API key"); }
    if (!r.ok) throw new Error((await r.json()).error.message);
    let failed = null;
    await readEvents(r, (text) => {
      if (text === "[DONE]") return;
      const ev = JSON.parse(text);
      if (ev.error) { failed = ev.error.message; return; }
      const choice = ev.choices && ev.choices[0];
      if (choice) out.textContent += (chat ? choice.delta.content : choice.text) || "";
      if (ev.timings) {
        const t = ev.timings;
        $("result").textContent = `${t.predicted_n} tokens, ${t.predicted_per_second.toFixed(1)} tok/s, ` +
          `${t.tokens_per_pass.toFixed(2)} tokens/pass, ${t.passes} passes, ${t.flash_mb_read.toFixed(1)} MB from flash`;
      }
    });
    if (failed) throw new Error(failed);
    out.dataset.state = "done";
  } catch (e) {
    out.dataset.state = e.name === "AbortError" ? "done" : "error";
    if (e.name !== "AbortError") $("result").textContent = e.message;
  } finally {
    $("send").disabled = false;
    $("stop").disabled = true;
  }
}

async function models() {
  const r = await fetch("/v1/models", { headers: headers(false) });
  if (r.status === 401) { needKey(); return false; }
  const data = await r.json();
  $("model").textContent = data.data.map((m) => m.id).join(", ");
  const props = await fetch("/props", { headers: headers(false) });
  if (props.ok) $("chat").checked = Boolean((await props.json()).chat_template);  // no template: a completion
  return true;
}

function step(by) {
  if (!state.cycles.length) return;
  $("follow").checked = false;
  state.shown = Math.max(0, Math.min(state.cycles.length - 1, state.shown + by));
  queueDraw();
}

async function start() {
  $("ask-form").addEventListener("submit", ask);
  $("stop").addEventListener("click", () => state.ask && state.ask.abort());
  $("prev").addEventListener("click", () => step(-1));
  $("next").addEventListener("click", () => step(1));
  $("follow").addEventListener("change", () => { if ($("follow").checked) { state.shown = state.cycles.length - 1; queueDraw(); } });
  $("key-row").addEventListener("submit", (event) => {
    event.preventDefault();
    state.key = $("key").value.trim();
    sessionStorage.setItem("lever-key", state.key);
    $("key-row").hidden = true;
    start2();
  });
  await start2();
}

async function start2() {
  try {
    if (await models()) follow();
  } catch (e) {
    setStatus("error", "live: " + e.message);
  }
}

start();
