// rlproxy dashboard: builds each page from the documented JSON API.
// Everything from the store goes into the page through textContent (never innerHTML),
// so a recorded message, tool argument or judge explanation can never become markup.
"use strict";

const body = document.body;
const content = document.getElementById("content");
const POLL_MS = 5000;
window.rlproxy = { charts: {} };

// ------------------------------------------------------------------ helpers

function el(tag, attrs, ...children) {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (v === null || v === undefined || v === false) continue;
    if (k === "class") node.className = v;
    else if (k === "text") node.textContent = v;
    else if (k.startsWith("on")) node.addEventListener(k.slice(2), v);
    else node.setAttribute(k, v);
  }
  for (const child of children.flat()) {
    if (child === null || child === undefined) continue;
    node.append(child instanceof Node ? child : document.createTextNode(String(child)));
  }
  return node;
}

function fmt(x, digits = 3) {
  if (x === null || x === undefined || Number.isNaN(x)) return "–";
  if (typeof x !== "number") return String(x);
  if (Number.isInteger(x)) return x.toLocaleString();
  // A KL to the base or a sampler mismatch lives well below 0.001: three decimals would say 0.
  if (Math.abs(x) < 0.001) return x.toExponential(digits - 1);
  return Math.abs(x) >= 1000 ? x.toFixed(0) : x.toFixed(digits);
}

function when(t) { return t ? new Date(t * 1000).toLocaleString() : "–"; }

function link(href, text) { return el("a", { href }, text); }

function encode(id) { return encodeURIComponent(id); }

async function api(path) {
  const response = await fetch(path, { credentials: "same-origin", headers: { accept: "application/json" } });
  const data = await response.json().catch(() => null);
  if (!response.ok) {
    const message = (data && data.error && data.error.message) || `${response.status} ${response.statusText}`;
    throw new Error(message);
  }
  return data;
}

function status(text, bad) {
  const node = document.getElementById("status");
  node.textContent = text;
  node.className = "status" + (bad ? " bad" : "");
}

function showError(error) {
  content.replaceChildren(el("p", { class: "error", role: "alert", text: `Could not load: ${error.message}` }));
}

function table(columns, rows) {
  const head = el("tr", {}, columns.map((c) => el("th", { text: c.label })));
  const tbody = el("tbody");
  appendRows(tbody, columns, rows);
  return el("table", {}, el("thead", {}, head), tbody);
}

function appendRows(tbody, columns, rows) {
  for (const row of rows) {
    tbody.append(el("tr", {}, columns.map((c) => {
      const value = c.value(row);
      return el("td", { class: c.num ? "num" : null }, value instanceof Node ? value : fmt(value));
    })));
  }
}

function card(label, value, id) {
  return el("div", { class: "card", id }, el("div", { class: "k", text: label }),
    el("div", { class: "v" }, value === null || value === undefined ? "" : value));
}

// ------------------------------------------------------------------ charts (uPlot)

function tick(v) {
  // uPlot's default rounds small values (a loss of 0.002) to "0": keep three significant digits.
  if (v === 0) return "0";
  const a = Math.abs(v);
  return a >= 1000 || a < 0.001 ? v.toExponential(1) : String(Number(v.toPrecision(3)));
}

function chartWidth(node) { return Math.max(260, node.clientWidth - 16); }

function lineChart(node, key, title, series, data, height = 200, extra = {}) {
  const existing = window.rlproxy.charts[key];
  if (existing) { existing.setData(data); return existing; }
  const opts = Object.assign({
    title, width: chartWidth(node), height,
    scales: { x: { time: false } },
    axes: [{ label: "step" }, { size: 60, values: (u, ticks) => ticks.map(tick) }],
    series: [{ label: "step" }, ...series],
  }, extra);
  const chart = new uPlot(opts, data, node);
  window.rlproxy.charts[key] = chart;
  return chart;
}

// ------------------------------------------------------------------ overview

