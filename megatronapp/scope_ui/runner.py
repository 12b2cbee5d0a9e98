"""The model side of the UI: generation streamed token by token with MegaScope captures, the
perturbation list, and clean-vs-perturbed comparison. Runs in ONE worker thread that owns the
model; results leave through `emit(message)` / `emit_tensor(header, bytes)` callbacks.

Built only on scope I's public API (scope.capture, scope.perturb, specs) and
inference.generate, so UI tokens are exactly `megatronapp generate`'s: the same generate()
with the same SamplingConfig. Two adapters bridge what that API does not expose:
`_TokenTap` sees each sampled token as the input of the next forward step, and
`_flush_capture` finishes the capture's queued host copies at the end of a step (the capture
otherwise builds its items only when they are read) so the page gets a step's tensors with
its token.
"""

from __future__ import annotations

import math
import random
import time
from contextlib import ExitStack

import torch

from megatronapp.config import ConfigError
from megatronapp.inference.generate import SamplingConfig, generate
from megatronapp.scope import capture, perturb
from megatronapp.scope.bits import FORMATS
from megatronapp.scope.specs import KINDS, PerturbSpecError, perturbation_from_dict, validate_perturbation
from megatronapp.scope.sites import PERTURB_SITES
from megatronapp.scope.target import resolve_target
from megatronapp.scope_ui import protocol as P

STREAM_SITES = ("attn_probs", "residual")  # sent as tensor frames, per layer and step
CAPTURE_SITES = STREAM_SITES + ("topk", "logit_lens")
TOPK = 5


def describe_model(cfg, param_shapes: dict) -> dict:
    """Model structure the perturbation panel builds its target pickers from."""
    return {"num_layers": cfg.num_layers, "num_heads": cfg.num_attention_heads, "hidden_size": cfg.hidden_size,
            "head_dim": cfg.head_dim, "ffn_size": cfg.ffn_size, "seq_length": cfg.seq_length,
            "params": {name: list(shape) for name, shape in sorted(param_shapes.items())}}


def welcome_fields(info: dict) -> dict:
    return {"model": info, "sites": list(PERTURB_SITES) + ["param"], "perturbation_kinds": list(KINDS),
            "bit_formats": list(FORMATS), "bit_fields": ["sign", "exponent", "mantissa"]}


class PerturbationSet:
    """The active perturbations (scope specs), validated against the model before adding."""

    def __init__(self, cfg, param_shapes: dict, limit: int):
        self.cfg, self.shapes, self.limit, self.specs = cfg, param_shapes, limit, []

    def add(self, data: dict):
        """Validated spec from `data` (a seed is drawn and recorded when none is given); ProtocolError."""
        if len(self.specs) >= self.limit:
            raise P.ProtocolError("refused", f"at most {self.limit} perturbations at once")
        if not isinstance(data.get("target"), dict):
            raise P.ProtocolError("refused", "perturbation: 'target' must be an object")
        data = dict(data)
        data.setdefault("seed", random.SystemRandom().randrange(2**31))
        try:
            spec = perturbation_from_dict(data)
            validate_perturbation(spec, self.cfg, self.shapes)
        except (PerturbSpecError, TypeError, ValueError) as e:
            raise P.ProtocolError("refused", f"perturbation: {e}") from None
        self.specs.append(spec)
        return spec

    def clear(self) -> None:
        self.specs = []

    def as_dicts(self) -> list[dict]:
        import json

        return [json.loads(s.to_json()) for s in self.specs]


class _TokenTap:
    """Stands in for the InferenceModel inside generate(): the tokens of step s are the input of
    step s+1, so they are reported as soon as generate() feeds them back."""

    def __init__(self, model, on_tokens):
        self._model, self._on_tokens = model, on_tokens

    def forward_step(self, tokens):
        if self._model.step > 0:
            self._on_tokens(self._model.step - 1, tokens)
        return self._model.forward_step(tokens)

    def __getattr__(self, name):
        return getattr(self._model, name)


def _flush_capture(cap) -> None:
    cap._finish_transfer()  # scope I exposes no public flush; this is its own end-of-step work


class _StepStream:
    """Observer after the Capture: at each step end, send the step's tensors and keep its top-k /
    logit lens for the token message."""

    def __init__(self, cap, run: str, emit_tensor, decode):
        self.cap, self.run, self.emit_tensor, self.decode = cap, run, emit_tensor, decode
        self.seen, self.step_info = 0, {}

    def step_begin(self, model) -> None:
        pass

    def step_end(self, model, logits) -> None:
        _flush_capture(self.cap)
        for item in self.cap.items[self.seen:]:
            if item.site in STREAM_SITES:
                self._send(item)
            elif item.site == "topk":
                self.step_info.setdefault(item.step, {})["topk"] = self._entries(item.tensors, 0, exp=False)
            elif item.site == "logit_lens":  # (layers, batch, k): row 0, top entry per layer
                t = item.tensors
                self.step_info.setdefault(item.step, {})["lens"] = self._top_entries(
                    t["data"][:, 0, 0], t["indices"][:, 0, 0], exp=True)
        self.seen = len(self.cap.items)

    def _entries(self, tensors, row: int, exp: bool) -> list[P.TopEntry]:
        return self._top_entries(tensors["data"][row], tensors["indices"][row], exp)

    def _top_entries(self, values, ids, exp: bool) -> list[P.TopEntry]:
        values = values.float().exp() if exp else values.float()
        return [P.TopEntry(id=i, text=self.decode([i]), p=v) for v, i in zip(values.tolist(), ids.tolist())]

    def _send(self, item) -> None:
        data = item.tensors["data"].contiguous().cpu()
        header = P.TensorHeader(run=self.run, step=item.step, site=item.site, layer=item.layer,
                                dims=list(item.dims), dtype=str(data.dtype).removeprefix("torch."),
                                shape=list(data.shape), compression=list(item.ops))
        self.emit_tensor(header, data.numpy().tobytes())


