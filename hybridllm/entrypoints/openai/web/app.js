// hybridllm's page: chat, the placement plan and live rates, from the server's own /v1 routes.
// Plain DOM, no framework and no build step. Text from the server or the model is only ever
// set as textContent (never parsed as HTML); the one exception is the plan picture, an SVG the
// server writes with every string escaped, parsed as XML and stripped of anything active.
"use strict";

const $ = (id) => document.getElementById(id);
const STORE_KEY = "hybridllm.conversations";
const SETTINGS_KEY = "hybridllm.settings";
const LIVE_POLL_MS = 1000;

// ---- storage: conversations and settings in localStorage ----

function loadJson(key, fallback) {
  try {
    const value = JSON.parse(localStorage.getItem(key));
    return value ?? fallback;
  } catch {
    return fallback; // a corrupt entry is dropped, not fatal
  }
}

const state = {
  conversations: loadJson(STORE_KEY, []),
  currentId: null,
  model: null,
  controller: null, // the AbortController of the running generation
  tab: "chat",
};
if (!Array.isArray(state.conversations)) state.conversations = [];

function saveConversations() {
  try {
    localStorage.setItem(STORE_KEY, JSON.stringify(state.conversations));
  } catch (e) {
    showBanner(`Could not save the conversation in this browser: ${e.message}`);
  }
}

const SETTING_FIELDS = {
  system: "system-prompt", temperature: "temperature", top_p: "top-p",
  max_tokens: "max-tokens", seed: "seed", tools: "tools", tool_choice: "tool-choice", apiKey: "api-key",
};

function loadSettings() {
  const saved = loadJson(SETTINGS_KEY, {});
  for (const [name, id] of Object.entries(SETTING_FIELDS)) {
    if (typeof saved[name] === "string") $(id).value = saved[name];
    $(id).addEventListener("change", saveSettings);
  }
}

function saveSettings() {
  const values = {};
  for (const [name, id] of Object.entries(SETTING_FIELDS)) values[name] = $(id).value;
  localStorage.setItem(SETTINGS_KEY, JSON.stringify(values));
}

// ---- talking to the server ----

class ApiError extends Error {
  constructor(message, status) {
    super(message);
    this.status = status;
  }
}

function headers() {
  const h = { "Content-Type": "application/json" };
  const key = $("api-key").value.trim();
  if (key) h.Authorization = `Bearer ${key}`;
  return h;
}

// A failed response as the server said it: its error.message, with the status.
async function responseError(response) {
  let message = response.statusText || "error";
  try {
    const body = await response.json();
    if (body?.error?.message) message = body.error.message;
    else if (body?.detail) message = typeof body.detail === "string" ? body.detail : JSON.stringify(body.detail);
  } catch {
    /* not JSON: the status line says it */
  }
  if (response.status === 401) {
    return new ApiError(`401: ${message}. The server wants an API key: enter it under Settings.`, 401);
  }
  return new ApiError(`${response.status}: ${message}`, response.status);
}

async function api(path, options = {}) {
  let response;
  try {
    response = await fetch(path, { ...options, headers: { ...headers(), ...(options.headers || {}) } });
  } catch (e) {
    if (e.name === "AbortError") throw e;
    throw new ApiError(`Cannot reach the server (${e.message}). Is it running?`, 0);
  }
  if (!response.ok) throw await responseError(response);
  return response;
}

function showBanner(text) {
  $("banner-text").textContent = text;
  $("banner").hidden = false;
}

// ---- chat ----

function currentConversation() {
  return state.conversations.find((c) => c.id === state.currentId) || null;
}

function newConversation() {
  const conv = { id: `c${Date.now()}${Math.random().toString(16).slice(2, 8)}`, title: "New chat", messages: [] };
  state.conversations.unshift(conv);
  state.currentId = conv.id;
  saveConversations();
  return conv;
}

