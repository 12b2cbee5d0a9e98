// Token stream per run (clean / perturbed), top-k of the hovered or clicked token.
export function renderTokens(el, topkEl, state) {
  el.innerHTML = "";
  const div = state.compare ? state.compare.first_divergence : null;
  for (const [name, run] of Object.entries(state.runs)) {
    const line = document.createElement("div");
    line.className = "run"; line.dataset.run = name;
    line.innerHTML = `<span class="label">${name}</span>`;
    for (const t of run.prompt) line.append(span(t.text, "tok prompt"));
    run.tokens.forEach((t, i) => {
      const s = span(t.text, "tok gen" + (name === "perturbed" && div === i ? " diverge" : ""));
      s.dataset.step = String(i);
      if (state.selected && state.selected.run === name && state.selected.step === i) s.classList.add("sel");
      s.onmouseenter = () => showTopk(topkEl, t);
      s.onclick = () => { state.selected = { run: name, step: i }; state.view = name; showTopk(topkEl, t); };
      line.append(s);
    });
    if (run.done) line.append(` (${run.tokensPerS.toFixed(1)} tok/s)`);
    el.append(line);
  }
  if (state.selected) {
    const run = state.runs[state.selected.run];
    if (run && run.tokens[state.selected.step]) showTopk(topkEl, run.tokens[state.selected.step]);
  }
}

const show = (text) => JSON.stringify(text).slice(1, -1);

function span(text, cls) {
  const s = document.createElement("span");
  s.className = cls; s.textContent = show(text); return s;
}

function showTopk(el, tok) {
  el.innerHTML = `<b>step ${tok.step}: ${show(tok.text)}</b>`;
  const table = document.createElement("table");
  table.className = "topk-table";
  for (const c of tok.topk) {
    const tr = table.insertRow();
    tr.insertCell().textContent = show(c.text);
    tr.insertCell().textContent = c.p === null ? "nan" : c.p.toFixed(4);
    const bar = document.createElement("span");
    bar.className = "bar"; bar.style.width = `${Math.round(120 * (c.p || 0))}px`;
    tr.insertCell().append(bar);
  }
  el.append(table);
}
