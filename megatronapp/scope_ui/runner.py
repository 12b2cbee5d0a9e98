"""The model side of the UI: generation streamed token by token with MegaScope captures, the
perturbation list, and clean-vs-perturbed comparison. Runs in ONE worker thread that owns the
model; results leave as small records (outbox.py) through `sink.post(list)`, one post per
FLUSH_S at most; the server encodes and sends them on its own thread.

Only what the tabs show is captured: the shown layers' attention (all heads, fp16) and
residual (bucket means, fp16), top-k and logit lens. Those captures can be recorded into the
decode graph, so with CUDA graphs on the UI decodes like plain generation. A tab that switches
to another layer gets it by a refill: the last request rerun (same tokens) capturing that
layer only. Every layer's full residual is captured only when perturbations are set (for the
per-layer difference norms).

Built only on scope I's public API (scope.capture, scope.perturb, specs) and
inference.generate, so UI tokens are exactly `megatronapp generate`'s: the same generate()
with the same SamplingConfig. `_TokenTap` bridges what that API does not expose: it sees each
sampled token as the input of the next forward step.
"""

from __future__ import annotations

import math
import random
import time
from contextlib import ExitStack
from dataclasses import dataclass

import torch

from megatronapp.config import ConfigError
from megatronapp.inference.generate import SamplingConfig, generate
from megatronapp.scope import capture, perturb
from megatronapp.scope.bits import FORMATS, format_of
from megatronapp.scope.sites import PERTURB_SITES
from megatronapp.scope.specs import BIT_KINDS, KINDS, PerturbSpecError, perturbation_from_dict, validate_perturbation
from megatronapp.scope.target import resolve_target
from megatronapp.scope_ui import protocol as P
from megatronapp.scope_ui.outbox import TokenOut, ViewOut

STREAM_SITES = ("attn_probs", "residual")  # sent as tensor frames, per shown layer and step
TOPK = 5
ATTN_COMPRESS = "quantize:dtype=fp16"
RESIDUAL_WIDTH = 64  # feature buckets of the residual heatmap / PCA
RESIDUAL_COMPRESS = f"reduce:op=mean,width={RESIDUAL_WIDTH};quantize:dtype=fp16"
TOKEN_INFO = {"topk", "lens"}  # what a token message carries besides its id
FLUSH_S = 0.010  # records leave the model thread at most this often: one wakeup of the server per
# ~frame, not per token (the page draws once per frame anyway; its latency goal is 50 ms)


def describe_model(cfg, param_shapes: dict) -> dict:
    """Model structure the perturbation panel builds its target pickers from."""
    return {
        "num_layers": cfg.num_layers,
        "num_heads": cfg.num_attention_heads,
        "hidden_size": cfg.hidden_size,
        "head_dim": cfg.head_dim,
        "ffn_size": cfg.ffn_size,
        "seq_length": cfg.seq_length,
        "params": {name: list(shape) for name, shape in sorted(param_shapes.items())},
    }


def welcome_fields(info: dict) -> dict:
    return {
        "model": info,
        "sites": list(PERTURB_SITES) + ["param"],
        "perturbation_kinds": list(KINDS),
        "bit_formats": list(FORMATS),
        "bit_fields": ["sign", "exponent", "mantissa"],
    }


def compute_perturbation_draws(spec, cfg, param_shapes: dict) -> int:
    """Random values a validated `spec` draws each time it applies, per sequence of the batch.
    Draws cover the target's whole tensor (so the same elements are hit on every layout): a
    parameter's full shape, or seq_length x the site's width; per element one value for
    `rate`, one for gaussian/uniform noise, and for random bits (`field`) one per candidate bit
    (bits.random_bit_masks argsorts them)."""
    if spec.target.site == "param":
        elements = math.prod(param_shapes[spec.target.param])
    else:
        elements = cfg.seq_length * (cfg.ffn_size if spec.target.site == "fc1" else cfg.hidden_size)
    per_element = (spec.rate is not None) + (spec.kind in ("gaussian", "uniform"))
    if spec.kind in BIT_KINDS and spec.field is not None:
        per_element += len(format_of(spec.format, torch.float32).field_bits(spec.field))
    return elements * per_element