function renderConversationList() {
  const list = $("conversation-list");
  list.replaceChildren();
  for (const conv of state.conversations) {
    const li = document.createElement("li");
    li.className = conv.id === state.currentId ? "current" : "";
    const title = document.createElement("span");
    title.textContent = conv.title;
    title.title = conv.title;
    const del = document.createElement("button");
    del.type = "button";
    del.textContent = "×";
    del.setAttribute("aria-label", "delete conversation");
    del.addEventListener("click", (ev) => {
      ev.stopPropagation();
      state.conversations = state.conversations.filter((c) => c !== conv);
      if (state.currentId === conv.id) state.currentId = state.conversations[0]?.id ?? null;
      saveConversations();
      renderAll();
    });
    li.append(title, del);
    li.addEventListener("click", () => {
      if (state.controller) return; // one generation at a time
      state.currentId = conv.id;
      renderAll();
    });
    list.append(li);
  }
}

// Text with ``` fenced code blocks and `inline code`; everything else is plain text.
function renderText(text, into) {
  const parts = text.split(/```/);
  parts.forEach((part, i) => {
    if (i % 2 === 1) {
      const newline = part.indexOf("\n");
      const lang = newline > 0 ? part.slice(0, newline).trim() : "";
      const pre = document.createElement("pre");
      const code = document.createElement("code");
      if (lang && /^[\w+-]+$/.test(lang)) code.dataset.lang = lang;
      code.textContent = newline >= 0 && /^[\w+-]*$/.test(part.slice(0, newline).trim()) ? part.slice(newline + 1) : part;
      pre.append(code);
      into.append(pre);
      return;
    }
    for (const para of part.split(/\n{2,}/)) {
      if (!para.trim()) continue;
      const p = document.createElement("p");
      para.split("`").forEach((bit, j) => {
        if (j % 2 === 1) {
          const code = document.createElement("code");
          code.textContent = bit;
          p.append(code);
        } else {
          p.append(document.createTextNode(bit));
        }
      });
      into.append(p);
    }
  });
}

function actionButton(label, onClick) {
  const b = document.createElement("button");
  b.type = "button";
  b.textContent = label;
  b.addEventListener("click", onClick);
  return b;
}

function renderMessage(msg, index, conv) {
  const div = document.createElement("div");
  div.className = `message ${msg.role}`;
  div.dataset.index = index;
  const role = document.createElement("div");
  role.className = "role";
  role.textContent = msg.role === "user" ? "you" : state.model || "assistant";
  div.append(role);
  if (msg.reasoning) {
    const details = document.createElement("details");
    details.className = "reasoning";
    const summary = document.createElement("summary");
    summary.textContent = "Reasoning";
    const body = document.createElement("div");
    renderText(msg.reasoning, body);
    details.append(summary, body);
    div.append(details);
  }
  const content = document.createElement("div");
  content.className = "content";
  renderText(msg.content || "", content);
  div.append(content);
  for (const call of msg.tool_calls || []) {
    const box = document.createElement("div");
    box.className = "tool-call";
    const name = document.createElement("div");
    name.textContent = `Tool call: ${call.function?.name ?? "?"}`;
    const args = document.createElement("pre");
    args.textContent = call.function?.arguments ?? "";
    box.append(name, args);
    div.append(box);
  }
  if (msg.note) {
    const note = document.createElement("div");
    note.className = "note";
    note.textContent = msg.note;
    div.append(note);
  }
  if (msg.error) {
    const err = document.createElement("div");
    err.className = "error";
    err.textContent = msg.error;
    div.append(err);
  }
  if (!state.controller) {
    const actions = document.createElement("div");
    actions.className = "actions";
    if (msg.role === "user") actions.append(actionButton("Edit", () => editMessage(div, conv, index)));
    if (msg.role === "assistant" && index === conv.messages.length - 1) {
      actions.append(actionButton("Regenerate", () => {
        if (!settingsOk()) return;
        conv.messages.splice(index, 1);
        generate(conv);
      }));
    }
    if (actions.childElementCount) div.append(actions);
  }
  return div;
}

function editMessage(div, conv, index) {
  const box = document.createElement("textarea");
  box.rows = 3;
  box.value = conv.messages[index].content;
  const actions = document.createElement("div");
  actions.className = "actions";
  actions.append(
    actionButton("Send", () => {
      if (!settingsOk()) return;
      // the conversation from here on is replaced by the edited message's new reply
      conv.messages.splice(index, conv.messages.length - index, { role: "user", content: box.value });
      generate(conv);
    }),
    actionButton("Cancel", () => renderMessages()),
  );
  div.querySelector(".content").replaceChildren(box);
  div.querySelector(".actions")?.remove();
  div.append(actions);
  box.focus();
}

