"""MegaScope UI wire protocol, version 2: every message between browser and server.

One WebSocket per tab at /ws. Text frames carry one JSON object with a "type" field;
binary frames carry one tensor:

    [u32 little-endian header length N][N bytes UTF-8 JSON TensorHeader][raw bytes, C order]

Client -> server (text only; a binary frame from a client is an error):

    hello        {"type": "hello", "version": 2}                 first message; answered by "welcome"
    view         {"type": "view", "layer": L, "head": H}         what this tab shows (any tab; default layer 0):
                                                                 generation tensors are captured and sent
                                                                 for the shown layers only; a layer the
                                                                 last generation did not capture is refilled
                                                                 (the same request rerun, views only) for
                                                                 the driving tab; a watcher's layer is
                                                                 captured by the next generation
    generate     prompt + sampling (as `megatronapp generate`)   driver only; clean run, then a
                                                                 perturbed run when perturbations are set
    perturb      {"type": "perturb", "spec": {...}}              add a scope Perturbation (specs.py format);
                                                                 takes effect at the next token / step
    clear_perturbations                                          remove every perturbation
    train_control {"action": "pause" | "resume" | "step"}         training mode only
    take_drive                                                   become the driving tab if nobody drives

Server -> client:

    welcome      protocol version, mode, role, model structure, limits, perturbation kinds
    run_start    a run began ("clean" or "perturbed"), prompt tokens with their text
    tokens       generated tokens of a run, in order, each with its top-k and logit lens;
                 `t_server_ms` (Unix ms) is when it left the model, for the page's latency
                 marks. One message carries every token the tab has not been sent yet (several
                 when the tab fell behind); tokens are never dropped
    tensor       (binary) rows `start ..` of one layer's site in a run: attn_probs (B, heads, S, T)
                 of the tab's layer, in fp16, or residual (B, S, W) of that layer reduced to W
                 bucket means, in fp16 (see `compression`); rows are token positions. The page
                 cuts its rows at `start` and appends, so a frame that merges several steps
                 (a slow tab) or restarts at 0 (a refill) both land right. Probe frames
                 (training) carry all rows of the probe prompt and replace the previous ones
    run_end      tokens of the run, tokens/s
    compare      clean vs perturbed: first diverging token index, per-layer residual difference norms
    perturbations the active perturbation list (with seeds) after any change
    train_step   iteration, loss, lr, grad norm, per-layer weight/grad norms
    train_rerun  --rerun-mode validate_results: a flagged step's flags and verdict, per-layer grad
                 norms of the flagged execution and of its rerun, per-layer activation RMS of the rerun
    train_eval   --eval-interval: a validation or test loss (split, iteration, loss, perplexity)
    probe        every K steps: probe prompt top-k and per-layer activation stats (+ tensor frames)
    train_state  paused / running, iteration
    role         your role changed (driver / watcher)
    error        {"code", "message"}: the request was refused and nothing changed; code
                 "internal" is a server-side failure (details in the server's log only)

Version 2 (this one) replaced v1's one `token` message per token and one tensor frame per
layer and site per token with `tokens` batches, the `view` request and row-addressed frames.

Limits (Limits below) are enforced before anything is parsed further: frame size, prompt
length, tokens requested, capture bytes per step, and messages per second per connection; a
perturbation is refused ("too_large") when applying it would draw more than
max_perturb_draws random values.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError

from megatronapp.inference.generate import SamplingConfig

PROTOCOL_VERSION = 2


@dataclass(frozen=True)
class Limits:
    max_message_bytes: int = 64 * 1024  # any client frame
    max_prompt_chars: int = 4096
    max_new_tokens: int = 256
    max_capture_bytes: int = 32 << 20  # raw capture of one generation step
    max_messages_per_s: float = 50.0  # token bucket per connection
    burst: int = 100
    max_perturbations: int = 16
    # random values one perturbation may draw each time it applies (its tensor's elements x draws
    # per element; random bits draw one per candidate bit, ~16 bytes each with the argsort): bounds
    # what one message can make the server allocate, to about 1 GiB
    max_perturb_draws: int = 1 << 26


class _Msg(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)


# -- client -> server -----------------------------------------------------------------------
class Hello(_Msg):
    type: Literal["hello"]
    version: int


class View(_Msg):
    type: Literal["view"]
    layer: int = Field(ge=0)  # checked against the model by the server
    head: int = Field(default=0, ge=0)


class Generate(_Msg):
    """Sampling as `megatronapp generate`: an omitted field takes SamplingConfig's default."""

    type: Literal["generate"]
    prompt: str = Field(min_length=1)
    max_new_tokens: int = Field(default=SamplingConfig.max_new_tokens, ge=1)
    greedy: bool = SamplingConfig.greedy
    temperature: float = Field(default=SamplingConfig.temperature, gt=0, le=100)
    top_k: int = Field(default=SamplingConfig.top_k, ge=0)
    top_p: float = Field(default=SamplingConfig.top_p, gt=0, le=1)
    seed: int = Field(default=SamplingConfig.seed, ge=0, lt=2**63)
    stop_on_eod: bool = SamplingConfig.stop_on_eod


