// Heatmap of the selected layer's residual (or whatever features arrived, after compression): tokens × features.
import { divRgb, paintGrid } from "./colormap.js";

export function renderHeatmap(canvas, rows) {
  const ctx = canvas.getContext("2d");
  ctx.clearRect(0, 0, canvas.width, canvas.height);
  if (!rows || !rows.length) return;
  let scale = 1e-12;
  for (const r of rows) for (const v of r) if (Number.isFinite(v)) scale = Math.max(scale, Math.abs(v));
  paintGrid(ctx, rows.length, rows[0].length, 0, 0, canvas.width, canvas.height, (i, j) => {
    const v = rows[i][j];
    return Number.isFinite(v) ? divRgb(v / scale) : [0, 0, 0];
  });
}
