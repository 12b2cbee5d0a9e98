// Mirror of megatronapp/scope_ui/protocol.py (version 2): message builders and the tensor frame decoder.
export const PROTOCOL_VERSION = 2;

export const hello = () => ({ type: "hello", version: PROTOCOL_VERSION });
export const view = (layer, head) => ({ type: "view", layer, head });
export const generate = (s) => ({ type: "generate", ...s });
export const perturb = (spec) => ({ type: "perturb", spec });
export const clearPerturbations = () => ({ type: "clear_perturbations" });
export const trainControl = (action) => ({ type: "train_control", action });

function f16ToF32(bits) {
  const s = bits & 0x8000 ? -1 : 1, e = (bits >> 10) & 0x1f, m = bits & 0x3ff;
  if (e === 0) return s * m * 2 ** -24;
  if (e === 31) return m ? NaN : s * Infinity;
  return s * (1 + m / 1024) * 2 ** (e - 15);
}

// [u32 LE header length][JSON TensorHeader][raw C-order data] -> {header, data: Float32Array | Int32Array}
export function decodeTensorFrame(buf) {
  const n = new DataView(buf).getUint32(0, true);
  const header = JSON.parse(new TextDecoder().decode(new Uint8Array(buf, 4, n)));
  const raw = buf.slice(4 + n);
  let data;
  if (header.dtype === "float32") data = new Float32Array(raw);
  else if (header.dtype === "int32") data = new Int32Array(raw);
  else data = Float32Array.from(new Uint16Array(raw), f16ToF32);
  return { header, data };
}
