// Training view: loss (and validation loss) / LR / grad-norm curves, per-layer weight and gradient norms, a flagged step against
// its rerun, probe top-k, controls.
import { trainControl } from "../protocol.js";

const $ = (id) => document.getElementById(id);

export function setupTraining(send) {
  $("pause").onclick = () => send(trainControl("pause"));
  $("resume").onclick = () => send(trainControl("resume"));
  $("step").onclick = () => send(trainControl("step"));
}

const finitePoints = (xs, ys) => ys.map((y, i) => [xs[i], y]).filter(([, y]) => Number.isFinite(y));

// One series, or two on shared axes (`second`: {xs, ys, label}, e.g. validation loss beside the training loss,
// drawn with dots: it has a point every --eval-interval steps).
function curve(svg, xs, ys, label, second = null) {
  const W = +svg.getAttribute("width"), H = +svg.getAttribute("height");
  const ok = finitePoints(xs, ys), more = second ? finitePoints(second.xs, second.ys) : [];
  svg.dataset.points = String(ok.length);
  svg.dataset.secondPoints = String(more.length);
  const all = ok.concat(more);
  if (!all.length) { svg.innerHTML = ""; return; }
  const x0 = Math.min(...all.map((p) => p[0])), x1 = Math.max(...all.map((p) => p[0]));
  const lo = Math.min(...all.map((p) => p[1])), hi = Math.max(...all.map((p) => p[1]));
  const sx = (x) => 40 + ((x - x0) / (x1 - x0 || 1)) * (W - 50), sy = (y) => H - 20 - ((y - lo) / (hi - lo || 1)) * (H - 40);
  const path = (pts) => pts.map(([x, y], i) => `${i ? "L" : "M"}${sx(x).toFixed(1)},${sy(y).toFixed(1)}`).join("");
  const title = ok.length ? `${label}: ${ok[ok.length - 1][1].toPrecision(4)}` : label;
  const title2 = more.length ? `<tspan fill="#e65100">  ${second.label}: ${more[more.length - 1][1].toPrecision(4)}</tspan>` : "";
  svg.innerHTML = `<text x="40" y="12" font-size="11">${title}${title2}</text>` +
    `<text x="2" y="${H - 20}" font-size="9">${lo.toPrecision(3)}</text><text x="2" y="28" font-size="9">${hi.toPrecision(3)}</text>` +
    (ok.length ? `<path d="${path(ok)}" fill="none" stroke="#1565c0" stroke-width="1.5"/>` : "") +
    (more.length ? `<path class="second" d="${path(more)}" fill="none" stroke="#e65100" stroke-width="1.5"/>` +
      more.map(([x, y]) => `<circle cx="${sx(x).toFixed(1)}" cy="${sy(y).toFixed(1)}" r="2.5" fill="#e65100"/>`).join("") : "");
}

function bars(title, values) {
  const max = Math.max(1e-12, ...values.filter(Number.isFinite));
  return `<div><b>${title}</b>` + values.map((v, l) =>
    `<div>layer ${l} <span class="bar" style="width:${Math.round(150 * Math.min(1, v / max))}px"></span> ${v.toPrecision(3)}</div>`).join("") + "</div>";
}

// Flagged steps (--rerun-mode validate_results): one line each, and the latest one's flagged execution
// against its rerun, per layer.
function rerunStats(reruns) {
  const r = reruns[reruns.length - 1];
  if (!r) return "";
  const line = (m) => `<div>step ${m.iteration + 1} flagged (${m.flags.join(", ")}): ${m.verdict}` +
    `${m.ranks.length ? ` on ranks ${m.ranks.join(", ")}` : ""}</div>`;
  const ratio = r.layer_grad_norms_flagged.map((g, l) => g / Math.max(1e-12, r.layer_grad_norms_rerun[l]));
  return `<div id="rerun-stats" data-count="${reruns.length}"><b>flagged steps</b>${reruns.slice(-10).map(line).join("")}` +
    `<div class="grid">${bars(`step ${r.iteration + 1}: grad norm, flagged / rerun`, ratio)}` +
    `${bars("activation RMS, rerun", r.layer_act_rms_rerun)}</div></div>`;
}

export function renderTraining(train) {
  const it = train.steps.map((s) => s.iteration);
  const valid = train.evals.filter((e) => e.split === "valid");
  curve($("loss-curve"), it, train.steps.map((s) => s.loss), "loss",
    { xs: valid.map((e) => e.iteration), ys: valid.map((e) => e.loss), label: "validation" });
  curve($("lr-curve"), it, train.steps.map((s) => s.lr), "lr");
  curve($("gn-curve"), it, train.steps.map((s) => s.grad_norm), "grad norm");
  const last = train.steps[train.steps.length - 1];
  $("train-state").textContent = train.paused ? `paused at ${train.iteration ?? last?.iteration}` : `running (step ${last ? last.iteration : 0})`;
  $("train-state").dataset.paused = String(train.paused);
  $("train-state").dataset.waiting = String(Boolean(train.paused && train.waiting));
  $("layer-stats").innerHTML = (last ? `<div class="grid">${bars("weight norm", last.layer_weight_norms)}${bars("grad norm", last.layer_grad_norms)}</div>` : "") + rerunStats(train.reruns);
  const p = train.probe;
  if (p) {
    const act = p.layer_act_std.map((s, l) => `layer ${l}: mean ${p.layer_act_mean[l].toPrecision(3)} std ${s.toPrecision(3)}`).join("<br>");
    $("probe").innerHTML = `<b>probe at step ${p.iteration}</b> next token: ` +
      p.topk.map((t) => `${JSON.stringify(t.text)} ${t.p.toFixed(3)}`).join(", ") + `<br>${act}`;
  }
}
