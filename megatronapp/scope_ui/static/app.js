// MegaScope page: one WebSocket, one state object, views redraw from state (data in, pixels out).
import * as proto from "./protocol.js";
import { renderTokens } from "./views/tokens.js";
import { renderAttention } from "./views/attention.js";
import { renderHeatmap } from "./views/heatmap.js";
import { renderLens } from "./views/lens.js";
import { renderPca } from "./views/pca.js";
import { renderCompare } from "./views/compare.js";
import { setupPerturbPanel, renderPerturbations } from "./views/perturb.js";
import { setupTraining, renderTraining } from "./views/training.js";

const $ = (id) => document.getElementById(id);
const newRun = () => ({ prompt: [], tokens: [], attn: {}, resid: {}, done: false });
export const state = {
  welcome: null, role: "watcher", layer: 0, head: 0, selected: null, runs: {}, view: "clean",
  compare: null, perturbations: [], train: { steps: [], reruns: [], evals: [], probe: null, paused: false, probeAttn: {}, probeResid: {} },
};
window.__scope = { state, latencies: [], arrivals: [], draws: [], tokensSeen: 0 };

const token = new URLSearchParams(location.search).get("token");
const ws = new WebSocket(`ws://${location.host}/ws` + (token ? `?token=${encodeURIComponent(token)}` : ""));
ws.binaryType = "arraybuffer";
export const send = (msg) => ws.send(JSON.stringify(msg));

ws.onopen = () => { $("status").textContent = "connected"; send(proto.hello()); };
ws.onclose = () => { $("status").textContent = "disconnected"; };
ws.onmessage = (ev) => {
  if (ev.data instanceof ArrayBuffer) return onTensor(proto.decodeTensorFrame(ev.data));
  const msg = JSON.parse(ev.data);
  (handlers[msg.type] || (() => {}))(msg);
};

// Rows `start ..` of a (B, heads, S, T) attention frame or a (B, S, W) residual frame of one
// layer: the layer's rows are cut at `start`, then appended (a merged frame of several steps,
// a refill from 0 and a probe all land right).
function onTensor({ header, data }) {
  const h = header, run = h.run === "probe" ? null : (state.runs[h.run] ||= newRun());
  const store = h.site === "attn_probs" ? (run ? run.attn : state.train.probeAttn) : (run ? run.resid : state.train.probeResid);
  if (h.site === "attn_probs") {
    const [, heads, s, t] = h.shape;
    const rows = (store[h.layer] ||= Array.from({ length: heads }, () => []));
    for (let hd = 0; hd < heads; hd++) {
      rows[hd].length = Math.min(rows[hd].length, h.start);
      for (let i = 0; i < s; i++) rows[hd].push(data.subarray((hd * s + i) * t, (hd * s + i + 1) * t));
    }
  } else if (h.site === "residual") {
    const [, s, width] = h.shape;
    const rows = (store[h.layer] ||= []);
    rows.length = Math.min(rows.length, h.start);
    for (let i = 0; i < s; i++) rows.push(data.subarray(i * width, (i + 1) * width));
  }
  // a live run's rows are drawn with its tokens (they follow); probe and refill rows have none
  if (!run || run.done) scheduleDraw();
}