const METRICS = [
  ["loss", "loss"], ["kl", "KL to base"], ["clip_fraction", "clip share"], ["grad_norm", "grad norm"],
  ["mismatch_logprob_abs", "sampler/trainer mismatch |log π_old − log μ|"],
  ["tis_capped_fraction", "TIS capped share"], ["behaviour_unknown_fraction", "behaviour unknown share"],
  ["tokens", "tokens"], ["seconds", "step time (s)"], ["reward_mean", "reward of trained groups"],
];

function curveBySplit(curve, split, steps) {
  const at = new Map(curve.filter((r) => r.split === split).map((r) => [r.step, r]));
  const pick = (f) => steps.map((s) => (at.has(s) ? f(at.get(s)) : null));
  // The band is mean ± std, kept within the rewards actually seen.
  return { mean: pick((r) => r.mean), lo: pick((r) => Math.max(r.mean - r.std, r.min)),
           hi: pick((r) => Math.min(r.mean + r.std, r.max)),
           n: pick((r) => r.n) };
}

// `serve --trainer auto`'s child: its state, and why it exited (a failed one is not started again).
function trainerCard(trainer) {
  if (!trainer) return [];
  const node = card("trainer", trainer.state, "trainer-state");
  if (trainer.last_error && trainer.state !== "running") {
    node.classList.add("bad");
    node.append(el("div", { class: "muted", id: "trainer-error", text: trainer.last_error }));
  }
  return [node];
}

async function overview() {
  const top = el("div", { class: "cards", id: "cards" });
  const rewardNode = el("div", { class: "panel", id: "reward-chart" });
  const callsNode = el("div", { class: "panel", id: "calls-chart" });
  const metricsNode = el("div", { class: "metrics", id: "metric-charts" });
  const dataTable = el("details", { id: "curve-data" }, el("summary", { text: "Curve data" }));
  const liveNode = el("div", { class: "panel live", id: "live-traffic" });
  const replicasNode = el("div", { id: "replicas" });
  const note = el("p", { class: "muted", text: "Reward of the rollouts each step's policy sampled (a session counts for "
    + "the step that answered its first call); val rollouts are never trained on. Updates every 5 s." });
  content.replaceChildren(top, replicasNode, el("div", { class: "grid" }, rewardNode, callsNode), note,
    el("h2", { text: "Live traffic" }), liveNode,
    el("h2", { text: "Training metrics" }), metricsNode, dataTable);

  async function refresh() {
    const d = await api("/v1/dashboard");
    top.replaceChildren(card("model", d.model), card("base model", d.base_model), card("engine", d.engine),
      card("serving step", d.step === null ? "base" : String(d.step)),
      card("calls, last minute", fmt(d.calls_per_minute[d.calls_per_minute.length - 1].calls)),
      card("sessions", fmt(d.counts.sessions)), card("groups", fmt(d.counts.groups)),
      card("steps", fmt(d.steps.length)), ...trainerCard(d.trainer));
    liveTraffic(liveNode, d.live_traffic);
    replicas(replicasNode, d.replicas);
    const steps = Array.from(new Set([...d.steps.map((s) => s.step), ...d.reward_curve.map((r) => r.step)]))
      .sort((a, b) => a - b);
    const train = curveBySplit(d.reward_curve, "train", steps);
    const val = curveBySplit(d.reward_curve, "val", steps);
    const band = (stroke) => ({ stroke, width: 0, points: { show: false } });
    lineChart(rewardNode, "reward", "Reward per step (mean ± std)", [
      { label: "train", stroke: "#2f6fdb", width: 2, spanGaps: true, points: { size: 6 } },
      { label: "val", stroke: "#e07b16", width: 2, spanGaps: true, points: { size: 6 } },
      Object.assign(band("#2f6fdb"), { label: "train −std" }), Object.assign(band("#2f6fdb"), { label: "train +std" }),
      Object.assign(band("#e07b16"), { label: "val −std" }), Object.assign(band("#e07b16"), { label: "val +std" }),
    ], [steps, train.mean, val.mean, train.lo, train.hi, val.lo, val.hi], 280, {
      bands: [{ series: [4, 3], fill: "rgba(47,111,219,0.15)" }, { series: [6, 5], fill: "rgba(224,123,22,0.15)" }],
    });
    const minutes = d.calls_per_minute;
    lineChart(callsNode, "calls", "Calls per minute (last hour)", [
      { label: "calls", stroke: "#1f8a4c", width: 2, fill: "rgba(31,138,76,0.12)" },
    ], [minutes.map((m) => m.minute), minutes.map((m) => m.calls)], 280,
    { scales: { x: { time: true } }, axes: [{}, {}] });
    const byStep = new Map(d.steps.map((s) => [s.step, s.metrics || {}]));
    for (const [key, label] of METRICS) {
      const values = steps.map((s) => { const v = (byStep.get(s) || {})[key]; return typeof v === "number" ? v : null; });
      if (!values.some((v) => v !== null)) continue;  // a metric this trainer does not report
      let node = document.getElementById(`metric-${key}`);
      if (!node) { node = el("div", { class: "panel", id: `metric-${key}` }); metricsNode.append(node); }
      lineChart(node, key, label, [{ label, stroke: "#444", width: 1.5, spanGaps: true }], [steps, values], 160);
    }
    const rows = steps.map((s) => ({ step: s, train: train.mean[steps.indexOf(s)], val: val.mean[steps.indexOf(s)],
      n_train: train.n[steps.indexOf(s)], n_val: val.n[steps.indexOf(s)], m: byStep.get(s) || {} }));
    dataTable.replaceChildren(el("summary", { text: `Curve data (${steps.length} steps)` }), table([
      { label: "step", value: (r) => r.step, num: true },
      { label: "train reward", value: (r) => r.train, num: true }, { label: "train rollouts", value: (r) => r.n_train, num: true },
      { label: "val reward", value: (r) => r.val, num: true }, { label: "val rollouts", value: (r) => r.n_val, num: true },
      { label: "loss", value: (r) => r.m.loss, num: true }, { label: "KL", value: (r) => r.m.kl, num: true },
    ], rows));
    status(`updated ${new Date().toLocaleTimeString()}`);
  }
  await refresh();
  setInterval(() => refresh().catch((e) => status(`update failed: ${e.message}`, true)), POLL_MS);
}

