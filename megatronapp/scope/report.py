"""`megatronapp scope report`: PNG pictures of a capture file, for people who would rather look.

    heatmap_SITE.png     |activation| (token x feature) of the first prompt at the first
                         step, one panel per captured layer
    attention_L.png      attention probabilities of layer L, one panel per head
    pca_SITE.png         2-D PCA of every captured token at SITE, one panel per layer
    topk.png             next-token probabilities of each step (top-k)
    index.md             what was drawn, with the capture's bytes/token

Data in, pixels out: this module reads the file (store.py) and draws; it computes nothing
but the PCA.
"""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only, no display
import matplotlib.pyplot as plt

from megatronapp.files import atomic_path, write_text_atomic
from megatronapp.scope.compress import CapturedItem
from megatronapp.scope.pca import compute_pca, token_rows
from megatronapp.scope.store import dequantized, load_capture

MAX_PANELS = 16


def _save(fig, path: Path) -> None:
    with atomic_path(path) as tmp:  # the temporary name keeps the .png suffix savefig reads
        fig.savefig(tmp, dpi=90, bbox_inches="tight")
    plt.close(fig)


def _grid(n: int):
    cols = min(n, 4)
    rows = -(-n // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(3.2 * cols, 2.6 * rows), squeeze=False)
    for ax in axes.flat[n:]:
        ax.axis("off")
    return fig, list(axes.flat)


def _first_step(items: list[CapturedItem], site: str) -> list[CapturedItem]:
    mine = [it for it in items if it.site == site]
    first = min((it.step for it in mine), default=None)
    return sorted((it for it in mine if it.step == first), key=lambda it: it.layer)[:MAX_PANELS]


def draw_heatmap(items, site: str, out: Path) -> Path | None:
    chosen = [it for it in _first_step(items, site) if it.dims[:2] == ("batch", "token")]
    if not chosen:
        return None
    fig, axes = _grid(len(chosen))
    for ax, it in zip(axes, chosen):
        ax.imshow(dequantized(it)[0].abs().numpy(), aspect="auto", cmap="magma")
        ax.set_title(f"{site} layer {it.layer}", fontsize=8)
        ax.set_xlabel(it.dims[-1], fontsize=7)
        ax.set_ylabel("token", fontsize=7)
    path = out / f"heatmap_{site}.png"
    _save(fig, path)
    return path


def draw_attention(items, out: Path) -> list[Path]:
    paths = []
    for it in _first_step(items, "attn_probs"):
        probs = dequantized(it)[0]  # (heads, S, T)
        n = min(probs.shape[0], MAX_PANELS)
        fig, axes = _grid(n)
        for h, ax in enumerate(axes[:n]):
            ax.imshow(probs[h].numpy(), cmap="viridis", vmin=0, vmax=1)
            ax.set_title(f"layer {it.layer} head {h}", fontsize=8)
        path = out / f"attention_{it.layer}.png"
        _save(fig, path)
        paths.append(path)
    return paths


def draw_pca(items, site: str, out: Path) -> Path | None:
    layers = sorted({it.layer for it in items if it.site == site and it.dims[:2] == ("batch", "token")})
    if not layers:
        return None
    fig, axes = _grid(min(len(layers), MAX_PANELS))
    for ax, layer in zip(axes, layers):
        rows = token_rows([it for it in items if it.site == site and it.layer == layer])
        coords, ratio = compute_pca(rows, 2)
        coords = coords if coords.shape[1] == 2 else coords.repeat(1, 2)
        ax.scatter(coords[:, 0].numpy(), coords[:, 1].numpy(), c=range(len(coords)), cmap="plasma", s=8)
        ax.set_title(f"{site} layer {layer} ({100 * float(ratio.sum()):.0f}% var)", fontsize=8)
    path = out / f"pca_{site}.png"
    _save(fig, path)
    return path


def draw_topk(items, out: Path) -> Path | None:
    steps = sorted((it for it in items if it.site == "topk"), key=lambda it: it.step)[:MAX_PANELS]
    if not steps:
        return None
    fig, axes = _grid(len(steps))
    for ax, it in zip(axes, steps):
        ax.bar([str(int(i)) for i in it.tensors["indices"][0]], it.tensors["data"][0].float().numpy())
        ax.set_title(f"step {it.step}: next-token top-k", fontsize=8)
        ax.tick_params(labelsize=6)
    path = out / "topk.png"
    _save(fig, path)
    return path


def render_report(capture_file, out_dir) -> list[Path]:
    """Draw every picture the capture supports into out_dir; returns the files written."""
    manifest, items = load_capture(capture_file)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    sites = sorted({it.site for it in items})
    written = [p for s in sites for p in (draw_heatmap(items, s, out),) if p]
    written += draw_attention(items, out)
    written += [p for s in ("residual", "attn_out", "mlp_out") if s in sites for p in (draw_pca(items, s, out),) if p]
    topk = draw_topk(items, out)
    written += [topk] if topk else []
    lines = [
        f"# MegaScope report: {capture_file}",
        "",
        f"{len(items)} items, {manifest.get('bytes_per_token', 0):.0f} bytes/token",
        "",
    ]
    lines += [f"![{p.stem}]({p.name})" for p in written]
    index = out / "index.md"
    write_text_atomic(index, "\n".join(lines) + "\n")
    return written + [index]