class PerturbationSet:
    """The active perturbations (scope specs), validated against the model before adding."""

    def __init__(self, cfg, param_shapes: dict, limit: int, max_draws: int = P.Limits.max_perturb_draws):
        self.cfg, self.shapes, self.limit, self.max_draws, self.specs = cfg, param_shapes, limit, max_draws, []

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
        draws = compute_perturbation_draws(spec, self.cfg, self.shapes)
        if draws > self.max_draws:
            raise P.ProtocolError(
                "too_large",
                f"perturbation: {draws} random values per application, over "
                f"{self.max_draws}; choose a smaller tensor, fixed 'bits' instead of a random 'field', or no 'rate'",
            )
        self.specs.append(spec)
        return spec

    def clear(self) -> None:
        self.specs = []

    def as_dicts(self) -> list[dict]:
        import json

        return [json.loads(s.to_json()) for s in self.specs]


class _TokenTap:
    """Stands in for the InferenceModel inside generate(): the tokens of step s are the input of
    step s+1. Their host copy is queued just before step s+1 is launched and
    `on_tokens(s, host tokens)` runs just after the launch, so the UI's per-token host work
    (noting the token, a flush every FLUSH_S) runs while the device computes step s+1 instead of
    holding back its launch, and adds no sync: the copy was queued ahead of the step, so
    waiting for it never waits for the step (generate() itself syncs once per step, as
    without the UI)."""

    def __init__(self, model, on_tokens):
        self._model, self._on_tokens, self._landing = model, on_tokens, _HostLanding()

    def forward_step(self, tokens):
        step = self._model.step
        queued = self._landing.queue(tokens) if step > 0 else None
        logits = self._model.forward_step(tokens)
        if queued is not None:
            self._on_tokens(step - 1, self._landing.read(queued))
        return logits

    def __getattr__(self, name):
        return getattr(self._model, name)


class _HostLanding:
    """Pinned host memory and one event for small device->host copies, reused by every step (a
    copy is read before the next is queued): per step one asynchronous copy and one event
    record, no allocation. The copy runs on a side stream once what is queued on the current
    stream is done, so the step launched after it does not wait for the copy engine; the
    copied tensor must stay unchanged until it is read (generate() keeps every step's tokens).
    A CPU tensor is its own copy."""

    def __init__(self):
        self.host, self.event, self.stream = None, None, None

    def queue(self, t: torch.Tensor) -> torch.Tensor:
        if not t.is_cuda:
            return t
        if self.host is None or self.host.shape != t.shape or self.host.dtype != t.dtype:
            self.host, self.event = torch.empty(t.shape, dtype=t.dtype, pin_memory=True), torch.cuda.Event()
            self.stream = torch.cuda.Stream(device=t.device)
        self.stream.wait_stream(torch.cuda.current_stream(t.device))
        with torch.cuda.stream(self.stream):
            self.host.copy_(t, non_blocking=True)
            self.event.record(self.stream)
        return self.host

    def read(self, queued: torch.Tensor) -> torch.Tensor:
        """`queued` (what queue returned) once its copy has landed."""
        if queued is self.host:
            self.event.synchronize()
        return queued