class GenerationRunner:
    """Owns an InferenceModel (one process) and a tokenizer; call `run` from one thread only."""

    mode = "generate"

    def __init__(self, model, tokenizer, limits: P.Limits):
        self.model, self.tokenizer, self.limits = model, tokenizer, limits
        shapes = resolve_target(model).full_param_shapes()
        self.info = describe_model(model.cfg, shapes)
        self.perturbations = PerturbationSet(model.cfg, shapes, limits.max_perturbations)

    def welcome_fields(self) -> dict:
        return welcome_fields(self.info)

    def backlog(self) -> list:
        return []

    def sampling(self, msg: P.Generate) -> SamplingConfig:
        return SamplingConfig(max_new_tokens=msg.max_new_tokens, greedy=msg.greedy, temperature=msg.temperature,
                              top_k=msg.top_k, top_p=msg.top_p, seed=msg.seed, stop_on_eod=msg.stop_on_eod)

    def check(self, msg: P.Generate) -> list[int]:
        """Prompt tokens, or ProtocolError before anything runs."""
        from megatronapp.inference.generate import check_prompts

        tokens = self.tokenizer.encode(msg.prompt)
        try:
            check_prompts([tokens], self.sampling(msg), self.model.cfg.seq_length, self.tokenizer.vocab_size)
        except ConfigError as e:
            raise P.ProtocolError("refused", str(e)) from None
        return tokens

    def run(self, msg: P.Generate, emit, emit_tensor) -> None:
        """Clean run, then (with perturbations set) the perturbed run and a comparison."""
        prompt = self.check(msg)
        clean, clean_cap = self._run_one("clean", prompt, msg, (), emit, emit_tensor)
        if not self.perturbations.specs:
            return
        bad, bad_cap = self._run_one("perturbed", prompt, msg, tuple(self.perturbations.specs), emit, emit_tensor)
        emit(P.Compare(first_divergence=first_divergence(clean, bad),
                       layer_diff_norms=layer_diff_norms(clean_cap, bad_cap, self.model.cfg.num_layers)))

    def _run_one(self, run: str, prompt: list[int], msg: P.Generate, specs, emit, emit_tensor):
        decode = self.tokenizer.decode
        emit(P.RunStart(run=run, prompt_tokens=prompt, prompt_text=[decode([t]) for t in prompt]))
        with ExitStack() as stack:
            for spec in specs:
                stack.enter_context(perturb(self.model, spec))
            cap = stack.enter_context(capture(self.model, sites=CAPTURE_SITES, topk=TOPK,
                                              max_bytes_per_step=self.limits.max_capture_bytes))
            stream = _StepStream(cap, run, emit_tensor, decode)
            self.model.observers.append(stream)
            sent = []

            def on_tokens(step: int, tokens: torch.Tensor) -> None:
                token_id = int(tokens[0, 0])
                sent.append(token_id)
                info = stream.step_info.get(step, {})
                emit(P.Token(run=run, step=step, id=token_id, text=decode([token_id]), topk=info.get("topk", []),
                             lens=info.get("lens", []), t_server_ms=time.time() * 1000))

            try:
                t0 = time.perf_counter()
                res = generate(_TokenTap(self.model, on_tokens), [prompt], self.sampling(msg),
                               eod_id=self.tokenizer.eod_id, vocab_size=self.tokenizer.vocab_size)
                elapsed = time.perf_counter() - t0
            finally:
                self.model.observers.remove(stream)
            tokens = res.tokens[0]
            for step in range(len(sent), len(tokens)):  # the last step has no next forward
                on_tokens(step, torch.tensor([[tokens[step]]]))
        emit(P.RunEnd(run=run, tokens=tokens, text=decode(tokens), tokens_per_s=len(tokens) / max(elapsed, 1e-9)))
        return tokens, cap


def first_divergence(a: list[int], b: list[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def layer_diff_norms(clean_cap, bad_cap, num_layers: int) -> list[float]:
    """Per layer, the L2 norm of (perturbed - clean) residual over the steps both runs captured
    with equal shapes."""
    out = []
    for layer in range(num_layers):
        total = 0.0
        bad_by_step = {it.step: it for it in bad_cap.get("residual", layer)}
        for it in clean_cap.get("residual", layer):
            other = bad_by_step.get(it.step)
            if other is not None and other.tensors["data"].shape == it.tensors["data"].shape:
                diff = other.tensors["data"].float() - it.tensors["data"].float()
                total += float(torch.nan_to_num(diff, nan=1e30, posinf=1e30, neginf=-1e30).pow(2).sum())
        out.append(math.sqrt(total) if math.isfinite(total) else 1e30)
    return out