function replicas(node, list) {
  // vLLM replicas (--vllm-replicas, several --vllm-url): state, calls in flight and answered, the step
  // each serves, and an adapter it failed to load (it takes no call for that one until a retry loads it).
  if (!list) { node.replaceChildren(); return; }
  const t = table([
    { label: "replica", value: (r) => r.replica, num: true }, { label: "state", value: (r) => r.state },
    { label: "in flight", value: (r) => r.in_flight, num: true }, { label: "calls", value: (r) => r.calls, num: true },
    { label: "step", value: (r) => (r.step === null ? "base" : r.step), num: true },
    { label: "why not serving", value: (r) => [r.reason, ...Object.entries(r.failed_adapters)
      .map(([name, why]) => `${name}: ${why}`)].filter(Boolean).join("; ") },
  ], list);
  t.id = "replicas-table";
  node.replaceChildren(el("h2", { text: "vLLM replicas" }), el("div", { class: "panel" }, t));
}

const ORIGINS = ["harness", "live", "shadow"];

function liveTraffic(node, live) {
  // Groups by how they were formed: a harness's X-Group-Id, rewarded live sessions of one task
  // key, or a live turn with its shadow samples; and the rewards that came too late to train.
  const rows = ORIGINS.map((origin) => ({ origin, ...((live && live.groups[origin]) || { total: 0, trained: 0 }) }));
  const t = table([
    { label: "origin", value: (r) => el("a", { href: `/ui/groups?origin=${r.origin}` }, r.origin) },
    { label: "groups", value: (r) => r.total, num: true },
    { label: "trained", value: (r) => r.trained, num: true },
  ], rows);
  t.id = "live-groups";
  const parts = [t, el("p", { class: "muted", id: "stale-sessions" },
    `stale rewards (kept, never trained): ${fmt(live ? live.stale_sessions : 0)}`)];
  const shadows = live && live.shadow_samples;
  if (shadows) {
    // This gateway's shadow sampler since it started (the same counts as its rlproxy_shadow_* metrics).
    parts.push(el("p", { class: "muted", id: "shadow-samples" },
      `shadow samples: ${fmt(shadows.shadowed)} live calls shadowed, ${fmt(shadows.completed)} judged, ` +
      `${fmt(shadows.dropped)} dropped, ${fmt(shadows.failed)} failed, ${fmt(shadows.in_flight)} in flight; ` +
      `${fmt(shadows.tokens)} tokens generated, ${fmt(shadows.judge_calls)} judge calls`));
  }
  node.replaceChildren(...parts);
}