class Perturb(_Msg):
    type: Literal["perturb"]
    spec: dict  # scope.specs.Perturbation fields; validated against the model by the server


class ClearPerturbations(_Msg):
    type: Literal["clear_perturbations"]


class TrainControl(_Msg):
    type: Literal["train_control"]
    action: Literal["pause", "resume", "step"]


class TakeDrive(_Msg):
    type: Literal["take_drive"]


ClientMessage = Annotated[
    Hello | View | Generate | Perturb | ClearPerturbations | TrainControl | TakeDrive, Field(discriminator="type")
]
_CLIENT = TypeAdapter(ClientMessage)


# -- server -> client -----------------------------------------------------------------------
class TopEntry(_Msg):
    id: int
    text: str
    p: float


class Welcome(_Msg):
    type: Literal["welcome"] = "welcome"
    version: int = PROTOCOL_VERSION
    mode: Literal["generate", "train"]
    role: Literal["driver", "watcher"]
    model: dict  # num_layers, num_heads, hidden_size, seq_length, vocab_size, params (name -> shape)
    sites: list[str]  # perturbation sites
    perturbation_kinds: list[str]
    bit_formats: list[str]
    bit_fields: list[str]
    limits: dict
    perturbations: list[dict]


class RunStart(_Msg):
    type: Literal["run_start"] = "run_start"
    run: Literal["clean", "perturbed"]
    prompt_tokens: list[int]
    prompt_text: list[str]


class Token(_Msg):
    run: Literal["clean", "perturbed"]
    step: int
    id: int
    text: str
    topk: list[TopEntry]
    lens: list[TopEntry]  # per layer: top token of the newest column's residual
    t_server_ms: float


class Tokens(_Msg):
    type: Literal["tokens"] = "tokens"
    tokens: list[Token]


class TensorHeader(_Msg):
    type: Literal["tensor"] = "tensor"
    run: Literal["clean", "perturbed", "probe"]
    step: int
    site: str
    layer: int
    start: int = 0  # position (row) of the first row in this frame
    dims: list[str]
    dtype: Literal["float32", "float16", "int32"]
    shape: list[int]
    compression: list[dict]  # scope compress ops applied, in order ([] = full tensor)


class RunEnd(_Msg):
    type: Literal["run_end"] = "run_end"
    run: Literal["clean", "perturbed"]
    tokens: list[int]
    text: str
    tokens_per_s: float


class Compare(_Msg):
    type: Literal["compare"] = "compare"
    first_divergence: int | None  # index into the generated tokens; None: identical
    layer_diff_norms: list[float]  # per layer, ||residual_perturbed - residual_clean|| over common steps


class Perturbations(_Msg):
    type: Literal["perturbations"] = "perturbations"
    active: list[dict]


class TrainStep(_Msg):
    type: Literal["train_step"] = "train_step"
    iteration: int
    loss: float
    lr: float
    grad_norm: float
    layer_weight_norms: list[float]
    layer_grad_norms: list[float]