class _RunStream:
    """A run's records for the sink. `token(step, id)` is called when step s's token is known,
    right after step s+1 was launched (_TokenTap). Records leave in one post at most every
    FLUSH_S (and at the end): per token the model thread only notes the id and the time; at a
    flush the captures' items whose host copies have landed (every step up to s: generate()
    synced on step s; never waiting for s+1, which the device is computing) become ViewOut
    rows of the shown layers (copied: the capture's host buffers are its own) and each
    token's top-k and logit lens. A token goes out with its step's top-k and lens, so one
    whose captures have not landed yet waits for the next flush; the final flush waits."""

    def __init__(self, caps, run: str, prompt_len: int, sink, with_tokens: bool):
        self.caps, self.run, self.prompt_len, self.sink, self.with_tokens = caps, run, prompt_len, sink, with_tokens
        self.seen = [0] * len(caps)
        self.step_info, self.views, self.tokens = {}, [], []
        self.last_flush = time.monotonic()

    def token(self, step: int, token_id: int) -> None:
        self.tokens.append((step, token_id, time.time() * 1000))
        if time.monotonic() - self.last_flush >= FLUSH_S:
            self.flush()

    def flush(self, final: bool = False) -> None:
        self.last_flush = time.monotonic()
        for i, cap in enumerate(self.caps):
            items = cap.items if final else cap.landed_items()
            for item in items[self.seen[i] :]:
                self._take(item)
            self.seen[i] = len(items)
        records, self.views = self.views, []
        ready = (
            len(self.tokens)
            if final or not self.with_tokens
            else next(
                (
                    i
                    for i, (step, *_) in enumerate(self.tokens)
                    if not self.step_info.get(step, {}).keys() >= TOKEN_INFO
                ),
                len(self.tokens),
            )
        )
        for step, token_id, t_ms in self.tokens[:ready] if self.with_tokens else ():
            info = self.step_info.pop(step, {})
            records.append(
                TokenOut(
                    run=self.run,
                    step=step,
                    id=token_id,
                    topk=info.get("topk", ()),
                    lens=info.get("lens", ()),
                    t_server_ms=t_ms,
                )
            )
        del self.tokens[:ready]
        if records:
            self.sink.post(records)

    def _take(self, item) -> None:
        if item.site in STREAM_SITES:
            start = 0 if item.step == 0 else self.prompt_len + item.step - 1
            self.views.append(
                ViewOut(
                    run=self.run,
                    step=item.step,
                    site=item.site,
                    layer=item.layer,
                    start=start,
                    dims=tuple(item.dims),
                    compression=tuple(item.ops),
                    data=item.tensors["data"].numpy().copy(),
                )
            )
        elif item.site == "topk":
            t = item.tensors
            self.step_info.setdefault(item.step, {})["topk"] = _pairs(t["data"][0], t["indices"][0], exp=False)
        elif item.site == "logit_lens":  # (layers, batch, k): row 0, top entry per layer
            t = item.tensors
            self.step_info.setdefault(item.step, {})["lens"] = _pairs(
                t["data"][:, 0, 0], t["indices"][:, 0, 0], exp=True
            )


def _pairs(values, ids, exp: bool) -> tuple:
    values = values.float().exp() if exp else values.float()
    return tuple(zip(ids.tolist(), values.tolist()))


def stream_captures(model, layers, with_tokens: bool, max_bytes: int) -> tuple:
    """The capture contexts of a UI run (not entered): the shown layers' attention (fp16) with
    top-k and logit lens (its top token per layer: what the page shows, one max reduction, not a
    top-k), and their residual reduced to RESIDUAL_WIDTH bucket means (fp16). Two captures
    because reduce may not touch attention's growing key dim; both are recordable into the
    decode graph, so CUDA graphs stay on."""
    finals = ("topk", "logit_lens") if with_tokens else ()
    return (
        capture(
            model,
            sites=("attn_probs",) + finals,
            layers=layers,
            topk=TOPK,
            lens_topk=1,
            compress=ATTN_COMPRESS,
            max_bytes_per_step=max_bytes,
        ),
        capture(model, sites=("residual",), layers=layers, compress=RESIDUAL_COMPRESS, max_bytes_per_step=max_bytes),
    )


@dataclass(frozen=True)
class LastRequest:
    """The last generation: what a refill reruns (same prompt, sampling, perturbations)."""

    prompt: tuple[int, ...]
    msg: P.Generate
    runs: tuple  # ((name, specs), ...)
    layers: frozenset


