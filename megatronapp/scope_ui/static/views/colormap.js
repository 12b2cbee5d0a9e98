// Shared colour scales: value in [0, 1] -> white -> blue -> dark, and diverging for signed data;
// as CSS strings, or as [r, g, b] for `paintGrid` (one ImageData per grid, scaled by drawImage:
// far cheaper than a fillRect per cell when a grid is redrawn every token).
export function seqRgb(v) {
  v = Math.max(0, Math.min(1, v || 0));
  return [Math.round(255 * (1 - v)), Math.round(255 * (1 - 0.6 * v)), Math.round(255 - 90 * v)];
}
export function divRgb(v) {  // v in [-1, 1]
  v = Math.max(-1, Math.min(1, v || 0));
  const a = Math.round(255 * (1 - Math.abs(v)));
  return v >= 0 ? [255, a, a] : [a, a, 255];
}
export const seq = (v) => `rgb(${seqRgb(v).join(",")})`;
export const div = (v) => `rgb(${divRgb(v).join(",")})`;

const scratch = document.createElement("canvas");
// Cells (i, j) of a rows x cols grid, coloured by rgbOf(i, j) ([r, g, b] or null for background),
// drawn into ctx's rectangle (x0, y0, w, h), unsmoothed.
export function paintGrid(ctx, rows, cols, x0, y0, w, h, rgbOf) {
  if (!rows || !cols) return;
  scratch.width = cols; scratch.height = rows;
  const sctx = scratch.getContext("2d"), img = sctx.createImageData(cols, rows), px = img.data;
  for (let i = 0; i < rows; i++) for (let j = 0; j < cols; j++) {
    const c = rgbOf(i, j), o = 4 * (i * cols + j);
    if (c) { px[o] = c[0]; px[o + 1] = c[1]; px[o + 2] = c[2]; px[o + 3] = 255; }
  }
  sctx.putImageData(img, 0, 0);
  ctx.imageSmoothingEnabled = false;
  ctx.drawImage(scratch, x0, y0, w, h);
}
