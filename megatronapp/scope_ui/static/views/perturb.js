// Perturbation panel: every scope perturbation kind, targets from the model's structure, seed shown and reusable.
import { perturb, clearPerturbations } from "../protocol.js";

const ints = (s) => (s.trim() === "" ? null : s.split(",").map((x) => Number(x.trim())));

export function setupPerturbPanel(el, welcome, send) {
  const m = welcome.model;
  const opt = (xs) => xs.map((x) => `<option>${x}</option>`).join("");
  el.innerHTML = `
    <label>kind <select id="p-kind">${opt(welcome.perturbation_kinds)}</select></label>
    <label>site <select id="p-site">${opt(welcome.sites)}</select></label>
    <label>layers <input id="p-layers" placeholder="all" value="0"></label>
    <label>heads <input id="p-heads" placeholder="all"></label>
    <label>positions <input id="p-positions" placeholder="all"></label>
    <label>channels <input id="p-channels" placeholder="all"></label>
    <label>steps <input id="p-steps" placeholder="all"></label>
    <label>param <select id="p-param">${opt(Object.keys(m.params))}</select></label>
    <label>indices <input id="p-indices" placeholder="0,1"></label><br>
    <label>format <select id="p-format"><option value="">tensor's</option>${opt(welcome.bit_formats)}</select></label>
    <label>bits <input id="p-bits" value="30"></label>
    <label>field <select id="p-field"><option value="">(bits)</option>${opt(welcome.bit_fields)}</select></label>
    <label>num bits <input id="p-num-bits" value="1"></label>
    <label>stuck <input id="p-stuck" value="0"></label>
    <label>sigma <input id="p-sigma" value="0.1"></label>
    <label>low <input id="p-low" value="0.9"></label> <label>high <input id="p-high" value="1.1"></label>
    <label>value <input id="p-value" value="1.0"></label>
    <label>rate <input id="p-rate" placeholder="all"></label>
    <label>seed <input id="p-seed" placeholder="random"></label>
    <button id="p-add">Apply</button> <button id="p-clear">Clear all</button>
    <div id="p-active"></div>`;
  const v = (id) => el.querySelector("#" + id).value;
  el.querySelector("#p-kind").value = "bitflip";
  el.querySelector("#p-site").value = "residual";
  el.querySelector("#p-add").onclick = () => {
    const kind = v("p-kind"), site = v("p-site");
    const target = site === "param" ? { site, param: v("p-param"), indices: ints(v("p-indices")) }
      : { site, layers: ints(v("p-layers")), heads: ints(v("p-heads")), positions: ints(v("p-positions")),
          channels: ints(v("p-channels")), steps: ints(v("p-steps")) };
    const spec = { kind, target };
    if (v("p-seed") !== "") spec.seed = Number(v("p-seed"));
    if (v("p-rate") !== "") spec.rate = Number(v("p-rate"));
    if (kind === "gaussian") spec.sigma = Number(v("p-sigma"));
    if (kind === "uniform") { spec.low = Number(v("p-low")); spec.high = Number(v("p-high")); }
    if (kind === "offset") spec.value = Number(v("p-value"));
    if (kind === "special") spec.value = v("p-value");
    if (kind === "bitflip" || kind === "stuck_at") {
      if (v("p-format")) spec.format = v("p-format");
      if (v("p-field")) { spec.field = v("p-field"); spec.num_bits = Number(v("p-num-bits")); } else spec.bits = ints(v("p-bits"));
      if (kind === "stuck_at") spec.stuck = Number(v("p-stuck"));
    }
    send(perturb(spec));
  };
  el.querySelector("#p-clear").onclick = () => send(clearPerturbations());
  renderPerturbations(el, { perturbations: welcome.perturbations });
}

export function renderPerturbations(el, state) {
  const box = el.querySelector("#p-active");
  if (!box) return;
  box.innerHTML = "";
  for (const s of state.perturbations) {
    const row = document.createElement("div");
    row.className = "active-perturbation";
    const t = s.target;
    row.textContent = `${s.kind} @ ${t.site}${t.param ? " " + t.param : ""} layers=${t.layers ?? "all"} positions=${t.positions ?? "all"} seed=${s.seed}`;
    const reuse = document.createElement("button");
    reuse.textContent = "reuse seed";
    reuse.onclick = () => (el.querySelector("#p-seed").value = String(s.seed));
    row.append(" ", reuse);
    box.append(row);
  }
  if (!state.perturbations.length) box.textContent = "none active (changes apply from the next token / training step)";
}