class TrainRerun(_Msg):
    type: Literal["train_rerun"] = "train_rerun"
    iteration: int  # 0-based index of the flagged step (its train_step row is iteration + 1)
    flags: list[str]
    verdict: str  # "transient" | "reproducible"
    ranks: list[int]
    # the grads as the update left them (the unfused CPU update clips them in place, each execution
    # by its own factor): compare the layers' ratios with each other, not with 1
    layer_grad_norms_flagged: list[float]
    layer_grad_norms_rerun: list[float]
    layer_act_rms_rerun: list[float]  # RMS of each layer's output over the rerun's microbatches


class TrainEval(_Msg):
    type: Literal["train_eval"] = "train_eval"
    split: Literal["valid", "test"]
    iteration: int  # optimizer steps completed when it ran
    loss: float
    ppl: float


class Probe(_Msg):
    type: Literal["probe"] = "probe"
    iteration: int
    prompt_text: list[str]
    topk: list[TopEntry]
    layer_act_mean: list[float]
    layer_act_std: list[float]


class TrainState(_Msg):
    type: Literal["train_state"] = "train_state"
    paused: bool  # the page asked for a pause
    waiting: bool  # the training thread is blocked after `iteration` (a running step has finished)
    iteration: int


class Role(_Msg):
    type: Literal["role"] = "role"
    role: Literal["driver", "watcher"]


class Error(_Msg):
    type: Literal["error"] = "error"
    code: Literal[
        "bad_json",
        "bad_message",
        "too_large",
        "rate_limited",
        "not_driver",
        "busy",
        "refused",
        "binary_not_accepted",
        "wrong_mode",
        "version",
        "internal",
    ]
    message: str


class ProtocolError(ValueError):
    """A client frame that is refused; `error` is what the client is told."""

    def __init__(self, code: str, message: str):
        super().__init__(message)
        self.error = Error(code=code, message=message[:300])


def parse_client_text(text: str, limits: Limits) -> BaseModel:
    """The client message in `text`, or ProtocolError. Checks size first, then JSON, then the schema."""
    if len(text.encode("utf-8", "surrogatepass")) > limits.max_message_bytes:
        raise ProtocolError("too_large", f"message over {limits.max_message_bytes} bytes")
    try:
        data = json.loads(text)
    except (json.JSONDecodeError, RecursionError) as e:
        raise ProtocolError("bad_json", f"not JSON: {e}") from None
    if not isinstance(data, dict) or not isinstance(data.get("type"), str):
        raise ProtocolError("bad_message", "a message is a JSON object with a string 'type'")
    try:
        msg = _CLIENT.validate_python(data)
    except ValidationError as e:
        first = e.errors()[0]
        raise ProtocolError(
            "bad_message", f"{data['type']}: {'.'.join(map(str, first['loc']))}: {first['msg']}"
        ) from None
    check_limits(msg, limits)
    return msg


def check_limits(msg: BaseModel, limits: Limits) -> None:
    if isinstance(msg, Generate):
        if len(msg.prompt) > limits.max_prompt_chars:
            raise ProtocolError("too_large", f"prompt over {limits.max_prompt_chars} characters")
        if msg.max_new_tokens > limits.max_new_tokens:
            raise ProtocolError("too_large", f"max_new_tokens over {limits.max_new_tokens}")
    if isinstance(msg, Hello) and msg.version != PROTOCOL_VERSION:
        raise ProtocolError("version", f"server speaks protocol version {PROTOCOL_VERSION}, not {msg.version}")


def encode_tensor_frame(header: TensorHeader, payload: bytes) -> bytes:
    head = header.model_dump_json().encode()
    return struct.pack("<I", len(head)) + head + payload


def decode_tensor_frame(frame: bytes) -> tuple[dict, bytes]:
    """(header dict, payload) of a server tensor frame (tests and tools)."""
    (n,) = struct.unpack_from("<I", frame)
    return json.loads(frame[4 : 4 + n]), frame[4 + n :]


class RateLimiter:
    """Token bucket: `rate` messages per second, bursts up to `burst`."""

    def __init__(self, rate: float, burst: int, now: float):
        self.rate, self.burst, self.tokens, self.last = rate, burst, float(burst), now

    def allow(self, now: float) -> bool:
        self.tokens = min(self.burst, self.tokens + (now - self.last) * self.rate)
        self.last = now
        if self.tokens >= 1:
            self.tokens -= 1
            return True
        return False