// ------------------------------------------------------------------ steps

async function stepsPage() {
  const d = await api("/v1/training/steps");
  const keys = ["reward_mean", "reward_std", "loss", "val_loss", "kl", "clip_fraction", "grad_norm",
    "mismatch_logprob_abs", "tokens", "seconds"];
  const present = keys.filter((k) => d.data.some((s) => typeof (s.metrics || {})[k] === "number"));
  // A supervised step (rlproxy train --objective sft) says so; a step 0 seeded by --init-from names its source.
  const objective = (s) => (s.metrics || {}).objective || ((s.metrics || {}).init_from ? `from ${s.metrics.init_from}` : "grpo");
  // Promotion (--promote): who decided and the numbers behind it (gateway/promotion/rule.py).
  const decision = (s) => {
    const d = s.decision;
    if (!d) return "";
    const numbers = typeof d.difference === "number" ? ` (difference ${d.difference.toFixed(3)} ± ` +
      `${d.std_error.toFixed(3)} × z ${d.z_critical.toFixed(2)}, margin ${d.margin}; ` +
      `${d.candidate_sessions} vs ${d.incumbent_sessions} sessions)` : "";
    return `${d.by === "api" ? "API" : d.policy}${d.reason ? ": " + d.reason : ""}${numbers}`;
  };
  const columns = [{ label: "step", value: (s) => s.step, num: true }, { label: "at", value: (s) => when(s.created_at) },
    { label: "state", value: (s) => s.state || "" }, { label: "parent", value: (s) => s.parent ?? "", num: true },
    { label: "decision", value: decision },
    { label: "objective", value: objective },
    ...present.map((k) => ({ label: k, value: (s) => (s.metrics || {})[k], num: true })),
    { label: "groups trained", value: (s) => el("span", {}, (s.groups || []).flatMap((g, i) =>
      [i ? ", " : "", link(`/ui/groups/${encode(g)}`, g)])) }];
  const t = table(columns, d.data);
  t.id = "steps-table";
  const health = await api("/healthz").catch(() => ({}));  // while paused: why (--max-rejections)
  const paused = health.training ? [el("p", { id: "training-paused", text: health.training })] : [];
  content.replaceChildren(...paused, el("p", { class: "muted", text: `${d.data.length} steps` }), t);
}

// ------------------------------------------------------------------ paged lists with filters

function filterForm(fields, onApply) {
  const params = new URLSearchParams(location.search);
  const inputs = fields.map((f) => {
    let input;
    if (f.options) {
      input = el("select", { name: f.name }, f.options.map((o) => el("option", { value: o, text: o || "any" })));
    } else {
      input = el("input", { name: f.name, type: f.type || "text", step: f.step, size: 8 });
    }
    if (params.has(f.name)) input.value = params.get(f.name);
    return el("label", {}, f.label, input);
  });
  const form = el("form", { class: "filters", id: "filters" }, inputs, el("button", { type: "submit", text: "Apply" }));
  form.addEventListener("submit", (event) => {
    event.preventDefault();
    const q = new URLSearchParams();
    for (const [k, v] of new FormData(form).entries()) if (v !== "") q.set(k, v);
    history.replaceState(null, "", `${location.pathname}${q.toString() ? "?" + q : ""}`);
    onApply();
  });
  return form;
}

function apiQuery(form) {
  const q = new URLSearchParams();
  for (const [k, v] of new FormData(form).entries()) {
    if (v === "") continue;
    if (k === "since" || k === "until") q.set(k, String(new Date(v).getTime() / 1000));
    else q.set(k, v);
  }
  return q;
}

