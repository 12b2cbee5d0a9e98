// Clean vs perturbed: first diverging token and per-layer residual difference norms.
export function renderCompare(el, state) {
  el.innerHTML = "";
  const c = state.compare;
  if (!c) { el.textContent = state.perturbations.length ? "generate to compare" : "set a perturbation to compare runs"; return; }
  const p = document.createElement("div");
  p.id = "divergence";
  p.textContent = c.first_divergence === null ? "no divergence: same tokens" : `first diverging token: step ${c.first_divergence}`;
  el.append(p);
  const finite = c.layer_diff_norms.filter((v) => v < 1e29);
  const max = Math.max(1e-12, ...finite);
  c.layer_diff_norms.forEach((v, l) => {
    const row = document.createElement("div"), bar = document.createElement("span");
    bar.className = "bar"; bar.style.width = `${Math.round(200 * Math.min(1, v / max))}px`;
    if (v >= 1e29) bar.style.background = "#c62828";
    row.append(`layer ${l} `, bar, ` ${v >= 1e29 ? "inf/nan" : v.toExponential(2)}`);
    el.append(row);
  });
}