class GenerationRunner:
    """Owns an InferenceModel (one process) and a tokenizer; call `run` / `refill` from one
    thread only. Records go to `sink.post(list)` (the Hub, or one tab)."""

    mode = "generate"

    def __init__(self, model, tokenizer, limits: P.Limits):
        self.model, self.tokenizer, self.limits = model, tokenizer, limits
        shapes = resolve_target(model).full_param_shapes()
        self.info = describe_model(model.cfg, shapes)
        self.perturbations = PerturbationSet(model.cfg, shapes, limits.max_perturbations, limits.max_perturb_draws)
        self.last: LastRequest | None = None

    def welcome_fields(self) -> dict:
        return welcome_fields(self.info)

    def backlog(self) -> list:
        return []

    def decode_token(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id])

    def sampling(self, msg: P.Generate) -> SamplingConfig:
        return SamplingConfig(
            max_new_tokens=msg.max_new_tokens,
            greedy=msg.greedy,
            temperature=msg.temperature,
            top_k=msg.top_k,
            top_p=msg.top_p,
            seed=msg.seed,
            stop_on_eod=msg.stop_on_eod,
        )

    def check(self, msg: P.Generate) -> list[int]:
        """Prompt tokens, or ProtocolError before anything runs."""
        from megatronapp.inference.generate import check_prompts

        tokens = self.tokenizer.encode(msg.prompt)
        try:
            check_prompts([tokens], self.sampling(msg), self.model.cfg.seq_length, self.tokenizer.vocab_size)
        except ConfigError as e:
            raise P.ProtocolError("refused", str(e)) from None
        return tokens

    def run(self, msg: P.Generate, sink, layers) -> None:
        """Clean run, then (with perturbations set) the perturbed run and a comparison; tensors
        of `layers` (the layers the tabs show) are captured and streamed."""
        prompt = self.check(msg)
        specs = tuple(self.perturbations.specs)
        runs = (("clean", ()),) + ((("perturbed", specs),) if specs else ())
        self.last = None  # a refill of the previous request must not run against this one
        results = [self._run_one(name, prompt, msg, sp, sink, tuple(layers), compare=bool(specs)) for name, sp in runs]
        self.last = LastRequest(tuple(prompt), msg, runs, frozenset(layers))
        if specs:
            (clean, clean_cap), (bad, bad_cap) = results
            sink.post(
                [
                    P.Compare(
                        first_divergence=first_divergence(clean, bad),
                        layer_diff_norms=layer_diff_norms(clean_cap, bad_cap, self.model.cfg.num_layers),
                    )
                ]
            )

    def needs_refill(self, layer: int) -> bool:
        last = self.last
        return last is not None and layer not in last.layers

    def refill(self, layer: int, sink) -> None:
        """The last request's runs again (same tokens: same sampling, seed and perturbations),
        capturing `layer` only and sending its rows (from 0) to `sink`; no token messages."""
        last = self.last
        if last is None or layer in last.layers:
            return
        for name, specs in last.runs:
            self._run_one(name, list(last.prompt), last.msg, specs, sink, (layer,), compare=False, quiet=True)
        self.last = LastRequest(last.prompt, last.msg, last.runs, last.layers | {layer})

    def _run_one(
        self, run: str, prompt: list[int], msg: P.Generate, specs, sink, layers, compare: bool, quiet: bool = False
    ):
        decode = self.tokenizer.decode
        if not quiet:
            sink.post([P.RunStart(run=run, prompt_tokens=prompt, prompt_text=[decode([t]) for t in prompt])])
        with ExitStack() as stack:
            for spec in specs:
                stack.enter_context(perturb(self.model, spec))
            caps = [
                stack.enter_context(c)
                for c in stream_captures(self.model, layers, not quiet, self.limits.max_capture_bytes)
            ]
            # every layer's full residual, only for the clean-vs-perturbed difference norms
            diff = (
                stack.enter_context(
                    capture(self.model, sites=("residual",), max_bytes_per_step=self.limits.max_capture_bytes)
                )
                if compare
                else None
            )
            stream = _RunStream(caps, run, len(prompt), sink, with_tokens=not quiet)
            sent = []

            def on_tokens(step: int, tokens: torch.Tensor) -> None:
                sent.append(int(tokens[0, 0]))
                stream.token(step, sent[-1])

            t0 = time.perf_counter()
            res = generate(
                _TokenTap(self.model, on_tokens),
                [prompt],
                self.sampling(msg),
                eod_id=self.tokenizer.eod_id,
                vocab_size=self.tokenizer.vocab_size,
            )
            elapsed = time.perf_counter() - t0
            tokens = res.tokens[0]
            for step in range(len(sent), len(tokens)):  # the last step has no next forward
                stream.token(step, tokens[step])
            stream.flush(final=True)
        if not quiet:
            sink.post(
                [P.RunEnd(run=run, tokens=tokens, text=decode(tokens), tokens_per_s=len(tokens) / max(elapsed, 1e-9))]
            )
        return tokens, diff


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
