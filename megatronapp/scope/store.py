"""Capture files: a safetensors file of every captured tensor plus a JSON manifest.

    FILE             safetensors; tensor "ITEM/KEY" (e.g. "step0/layer1/q/data"), the manifest
                     also stored as its "manifest" metadata entry
    FILE.json        the same manifest, for people and tools without safetensors

Both are written to temp names and renamed. Loading reads JSON and tensors only (no pickle).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from megatronapp.files import atomic_path, write_text_atomic
from megatronapp.scope.compress import CapturedItem


def save_capture(path, manifest: dict, items: list[CapturedItem], extra: dict | None = None) -> None:
    """Write `items` and `manifest` (plus `extra` manifest fields, e.g. prompts) to `path`."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    manifest = {**manifest, **(extra or {})}
    tensors = {f"{it.name}/{k}": t.detach().cpu().clone().contiguous() for it in items for k, t in it.tensors.items()}
    text = json.dumps(manifest)
    with atomic_path(path) as tmp:
        save_file(tensors, str(tmp), metadata={"manifest": text})
    write_text_atomic(path.with_name(path.name + ".json"), json.dumps(manifest, indent=1))


def load_capture(path) -> tuple[dict, list[CapturedItem]]:
    """(manifest, items) of a capture file; ValueError in one line when it is not one."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"capture file {path} does not exist")
    try:
        from safetensors import safe_open

        with safe_open(str(path), framework="pt") as f:
            manifest = json.loads((f.metadata() or {})["manifest"])
        tensors = load_file(str(path))
    except Exception as e:  # safetensors raises its own error types for foreign files
        raise ValueError(f"{path} is not a MegaScope capture file ({type(e).__name__})") from None
    items = []
    for m in manifest["items"]:
        keys = {k: tensors[f"{m['name']}/{k}"] for k in m["tensors"]}
        items.append(CapturedItem(m["name"], m["site"], m["step"], m["layer"], tuple(m["dims"]), keys, m["ops"]))
    return manifest, items


def dequantized(item: CapturedItem) -> torch.Tensor:
    """The item's data as fp32 (int8 data multiplied back by its scale)."""
    data = item.tensors["data"]
    if "scale" in item.tensors:
        return data.float() * item.tensors["scale"]
    return data.float()