async function pagedList(endpoint, fields, columns, countLabel) {
  let cursor = null;
  const tbody = el("tbody");
  const t = el("table", { id: "list" }, el("thead", {}, el("tr", {}, columns.map((c) => el("th", { text: c.label })))), tbody);
  const more = el("button", { type: "button", id: "more", text: "Load more" });
  const count = el("p", { class: "muted", id: "count" });
  let shown = 0;
  const form = filterForm(fields, () => { cursor = null; shown = 0; tbody.replaceChildren(); load(); });
  async function load() {
    const q = apiQuery(form);
    q.set("limit", "50");
    if (cursor) q.set("cursor", cursor);
    const page = await api(`${endpoint}?${q}`);
    appendRows(tbody, columns, page.data);
    shown += page.data.length;
    cursor = page.next_cursor;
    more.hidden = !page.has_more;
    count.textContent = `${shown} ${countLabel} shown${page.has_more ? " (more below)" : ""}`;
  }
  more.addEventListener("click", () => load().catch(showError));
  content.replaceChildren(form, count, t, more);
  await load();
}

const SPLIT = { name: "split", label: "split", options: ["", "train", "val"] };
const TIME = [{ name: "since", label: "since", type: "datetime-local" }, { name: "until", label: "until", type: "datetime-local" }];
const REWARD = [{ name: "min_reward", label: "min reward", type: "number", step: "any" },
  { name: "max_reward", label: "max reward", type: "number", step: "any" }];

function groupsPage() {
  return pagedList("/v1/groups", [SPLIT, { name: "state", label: "state", options: ["", "trained", "skipped", "failed", "pending"] },
    { name: "origin", label: "origin", options: ["", ...ORIGINS] }, ...REWARD, ...TIME], [
    { label: "group", value: (g) => link(`/ui/groups/${encode(g.id)}`, g.id) },
    { label: "origin", value: (g) => g.origin || "harness" }, { label: "task", value: (g) => g.task_key || "" },
    { label: "split", value: (g) => g.split }, { label: "sessions", value: (g) => g.n_sessions, num: true },
    { label: "mean reward", value: (g) => g.reward_mean, num: true },
    { label: "min", value: (g) => g.reward_min, num: true }, { label: "max", value: (g) => g.reward_max, num: true },
    { label: "trained at step", value: (g) => g.trained_step, num: true },
    { label: "skipped / failed", value: (g) => g.failed || g.skipped || "" },
    { label: "created", value: (g) => when(g.created_at) }], "groups");
}

function sessionsPage() {
  return pagedList("/v1/sessions", [SPLIT, ...REWARD, ...TIME], [
    { label: "session", value: (s) => link(`/ui/sessions/${encode(s.id)}`, s.id) },
    { label: "group", value: (s) => (s.group_id ? link(`/ui/groups/${encode(s.group_id)}`, s.group_id) : "") },
    { label: "task", value: (s) => s.task_key || "" },
    { label: "split", value: (s) => s.split }, { label: "step", value: (s) => s.step, num: true },
    { label: "calls", value: (s) => s.n_calls, num: true }, { label: "reward", value: (s) => s.reward, num: true },
    { label: "discarded", value: (s) => (s.discarded ? s.discard_reason || "yes" : "") },
    { label: "created", value: (s) => when(s.created_at) }], "sessions");
}

// ------------------------------------------------------------------ group

