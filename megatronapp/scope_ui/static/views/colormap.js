// Shared colour scale: value in [0, 1] -> CSS rgb (white -> blue -> dark), and diverging for signed data.
export function seq(v) {
  v = Math.max(0, Math.min(1, v || 0));
  return `rgb(${Math.round(255 * (1 - v))},${Math.round(255 * (1 - 0.6 * v))},${Math.round(255 - 90 * v)})`;
}
export function div(v) {  // v in [-1, 1]
  v = Math.max(-1, Math.min(1, v || 0));
  const a = Math.round(255 * (1 - Math.abs(v)));
  return v >= 0 ? `rgb(255,${a},${a})` : `rgb(${a},${a},255)`;
}
