// PCA scatter of the selected layer's residual rows (one point per token), coloured by position.
// Two principal axes by power iteration with deflation on the centred rows. Each redraw adds a
// row or so, so the axes barely move: the previous draw's axes start a few iterations (which
// also keeps the picture from flipping sign); a cold start iterates 50 times.

let previous = null;
function topAxes(rows, k) {
  const n = rows.length, d = rows[0].length, mean = new Float64Array(d);
  for (const r of rows) for (let j = 0; j < d; j++) mean[j] += r[j] / n;
  const x = rows.map((r) => Float64Array.from(r, (v, j) => (Number.isFinite(v) ? v - mean[j] : 0)));
  const axes = [];
  for (let a = 0; a < k; a++) {
    const warm = previous && previous[a] && previous[a].length === d;
    let v = warm ? previous[a] : Float64Array.from({ length: d }, (_, j) => Math.sin(j * 12.9898 + a * 78.233));
    for (let it = 0; it < (warm ? 8 : 50); it++) {
      const w = new Float64Array(d);
      for (const r of x) { let s = 0; for (let j = 0; j < d; j++) s += r[j] * v[j]; for (let j = 0; j < d; j++) w[j] += s * r[j]; }
      for (const u of axes) { let s = 0; for (let j = 0; j < d; j++) s += w[j] * u[j]; for (let j = 0; j < d; j++) w[j] -= s * u[j]; }
      const norm = Math.hypot(...w) || 1;
      v = w.map((e) => e / norm);
    }
    axes.push(v);
  }
  previous = axes;
  return x.map((r) => axes.map((u) => r.reduce((s, e, j) => s + e * u[j], 0)));
}

export function renderPca(svg, rows) {
  svg.innerHTML = "";
  if (!rows || rows.length < 2) return;
  const pts = topAxes(rows, 2), W = +svg.getAttribute("width"), H = +svg.getAttribute("height");
  const xs = pts.map((p) => p[0]), ys = pts.map((p) => p[1]);
  const [x0, x1, y0, y1] = [Math.min(...xs), Math.max(...xs), Math.min(...ys), Math.max(...ys)];
  const sx = (v) => 15 + ((v - x0) / (x1 - x0 || 1)) * (W - 30), sy = (v) => H - 15 - ((v - y0) / (y1 - y0 || 1)) * (H - 30);
  const ns = "http://www.w3.org/2000/svg";
  pts.forEach((p, i) => {
    const c = document.createElementNS(ns, "circle");
    c.setAttribute("cx", sx(p[0])); c.setAttribute("cy", sy(p[1])); c.setAttribute("r", 4);
    c.setAttribute("fill", `hsl(${Math.round((240 * i) / (pts.length - 1))},70%,50%)`);
    const t = document.createElementNS(ns, "title"); t.textContent = `position ${i}`; c.append(t);
    svg.append(c);
  });
}