async function groupPage() {
  const id = body.dataset.id;
  const g = await api(`/v1/groups/${encode(id)}`);
  const judged = new Map((g.judgements || []).map((j) => [j.session_id, j]));
  const state = g.trained_step !== null && g.trained_step !== undefined ? `trained at step ${g.trained_step}`
    : g.failed ? `failed: ${g.failed}` : g.skipped ? `skipped: ${g.skipped}` : g.ready ? "ready" : "waiting";
  const cards = el("div", { class: "cards" }, card("origin", g.origin || "harness", "origin"),
    card("task", g.task_key || "–", "task-key"), card("split", g.split), card("state", state),
    card("sessions", `${g.n_rewarded}/${g.n_sessions} rewarded`), card("closed", g.closed ? "yes" : "no"),
    card("expected", g.expected_sessions === null ? "–" : String(g.expected_sessions)),
    card("RULER", g.ruler_status || "–"));
  const notes = [];
  if (g.skipped) notes.push(el("p", { class: "bad", id: "skipped" }, "Skipped: ", g.skipped));
  if (g.failed) notes.push(el("p", { class: "bad", id: "failed" }, "Failed: ", g.failed));
  if (g.ruler_error) notes.push(el("p", { class: "bad" }, "RULER error: ", g.ruler_error));
  if (g.attempts && g.trained_step === null && !g.failed) {
    notes.push(el("p", { class: "bad", id: "attempts" }, `${g.attempts} failed attempt(s) to train it; last: `,
      g.last_error || "the trainer stopped during the step"));
  }
  const side = el("div", { class: "side", id: "sessions" }, g.sessions.map((s) => {
    const j = judged.get(s.id);
    const metrics = Object.entries(s.metrics || {});
    return el("div", { class: "panel session" },
      el("div", {}, link(`/ui/sessions/${encode(s.id)}`, s.id)),
      el("div", { class: "card-reward" }, "reward ", el("strong", { text: fmt(s.reward) })),
      s.advantage !== null && s.advantage !== undefined ? el("div", { class: "muted", text: `advantage ${fmt(s.advantage)}` }) : null,
      s.untrained_reason ? el("div", { class: "bad", text: `left out: ${s.untrained_reason}` }) : null,
      metrics.length ? el("div", { class: "muted" }, metrics.map(([k, v]) => `${k}: ${fmt(v)}`).join(" · ")) : null,
      j ? el("div", {}, el("div", { class: "muted", text: `RULER ${fmt(j.score)} by ${j.judge_model}` }),
        el("pre", { text: j.explanation || "" })) : null);
  }));
  const discarded = g.discarded_sessions && g.discarded_sessions.length ? [el("h2", { text: "Discarded sessions" }),
    table([{ label: "session", value: (s) => link(`/ui/sessions/${encode(s.id)}`, s.id) },
      { label: "reason", value: (s) => s.discard_reason || "" }], g.discarded_sessions)] : [];
  content.replaceChildren(cards, ...notes, el("h2", { text: "Sessions side by side" }), side, ...discarded);
}

// ------------------------------------------------------------------ session

function textOf(content) {
  if (content === null || content === undefined) return "";
  if (typeof content === "string") return content;
  if (Array.isArray(content)) return content.map((p) => (p && (p.text ?? p.content)) || (p && p.type ? `[${p.type}]` : "")).join("");
  return JSON.stringify(content);
}

function prettyArgs(args) {
  try { return JSON.stringify(typeof args === "string" ? JSON.parse(args) : args, null, 2); } catch (e) { return String(args); }
}

function messageView(m, note) {
  const role = m.role || "?";
  const parts = [el("div", { class: "role" }, role, note ? el("span", { class: "muted", text: ` · ${note}` }) : null)];
  if (role === "tool") parts.push(el("div", { class: "muted", text: `result of ${m.tool_call_id || m.name || "a tool call"}` }));
  const text = textOf(m.content);
  if (text) parts.push(el("pre", { class: "content", text }));
  for (const call of m.tool_calls || []) {
    const fn = call.function || {};
    parts.push(el("div", { class: "toolcall" }, el("strong", { text: `tool call ${fn.name || "?"}` }),
      el("span", { class: "muted", text: call.id ? ` (${call.id})` : "" }), el("pre", { text: prettyArgs(fn.arguments) })));
  }
  return el("div", { class: `msg ${role}` }, parts);
}

function sameMessage(a, b) { return JSON.stringify(a) === JSON.stringify(b); }

