// Heatmap of the selected layer's residual (or whatever features arrived, after compression): tokens × features.
import { div } from "./colormap.js";

export function renderHeatmap(canvas, rows) {
  const ctx = canvas.getContext("2d");
  ctx.clearRect(0, 0, canvas.width, canvas.height);
  if (!rows || !rows.length) return;
  let scale = 1e-12;
  for (const r of rows) for (const v of r) if (Number.isFinite(v)) scale = Math.max(scale, Math.abs(v));
  const ch = canvas.height / rows.length, cw = canvas.width / rows[0].length;
  rows.forEach((r, i) => r.forEach((v, j) => {
    ctx.fillStyle = Number.isFinite(v) ? div(v / scale) : "#000";
    ctx.fillRect(j * cw, i * ch, Math.ceil(cw), Math.ceil(ch));
  }));
}
