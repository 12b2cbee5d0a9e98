// Head grid (one thumbnail per head of the selected layer) and the selected head's matrix with token labels.
import { paintGrid, seqRgb } from "./colormap.js";

const BLACK = [0, 0, 0], WHITE = [255, 255, 255];
function drawMatrix(ctx, rows, x0, y0, size) {
  const n = rows.length;
  ctx.fillStyle = "#fff"; ctx.fillRect(x0, y0, size, size);
  if (!n) return;
  paintGrid(ctx, n, n, x0, y0, size, size, (i, j) => {
    if (j >= rows[i].length) return WHITE;
    const v = rows[i][j];
    return Number.isFinite(v) ? seqRgb(v) : BLACK;  // NaN/inf (e.g. after a bit flip) in black
  });
}

export function renderAttention(gridEl, canvas, layerRows, head, labels, onPick) {
  const heads = layerRows ? layerRows.length : 0;
  if (gridEl.children.length !== heads) {
    gridEl.innerHTML = "";
    for (let h = 0; h < heads; h++) {
      const c = document.createElement("canvas");
      c.width = c.height = 64; c.title = `head ${h}`; c.dataset.head = String(h);
      c.onclick = () => onPick(h);
      gridEl.append(c);
    }
  }
  [...gridEl.children].forEach((c, h) => {
    c.classList.toggle("sel", h === head);
    drawMatrix(c.getContext("2d"), layerRows[h], 0, 0, 64);
  });
  const ctx = canvas.getContext("2d"), margin = 50, size = canvas.width - margin;
  ctx.clearRect(0, 0, canvas.width, canvas.height);
  const rows = layerRows && layerRows[head] ? layerRows[head] : [];
  drawMatrix(ctx, rows, margin, margin, size);
  canvas.dataset.rows = String(rows.length);
  canvas.dataset.checksum = String(rows.reduce((s, r, i) => s + r.reduce((a, v, j) => a + v * (i + 1) * (j + 2), 0), 0));
  ctx.fillStyle = "#333"; ctx.font = "10px monospace";
  const n = rows.length, cell = n ? size / n : 0;
  for (let i = 0; i < n && cell >= 7; i++) {
    const text = JSON.stringify(labels[i] ?? "").slice(1, -1).slice(0, 6);
    ctx.fillText(text, 2, margin + (i + 0.7) * cell);
    ctx.save(); ctx.translate(margin + (i + 0.7) * cell, margin - 2); ctx.rotate(-Math.PI / 2);
    ctx.fillText(text, 0, 0); ctx.restore();
  }
}