const handlers = {
  welcome(m) {
    state.welcome = m; state.role = m.role; state.perturbations = m.perturbations;
    $("role").textContent = m.role; $("model-info").textContent =
      `${m.model.num_layers} layers × ${m.model.num_heads} heads, hidden ${m.model.hidden_size}`;
    document.querySelectorAll(".mode-generate").forEach((e) => (e.hidden = m.mode !== "generate"));
    document.querySelectorAll(".mode-train").forEach((e) => (e.hidden = m.mode !== "train"));
    fillSelect($("layer"), m.model.num_layers, state.layer); fillSelect($("head"), m.model.num_heads, state.head);
    setupPerturbPanel($("perturb-panel"), m, send);
    if (m.mode === "train") setupTraining(send);
    sendView();
    draw();
  },
  role(m) { state.role = m.role; $("role").textContent = m.role; },
  run_start(m) {
    if (m.run === "clean") { state.runs = {}; state.compare = null; }
    const run = (state.runs[m.run] = newRun());
    run.prompt = m.prompt_tokens.map((id, i) => ({ id, text: m.prompt_text[i] }));
    state.view = m.run; draw();
  },
  tokens(m) {  // every token not sent before, in order (several when this tab fell behind)
    for (const t of m.tokens) (state.runs[t.run] ||= newRun()).tokens.push(t);
    window.__scope.tokensSeen += m.tokens.length;
    const arrived = performance.timeOrigin + performance.now();
    for (const t of m.tokens) t.arrived = arrived;
    unmarked.push(...m.tokens);
    scheduleDraw();  // one draw per animation frame, however many tokens came in since the last
  },
  run_end(m) { const run = state.runs[m.run]; if (run) { run.done = true; run.tokensPerS = m.tokens_per_s; } draw(); },
  compare(m) { state.compare = m; draw(); },
  perturbations(m) { state.perturbations = m.active; renderPerturbations($("perturb-panel"), state); },
  train_step(m) { state.train.steps.push(m); scheduleDraw(); },
  train_rerun(m) { state.train.reruns.push(m); scheduleDraw(); },
  train_eval(m) { state.train.evals.push(m); scheduleDraw(); },
  probe(m) { state.train.probe = m; scheduleDraw(); },
  train_state(m) { Object.assign(state.train, { paused: m.paused, waiting: m.waiting, iteration: m.iteration }); scheduleDraw(); },
  error(m) {
    const div = document.createElement("div");
    div.textContent = `error (${m.code}): ${m.message}`;
    $("errors").prepend(div);
  },
};

function fillSelect(sel, n, value) {
  sel.innerHTML = "";
  for (let i = 0; i < n; i++) sel.add(new Option(String(i), String(i), false, i === value));
}

// Tokens drawn by the next frame's draw: their token->pixels latency is read right after that
// draw (the canvases and DOM are updated; the frame paints next).
const unmarked = [];
let pending = false;
function scheduleDraw() { if (!pending) { pending = true; requestAnimationFrame(drawFrame); } }
function drawFrame() {
  pending = false;
  const start = performance.timeOrigin + performance.now();
  draw();
  const now = performance.timeOrigin + performance.now();
  if (unmarked.length) window.__scope.draws.push(now - start);
  for (const t of unmarked.splice(0)) {
    performance.mark(`token-${t.run}-${t.step}`);
    window.__scope.latencies.push(now - t.t_server_ms);
    window.__scope.arrivals.push(t.arrived - t.t_server_ms);  // server -> page; the rest waits for a frame and draws
  }
}

export function draw() {
  if (!state.welcome) return;
  const train = state.welcome.mode === "train";
  const run = train ? null : state.runs[state.view] || state.runs.clean;
  const attn = train ? state.train.probeAttn : run ? run.attn : {};
  const resid = train ? state.train.probeResid : run ? run.resid : {};
  const labels = train ? (state.train.probe ? state.train.probe.prompt_text : [])
    : run ? [...run.prompt.map((t) => t.text), ...run.tokens.map((t) => t.text)] : [];
  renderAttention($("head-grid"), $("attn-matrix"), attn[state.layer], state.head, labels, (h) => {
    state.head = h; $("head").value = String(h); sendView(); draw();
  });
  renderHeatmap($("heatmap"), resid[state.layer]);
  renderPca($("pca"), resid[state.layer]);
  if (train) return renderTraining(state.train);
  renderTokens($("runs"), $("topk"), state);
  renderLens($("lens"), run);
  renderCompare($("compare"), state);
}

// The server captures and sends the shown layer only (a layer switch after a run is refilled).
const sendView = () => send(proto.view(state.layer, state.head));
$("layer").onchange = (e) => { state.layer = Number(e.target.value); sendView(); draw(); };
$("head").onchange = (e) => { state.head = Number(e.target.value); sendView(); draw(); };
$("generate").onclick = () => send(proto.generate({
  prompt: $("prompt").value, max_new_tokens: Number($("max-new-tokens").value), greedy: $("greedy").checked,
  temperature: Number($("temperature").value), top_k: Number($("top-k").value), top_p: Number($("top-p").value),
  seed: Number($("seed").value),
}));