function renderMessages() {
  const conv = currentConversation();
  const box = $("messages");
  box.replaceChildren();
  if (!conv) return;
  conv.messages.forEach((msg, i) => box.append(renderMessage(msg, i, conv)));
  box.scrollTop = box.scrollHeight;
}

function renderAll() {
  renderConversationList();
  renderMessages();
  const busy = Boolean(state.controller);
  $("send").hidden = busy;
  $("stop").hidden = !busy;
}

// A number field as typed: a bad value goes to the server, which names what is wrong with it.
function numberSetting(id) {
  const raw = $(id).value.trim();
  if (raw === "") return undefined;
  const value = Number(raw);
  return Number.isNaN(value) ? raw : value;
}

function requestBody(conv) {
  const messages = [];
  const system = $("system-prompt").value;
  if (system.trim()) messages.push({ role: "system", content: system });
  for (const m of conv.messages) {
    if (m.role === "user") messages.push({ role: "user", content: m.content });
    else if (m.role === "assistant" && !m.error) {
      const out = { role: "assistant", content: m.content || "" };
      if (m.tool_calls?.length) out.tool_calls = m.tool_calls;
      messages.push(out);
    }
  }
  const body = { model: state.model || undefined, messages, stream: true, stream_options: { include_usage: true } };
  for (const [key, id] of [["temperature", "temperature"], ["top_p", "top-p"], ["max_tokens", "max-tokens"], ["seed", "seed"]]) {
    const v = numberSetting(id);
    if (v !== undefined) body[key] = v;
  }
  const tools = readTools();
  if (tools !== undefined) {
    body.tools = tools;
    body.tool_choice = $("tool-choice").value;
  }
  return body;
}

// The tools field: undefined when empty; throws naming the problem when it is not JSON.
function readTools() {
  const text = $("tools").value.trim();
  if (!text) return undefined;
  try {
    return JSON.parse(text);
  } catch (e) {
    throw new ApiError(`The tools field is not JSON: ${e.message}`, 0);
  }
}

// Whether a request can be built from the settings; if not, says why and changes nothing.
function settingsOk() {
  try {
    readTools();
    return true;
  } catch (e) {
    showBanner(e.message);
    return false;
  }
}

// Server-sent events: yields each `data:` payload; returns whether [DONE] arrived.
async function* sseEvents(response) {
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) break;
    buffer += decoder.decode(value, { stream: true });
    let cut;
    while ((cut = buffer.indexOf("\n\n")) >= 0) {
      const event = buffer.slice(0, cut);
      buffer = buffer.slice(cut + 2);
      const data = event.split("\n").filter((l) => l.startsWith("data:")).map((l) => l.slice(5).trimStart()).join("\n");
      if (data) yield data;
    }
  }
}

function applyDelta(reply, delta) {
  if (typeof delta.content === "string") reply.content += delta.content;
  if (typeof delta.reasoning_content === "string") reply.reasoning = (reply.reasoning || "") + delta.reasoning_content;
  for (const call of delta.tool_calls || []) {
    reply.tool_calls = reply.tool_calls || [];
    const i = Number.isInteger(call.index) ? call.index : reply.tool_calls.length;
    const slot = (reply.tool_calls[i] ||= { id: "", type: "function", function: { name: "", arguments: "" } });
    if (call.id) slot.id = call.id;
    if (call.function?.name) slot.function.name += call.function.name;
    if (call.function?.arguments) slot.function.arguments += call.function.arguments;
  }
}