function conversation(calls) {
  // Each call's request repeats the conversation so far: show only what is new, then the reply.
  const nodes = [];
  let seen = [];
  for (const call of calls) {
    const messages = (call.request && call.request.messages) || [];
    let start = 0;
    while (start < seen.length && start < messages.length && sameMessage(seen[start], messages[start])) start++;
    if (start < seen.length) start = 0;  // not a continuation: show the whole request
    if (!messages.length && call.request) nodes.push(el("pre", { text: JSON.stringify(call.request, null, 2) }));
    for (const m of messages.slice(start)) nodes.push(messageView(m));
    const choice = call.response && call.response.choices && call.response.choices[0];
    const note = `call ${call.id} · step ${call.step ?? "base"} · ${fmt(call.latency_ms, 0)} ms`;
    if (choice && choice.message) {
      nodes.push(messageView(choice.message, note));
      seen = [...messages, stripReply(choice.message)];
    } else {
      nodes.push(el("div", { class: "msg bad" }, `${note}: ${call.status}${call.error ? " – " + call.error : ""}`));
      seen = messages;
    }
  }
  return nodes;
}

function stripReply(message) {
  // What a client sends back as history: role, content, tool_calls.
  const out = { role: message.role, content: message.content };
  if (message.tool_calls) out.tool_calls = message.tool_calls;
  return out;
}

function tokenView(tokens) {
  return el("div", { id: "tokens" }, tokens.calls.map((call) => el("div", { class: "panel" },
    el("div", { class: "muted", text: `call ${call.call_id} · step ${call.step ?? "base"} · ${call.prompt_tokens} prompt tokens · `
      + `${call.tokens.length} completion tokens · ${call.trained ? "trained" : "not trained"}`
      + (call.sampling ? ` · sampling ${JSON.stringify(call.sampling)}` : "") }),
    el("div", { class: "tokens" }, call.tokens.map((t) => el("span", {
      class: "tok" + (call.trained ? " trained" : ""),
      title: `id ${t.id}, logprob ${t.logprob === null ? "unknown" : t.logprob.toFixed(4)}`
        + (t.behaviour_logprob === null || t.behaviour_logprob === undefined ? ""
          : `, behaviour logprob μ ${t.behaviour_logprob.toFixed(4)}`),
    }, t.text === null ? `#${t.id}` : t.text, el("small", { text: t.logprob === null ? "" : t.logprob.toFixed(2) })))))));
}

async function sessionPage() {
  const id = body.dataset.id;
  const [s, tokens] = await Promise.all([api(`/v1/sessions/${encode(id)}`), api(`/v1/sessions/${encode(id)}/tokens`)]);
  const metrics = Object.entries(s.metrics || {});
  const cards = el("div", { class: "cards" }, card("reward", s.reward === null ? "none yet" : fmt(s.reward)),
    card("split", s.split), card("calls", String(s.calls.length)),
    el("div", { class: "card" }, el("div", { class: "k", text: "group" }),
      el("div", { class: "v" }, s.group_id ? link(`/ui/groups/${encode(s.group_id)}`, s.group_id) : "–")));
  if (s.discarded) cards.append(card("discarded", s.discard_reason || "yes"));
  if (s.advantage !== null && s.advantage !== undefined) cards.append(card("advantage", fmt(s.advantage)));
  if (s.untrained_reason) cards.append(card("left out", s.untrained_reason, "untrained-reason"));
  if (s.task_key) cards.append(card("task", s.task_key, "task-key"));
  if (s.shadow_of) {
    // A shadow sample: the live call it shadows, linked to that call's session when it is recorded.
    const live = tokens.shadow_of_session;
    cards.append(card("shadow of", live ? link(`/ui/sessions/${encode(live)}`, s.shadow_of) : s.shadow_of, "shadow-of"));
  }
  const metricTable = metrics.length ? table([{ label: "metric", value: (r) => r[0] }, { label: "value", value: (r) => r[1], num: true }], metrics) : el("p", { class: "muted", text: "no metrics" });
  content.replaceChildren(cards, el("h2", { text: "Reward metrics" }), metricTable,
    el("h2", { text: "Conversation" }), el("div", { id: "conversation" }, conversation(s.calls)),
    el("h2", { text: "Tokens (green: trained on; hover for logprobs)" }), tokenView(tokens));
}

// ------------------------------------------------------------------ start

const PAGES = { overview, steps: stepsPage, groups: groupsPage, sessions: sessionsPage, group: groupPage, session: sessionPage };
(PAGES[body.dataset.page] || overview)().then(() => { body.dataset.ready = "1"; }).catch(showError);
