// Logit lens: for each generated token, each layer's top token of the newest column.
export function renderLens(el, run) {
  el.innerHTML = "";
  if (!run || !run.tokens.length) return;
  const table = document.createElement("table");
  const layers = run.tokens[0].lens.length;
  const head = table.insertRow();
  head.insertCell().textContent = "layer \\ step";
  run.tokens.forEach((t) => (head.insertCell().textContent = String(t.step)));
  for (let l = 0; l < layers; l++) {
    const tr = table.insertRow();
    tr.insertCell().textContent = String(l);
    for (const t of run.tokens) {
      const e = t.lens[l], td = tr.insertCell();
      td.textContent = JSON.stringify(e.text).slice(1, -1);
      td.title = `p=${e.p}`;
      td.style.background = `rgba(21,101,192,${Math.min(1, (e.p || 0) * 3).toFixed(2)})`;
    }
  }
  el.append(table);
}