async function generate(conv) {
  const reply = { role: "assistant", content: "" };
  const body = requestBody(conv); // the callers checked settingsOk() first
  conv.messages.push(reply);
  state.controller = new AbortController();
  renderAll();
  const replyIndex = conv.messages.length - 1;
  let finished = false;
  let streaming = false; // the server answered 200: a failure from here on cuts the stream
  try {
    const response = await api("/v1/chat/completions", {
      method: "POST", body: JSON.stringify(body), signal: state.controller.signal,
    });
    streaming = true;
    for await (const data of sseEvents(response)) {
      if (data === "[DONE]") {
        finished = true;
        break;
      }
      let chunk;
      try {
        chunk = JSON.parse(data);
      } catch {
        continue;
      }
      if (chunk.error) throw new ApiError(chunk.error.message || JSON.stringify(chunk.error), chunk.error.code || 0);
      const choice = chunk.choices?.[0];
      if (choice?.delta) applyDelta(reply, choice.delta);
      if (choice?.finish_reason === "length") reply.note = "stopped at max tokens";
      if (chunk.usage) reply.usage = chunk.usage;
      const node = $("messages").querySelector(`[data-index="${replyIndex}"]`);
      if (node) node.replaceWith(renderMessage(reply, replyIndex, conv));
      $("messages").scrollTop = $("messages").scrollHeight;
    }
    if (!finished) reply.error = "The connection dropped before the reply finished (the stream ended without [DONE]); what arrived is kept above.";
  } catch (e) {
    if (e.name === "AbortError") reply.note = "stopped";
    else if (streaming && !(e instanceof ApiError)) {
      reply.error = `The connection dropped before the reply finished (${e.message}); what arrived is kept above.`;
    } else reply.error = e.message;
  } finally {
    state.controller = null;
    if (conv.title === "New chat") {
      const first = conv.messages.find((m) => m.role === "user");
      if (first) conv.title = first.content.slice(0, 60) || "New chat";
    }
    saveConversations();
    renderAll();
  }
}

function sendFromComposer(ev) {
  ev?.preventDefault();
  if (state.controller) return;
  const text = $("input").value;
  if (!text.trim() || !settingsOk()) return; // the text stays in the box
  const conv = currentConversation() || newConversation();
  conv.messages.push({ role: "user", content: text });
  $("input").value = "";
  generate(conv);
}

// ---- placement ----

const SVG_NS = "http://www.w3.org/2000/svg";

// The server's picture as nodes: parsed as XML, scripts, foreign objects and event handlers
// dropped, so a hostile name in it could never run.
function safeSvg(text) {
  const doc = new DOMParser().parseFromString(text, "image/svg+xml");
  const root = doc.documentElement;
  if (root.namespaceURI !== SVG_NS || root.localName !== "svg") throw new Error("not an SVG picture");
  for (const el of root.querySelectorAll("script, foreignObject, a, image, use")) el.remove();
  for (const el of [root, ...root.querySelectorAll("*")]) {
    for (const attr of [...el.attributes]) {
      if (/^on/i.test(attr.name) || /href$/i.test(attr.name)) el.removeAttribute(attr.name);
    }
  }
  return document.importNode(root, true);
}

async function loadPlacement() {
  try {
    const [json, svg] = await Promise.all([
      api("/v1/plan").then((r) => r.json()),
      api("/v1/plan?format=svg").then((r) => r.text()),
    ]);
    $("plan-text").textContent = json.text;
    $("plan-picture").replaceChildren(safeSvg(svg));
  } catch (e) {
    const p = document.createElement("p");
    p.className = "error";
    p.textContent = `Could not load the plan: ${e.message}`;
    $("plan-picture").replaceChildren(p);
  }
}

// ---- live rates ----

const PLOTS = [
  { title: "Tokens/s", series: [["generation_tokens_per_s", "generated", "#2f6fde"], ["prompt_tokens_per_s", "prompt", "#e07b00"]] },
  { title: "Requests", series: [["running", "running", "#2f6fde"], ["waiting", "waiting", "#b3261e"]] },
  { title: "KV cache use (%)", series: [["kv_cache_usage", "in use", "#1e8e3e"]], scale: 100 },
  { title: "Time to first token (ms)", series: [["ttft_p50_s", "p50", "#2f6fde"], ["ttft_p90_s", "p90", "#e07b00"], ["ttft_p99_s", "p99", "#b3261e"]], scale: 1000 },
  { title: "Inter-token latency (ms)", series: [["itl_p50_s", "p50", "#2f6fde"], ["itl_p90_s", "p90", "#e07b00"], ["itl_p99_s", "p99", "#b3261e"]], scale: 1000 },
];
const PLOT_W = 320;
const PLOT_H = 100;
const WINDOW_S = 300;

function svgEl(name, attrs) {
  const el = document.createElementNS(SVG_NS, name);
  for (const [k, v] of Object.entries(attrs)) el.setAttribute(k, v);
  return el;
}

function fmt(v) {
  if (v === null || v === undefined) return "-";
  if (Number.isInteger(v)) return String(v);
  return v >= 100 ? v.toFixed(0) : v >= 10 ? v.toFixed(1) : v.toFixed(2);
}

function drawPlots(points) {
  const box = $("live-plots");
  box.replaceChildren();
  for (const plot of PLOTS) {
    const scale = plot.scale || 1;
    const values = plot.series.map(([key]) => points.map((p) => (p[key] == null ? null : p[key] * scale)));
    const max = Math.max(1e-9, ...values.flat().filter((v) => v !== null));
    const div = document.createElement("div");
    div.className = "plot";
    div.dataset.plot = plot.series[0][0];
    const h3 = document.createElement("h3");
    h3.textContent = `${plot.title} (max ${fmt(max)})`;
    const svg = svgEl("svg", { viewBox: `0 0 ${PLOT_W} ${PLOT_H}`, preserveAspectRatio: "none" });
    svg.append(svgEl("line", { x1: 0, y1: PLOT_H - 0.5, x2: PLOT_W, y2: PLOT_H - 0.5, stroke: "#ccc" }));
    const legend = document.createElement("div");
    legend.className = "legend";
    plot.series.forEach(([key, label, color], s) => {
      const coords = [];
      points.forEach((p, i) => {
        const v = values[s][i];
        if (v === null) return;
        const x = PLOT_W * (1 + p.t / WINDOW_S);
        coords.push(`${x.toFixed(1)},${(PLOT_H - 2 - (PLOT_H - 4) * (v / max)).toFixed(1)}`);
      });
      const line = svgEl("polyline", { points: coords.join(" "), fill: "none", stroke: color, "stroke-width": 1.5 });
      const present = values[s].filter((v) => v !== null);
      line.dataset.series = key;
      line.dataset.points = present.length;
      line.dataset.max = present.length ? Math.max(...present) : 0;
      svg.append(line);
      const item = document.createElement("span");
      item.style.color = color;
      item.textContent = `${label}: ${fmt(present.at(-1) ?? null)}`;
      legend.append(item);
    });
    div.append(h3, svg, legend);
    box.append(div);
  }
}

async function pollLive() {
  if (state.tab === "live") {
    try {
      const live = await (await api(`/v1/live?since=${WINDOW_S}`)).json();
      drawPlots(live.points);
      $("health").textContent = live.engine_healthy ? "engine running" : "engine stopped";
    } catch (e) {
      $("live-plots").replaceChildren(Object.assign(document.createElement("p"), { className: "error", textContent: `Could not load the rates: ${e.message}` }));
    }
  }
  setTimeout(pollLive, LIVE_POLL_MS);
}

// ---- tabs and start-up ----

function showTab(name) {
  state.tab = name;
  for (const b of document.querySelectorAll(".tab")) b.setAttribute("aria-selected", String(b.dataset.tab === name));
  for (const panel of document.querySelectorAll(".tab-panel")) panel.hidden = panel.id !== `tab-${name}`;
  if (name === "placement") loadPlacement();
}

async function loadModel() {
  try {
    const models = await (await api("/v1/models")).json();
    state.model = models.data?.[0]?.id ?? null;
    $("model-name").textContent = state.model || "";
    $("banner").hidden = true;
  } catch (e) {
    showBanner(e.message);
  }
}

function start() {
  loadSettings();
  state.currentId = state.conversations[0]?.id ?? null;
  for (const b of document.querySelectorAll(".tab")) b.addEventListener("click", () => showTab(b.dataset.tab));
  $("banner-close").addEventListener("click", () => ($("banner").hidden = true));
  $("composer").addEventListener("submit", sendFromComposer);
  $("input").addEventListener("keydown", (ev) => {
    if (ev.key === "Enter" && !ev.shiftKey) sendFromComposer(ev);
  });
  $("stop").addEventListener("click", () => state.controller?.abort());
  $("new-chat").addEventListener("click", () => {
    if (state.controller) return;
    newConversation();
    renderAll();
  });
  $("api-key").addEventListener("change", loadModel);
  $("clear-all").addEventListener("click", () => {
    state.conversations = [];
    state.currentId = null;
    saveConversations();
    renderAll();
  });
  renderAll();
  loadModel();
  pollLive();
}

start();
