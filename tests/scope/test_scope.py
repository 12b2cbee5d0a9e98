"""MegaScope in one process: captures against the weights, free when off, bit-exact faults, bad specs."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from engine_jobs import RandomTokenBatches, make_job
from inference_jobs import PROMPTS, load_model

from megatronapp import scope
from megatronapp.engine.trainer import Trainer
from megatronapp.inference.generate import SamplingConfig, generate
from megatronapp.parallel.groups import build_process_groups
from megatronapp.scope.bits import FORMATS
from megatronapp.scope.pca import compute_pca
from megatronapp.scope.perturb import corrupt, keyed_generator
from megatronapp.scope.specs import Perturbation, PerturbSpecError, Target
from megatronapp.scope.store import load_capture

EOD, VOCAB = 256, 257


@pytest.fixture(scope="module")
def ckpt(tiny_checkpoint):
    return tiny_checkpoint


@pytest.fixture
def model(ckpt):
    torch.set_num_threads(1)
    return load_model(0, 1, 1, 1, ckpt)


def first_logits(model, prompt=PROMPTS[0]) -> torch.Tensor:
    model.start(1, len(prompt) + 1, torch.zeros(1, dtype=torch.long))
    return model.forward_step(torch.tensor([prompt]))


def hook_count(model) -> int:
    return sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.chunk.modules())


# -- free when off ------------------------------------------------------------------------
def test_off_means_no_hooks_and_bitwise_identical_logits(model):
    baseline = first_logits(model)
    assert hook_count(model) == 0 and not model.observers
    with scope.capture(model, sites=("q", "attn_probs", "fc1", "residual", "topk", "logit_lens")):
        assert hook_count(model) > 0
        during = first_logits(model)  # capturing observes, it does not change the computation
    with scope.perturb(model, Perturbation("gaussian", Target("param", param="output.weight"), sigma=1.0)):
        assert not torch.equal(first_logits(model), baseline)
    with scope.perturb(model, Perturbation("offset", Target("residual", layers=(0,)), value=1.0)):
        assert not torch.equal(first_logits(model), baseline)
    assert hook_count(model) == 0 and not model.observers
    after = first_logits(model)
    assert torch.equal(during.view(torch.int32), baseline.view(torch.int32))
    assert torch.equal(after.view(torch.int32), baseline.view(torch.int32))


# -- captures against values computed from the weights --------------------------------------
def _rotary(x: torch.Tensor, base: float) -> torch.Tensor:
    """GPT-NeoX rotary on (B, h, S, D), written out from the formula."""
    d, s = x.shape[-1], x.shape[-2]
    freqs = 1.0 / base ** (torch.arange(0, d, 2, dtype=torch.float32) / d)
    ang = torch.arange(s, dtype=torch.float32)[:, None] * freqs[None, :]
    x1, x2 = x[..., : d // 2], x[..., d // 2 :]
    return torch.cat([x1 * ang.cos() - x2 * ang.sin(), x2 * ang.cos() + x1 * ang.sin()], dim=-1)


def test_layer_captures_equal_values_from_weights(model):
    layer, prompt = 2, PROMPTS[2]
    with scope.capture(
        model, sites=("q", "k", "v", "attn_probs", "attn_out", "fc1", "mlp_out", "residual"), layers=(layer - 1, layer)
    ) as cap:
        generate(model, [prompt], SamplingConfig(max_new_tokens=1), eod_id=EOD, vocab_size=VOCAB)
    got = {it.site: it.tensors["data"][0] for it in cap.get(None, layer, 0)}
    x = cap.get("residual", layer - 1, 0)[0].tensors["data"][0]  # (S, H) input of the layer
    w = {
        n.removeprefix(f"layers.{layer}."): p
        for n, p in model.chunk.named_parameters()
        if n.startswith(f"layers.{layer}.")
    }
    cfg = model.cfg
    nh, d = cfg.num_attention_heads, cfg.head_dim
    qkv = F.layer_norm(
        x, (cfg.hidden_size,), w["attention.norm.weight"], w["attention.norm.bias"], cfg.layernorm_epsilon
    )
    qkv = (qkv @ w["attention.attn.qkv.weight"].T + w["attention.attn.qkv.bias"]).view(-1, nh, 3, d)
    q, k, v = (qkv[:, :, i].transpose(0, 1) for i in range(3))  # (h, S, D)
    q, k = _rotary(q[None], cfg.rotary_base)[0], _rotary(k[None], cfg.rotary_base)[0]
    s = x.shape[0]
    scores = (q @ k.transpose(-1, -2)) / math.sqrt(d) + torch.full((s, s), float("-inf")).triu(1)
    probs = scores.softmax(-1)
    attn_out = (probs @ v).transpose(0, 1).reshape(s, -1) @ w["attention.attn.proj.weight"].T + w[
        "attention.attn.proj.bias"
    ]
    h = x + attn_out
    fc1 = F.gelu(
        F.layer_norm(h, (cfg.hidden_size,), w["mlp.norm.weight"], w["mlp.norm.bias"], cfg.layernorm_epsilon)
        @ w["mlp.mlp.fc1.weight"].T
        + w["mlp.mlp.fc1.bias"],
        approximate="tanh",
    )
    mlp_out = fc1 @ w["mlp.mlp.fc2.weight"].T + w["mlp.mlp.fc2.bias"]
    expected = {
        "q": q,
        "k": k,
        "v": v,
        "attn_probs": probs,
        "attn_out": attn_out,
        "fc1": fc1,
        "mlp_out": mlp_out,
        "residual": h + mlp_out,
    }
    for site, value in expected.items():
        torch.testing.assert_close(got[site], value, rtol=1e-5, atol=1e-5, msg=site)


def test_chunk_capture_without_cache_equals_generation_capture(model):
    """The training-path forward (no KV cache, full rotary tables) captures the same values."""
    prompt = PROMPTS[0]
    with scope.capture(model, sites=("q", "attn_probs", "fc1", "residual")) as gen_cap:
        generate(model, [prompt], SamplingConfig(max_new_tokens=1), eod_id=EOD, vocab_size=VOCAB)
    with scope.capture(model.chunk, sites=("q", "attn_probs", "fc1", "residual")) as chunk_cap:
        with torch.no_grad():
            model.chunk(torch.tensor([prompt]))
        chunk_cap.end_step()
    assert len(chunk_cap.items) == len(gen_cap.items) == 4 * model.cfg.num_layers
    for a, b in zip(chunk_cap.items, gen_cap.items):
        assert a.name == b.name
        torch.testing.assert_close(a.tensors["data"], b.tensors["data"], rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="need an InferenceModel"):
        scope.capture(model.chunk, sites=("topk",))


def test_attention_rows_sum_to_one_and_are_causal_with_padding(model):
    with scope.capture(model, sites=("attn_probs",)) as cap:
        generate(model, PROMPTS, SamplingConfig(max_new_tokens=3), eod_id=EOD, vocab_size=VOCAB)
    width = max(map(len, PROMPTS))
    for it in cap.get("attn_probs"):
        p = it.tensors["data"]  # (B, heads, S_new, T)
        torch.testing.assert_close(p.sum(-1), torch.ones(p.shape[:-1]))
        s_new, t = p.shape[-2:]
        columns = torch.arange(t - s_new, t)  # absolute column of each query
        future = torch.arange(t)[None, :] > columns[:, None]
        assert float(p[..., future].abs().sum()) == 0.0
        for b, prompt in enumerate(PROMPTS):  # real tokens never attend to left padding
            pad = width - len(prompt)
            real = columns >= pad
            assert float(p[b, :, real][..., :pad].abs().sum()) == 0.0


def test_logit_lens_last_layer_equals_logits(model):
    with scope.capture(model, sites=("topk", "logit_lens"), topk=7) as cap:
        generate(model, PROMPTS, SamplingConfig(max_new_tokens=2), eod_id=EOD, vocab_size=VOCAB)
    for step in (0, 1):
        lens = cap.get("logit_lens", step=step)[0].tensors
        top = cap.get("topk", step=step)[0].tensors
        assert lens["data"].shape[0] == model.cfg.num_layers
        assert torch.equal(lens["indices"][-1], top["indices"])
        torch.testing.assert_close(lens["data"][-1].exp(), top["data"], rtol=1e-5, atol=1e-6)
        assert not torch.equal(lens["indices"][0], top["indices"])  # early layers predict otherwise


# -- bit-level faults -----------------------------------------------------------------------
def _expected_flip(value: float, fmt: str, bit: int) -> float:
    if fmt == "fp32":
        return float(np.array([value], np.float32).view(np.uint32).__xor__(np.uint32(1 << bit)).view(np.float32)[0])
    if fmt == "fp16":
        return float(np.array([value], np.float16).view(np.uint16).__xor__(np.uint16(1 << bit)).view(np.float16)[0])
    bits32 = np.array([value], np.float32).view(np.uint32)  # bf16 = upper half of fp32
    return float((bits32 ^ np.uint32(1 << (bit + 16))).view(np.float32)[0])


@pytest.mark.parametrize(
    "fmt, bits", [("fp32", (0, 22, 23, 30, 31)), ("bf16", (0, 6, 7, 14, 15)), ("fp16", (0, 9, 10, 14, 15))]
)
def test_bit_flip_changes_exactly_that_element(fmt, bits):
    dtype = FORMATS[fmt].dtype
    x = (torch.randn(3, 4, 5, generator=torch.Generator().manual_seed(1)) * 3).to(dtype)
    for bit in bits:
        spec = Perturbation("bitflip", Target("residual", positions=(2,), channels=(4,)), bits=(bit,))
        sel = torch.zeros(3, 4, 5, dtype=torch.bool)
        sel[1, 2, 4] = True
        y = corrupt(x, spec, sel, None, keyed_generator(0))
        diff = (y.view(FORMATS[fmt].int_dtype) != x.view(FORMATS[fmt].int_dtype)).nonzero().tolist()
        assert diff == [[1, 2, 4]]
        assert float(y[1, 2, 4]) == pytest.approx(_expected_flip(float(x[1, 2, 4]), fmt, bit), nan_ok=True)


def test_bit_flip_through_the_model_hits_one_activation(model):
    layer, pos, ch, bit = 1, 3, 7, 30
    with scope.capture(model, sites=("residual",), layers=(layer,)) as clean:
        generate(model, [PROMPTS[2]], SamplingConfig(max_new_tokens=1), eod_id=EOD, vocab_size=VOCAB)
    spec = Perturbation("bitflip", Target("residual", layers=(layer,), positions=(pos,), channels=(ch,)), bits=(bit,))
    with scope.perturb(model, spec), scope.capture(model, sites=("residual",), layers=(layer,)) as hit:
        generate(model, [PROMPTS[2]], SamplingConfig(max_new_tokens=1), eod_id=EOD, vocab_size=VOCAB)
    a, b = clean.items[0].tensors["data"], hit.items[0].tensors["data"]
    assert (a != b).nonzero().tolist() == [[0, pos, ch]]
    assert float(b[0, pos, ch]) == _expected_flip(float(a[0, pos, ch]), "fp32", bit)


def test_stuck_at_and_special_values():
    x = torch.tensor([1.0, -2.0, 3.0])
    sel = torch.tensor([True, True, False])
    stuck = Perturbation("stuck_at", Target("residual"), bits=(31,), stuck=1)
    assert corrupt(x, stuck, sel, None, keyed_generator(0)).tolist() == [-1.0, -2.0, 3.0]
    nan = Perturbation("special", Target("residual"), value="nan")
    y = corrupt(x, nan, sel, None, keyed_generator(0))
    assert math.isnan(y[0]) and math.isnan(y[1]) and y[2] == 3.0
    # fp16 exponent MSB (bit 14): clear in 1.0 (0x3C00) already; -2.0 (0xC000) becomes -0.0 (0x8000)
    z = corrupt(
        x.half(), Perturbation("stuck_at", Target("residual"), bits=(14,), stuck=0), sel, None, keyed_generator(0)
    )
    assert z.view(torch.int16).tolist() == [0x3C00, -0x8000, x.half().view(torch.int16)[2].item()]


def test_parameter_fault_restored_bit_exactly_and_training_step(ckpt):
    torch.set_num_threads(1)
    job = make_job(1, iters=2)

    def fresh():
        return Trainer(job, build_process_groups(job.layout, 0), torch.device("cpu"), RandomTokenBatches(job, 0))

    hit = fresh()
    before = {n: p.detach().clone() for c in hit.chunks for n, p in c.named_parameters()}
    param_spec = Perturbation(
        "bitflip", Target("param", param="layers.1.mlp.mlp.fc2.weight"), field="exponent", rate=0.05, seed=4
    )
    with scope.perturb(hit.chunks, param_spec):
        changed = sum(int((p != before[n]).sum()) for c in hit.chunks for n, p in c.named_parameters())
        mb = RandomTokenBatches(job, 0).next_microbatches()[0]
        hit.chunks[0](mb[:, :-1], mb[:, 1:]).mean().backward()
    assert changed > 0
    for c in hit.chunks:
        for n, p in c.named_parameters():
            assert torch.equal(p.view(torch.int32), before[n].view(torch.int32)), n
    name = "layers.1.mlp.mlp.fc2.weight"
    weight = next(p for c in hit.chunks for n, p in c.named_parameters() if n == name)
    start = weight.detach().clone()
    mild = Perturbation("bitflip", Target("param", param=name), field="mantissa", rate=0.05, seed=4)
    with scope.perturb(hit.chunks, mild) as pert:  # around a whole training step
        was_hit = pert.saved[name][1].clone()
        hit.train_step()
    assert torch.equal(weight[was_hit].view(torch.int32), start[was_hit].view(torch.int32))  # original bits back
    assert bool((weight[~was_hit] != start[~was_hit]).all())  # the step's update is kept elsewhere
    act_spec = Perturbation("gaussian", Target("mlp_out", layers=(2,)), sigma=0.5, relative=True, seed=1)
    with torch.no_grad():
        clean = hit.chunks[0](mb[:, :-1], mb[:, 1:]).mean()
        with scope.perturb(hit.chunks, act_spec):
            noisy = hit.chunks[0](mb[:, :-1], mb[:, 1:]).mean()
        after = hit.chunks[0](mb[:, :-1], mb[:, 1:]).mean()
    assert noisy != clean and torch.equal(after, clean)
    with scope.perturb(hit.chunks, act_spec):  # through the trainer's pipeline runtime, with backward
        assert math.isfinite(hit.train_step().loss)
    assert sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for c in hit.chunks for m in c.modules()) == 0


# -- specs: JSON, validation ---------------------------------------------------------------
def test_specs_round_trip_through_json():
    specs = [
        Perturbation(
            "bitflip",
            Target("q", layers=(1,), heads=(0, 2), positions=(3,), steps=(0,)),
            field="sign",
            seed=3,
            format="bf16",
        ),
        Perturbation("gaussian", Target("param", param="output.weight", indices=(5, 9)), sigma=0.1),
        Perturbation("special", Target("fc1"), value="-inf", rate=0.01),
    ]
    for spec in specs:
        assert Perturbation.from_json(spec.to_json()) == spec
        assert Perturbation.from_json(json.dumps(json.loads(spec.to_json()))) == spec


@pytest.mark.parametrize(
    "spec, message",
    [
        ({"kind": "gaussian", "sigma": 1, "target": {"site": "attention"}}, "unknown perturbation site"),
        ({"kind": "gaussian", "sigma": 1, "target": {"site": "residual", "layers": [4]}}, "layer 4 is out of range"),
        ({"kind": "bitflip", "bits": [16], "format": "bf16", "target": {"site": "residual"}}, "bit 16 is outside"),
        ({"kind": "bitflip", "bits": [3], "format": "fp8", "target": {"site": "residual"}}, "unknown number format"),
        ({"kind": "bitflip", "target": {"site": "residual"}}, "exactly one of 'bits'"),
        ({"kind": "gaussian", "sigma": 1, "target": {"site": "param", "param": "nope"}}, "unknown parameter"),
        (
            {"kind": "gaussian", "sigma": 1, "target": {"site": "param", "param": "output.weight", "indices": [10**9]}},
            "outside parameter",
        ),
        ({"kind": "gaussian", "sigma": 1, "target": {"site": "residual", "heads": [0]}}, "heads can only"),
        (
            {"kind": "gaussian", "sigma": 1, "target": {"site": "residual"}, "evil": "os.system"},
            "unknown perturbation field",
        ),
        ({"kind": "melt", "target": {"site": "residual"}}, "unknown perturbation kind"),
    ],
)
def test_bad_perturbation_specs_rejected_model_untouched(model, spec, message):
    baseline = first_logits(model)
    with pytest.raises(PerturbSpecError, match=message) as err:
        scope.perturb(model, spec)
    assert "\n" not in str(err.value)
    assert hook_count(model) == 0 and torch.equal(first_logits(model), baseline)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"sites": ("resid",)}, "unknown capture site"),
        ({"sites": ("q",), "layers": (9,)}, "layer 9 is out of range"),
        ({"sites": ("q",), "heads": (4,)}, "head 4 is out of range"),
        ({"sites": ("q",), "compress": "zip:level=9"}, "unknown compression"),
    ],
)
def test_bad_capture_requests_rejected(model, kwargs, message):
    with pytest.raises(ValueError, match=message):
        scope.capture(model, **kwargs)
    assert hook_count(model) == 0


def test_oversized_capture_refused_before_the_step(model):
    baseline = first_logits(model)
    with pytest.raises(ValueError, match="over the limit"):
        with scope.capture(model, sites=("attn_probs", "fc1"), max_bytes_per_step=1000):
            generate(model, PROMPTS, SamplingConfig(max_new_tokens=2), eod_id=EOD, vocab_size=VOCAB)
    assert hook_count(model) == 0 and not model.observers
    assert torch.equal(first_logits(model), baseline)


# -- compression, files, report, CLI -----------------------------------------------------------
def test_compression_records_ops_and_bytes(model, tmp_path):
    comp = "slice:tokens=-2:,heads=0-1;reduce:op=absmax,width=4;quantize:dtype=int8"
    with scope.capture(model, sites=("q", "residual"), compress=comp) as raw_cap:
        generate(model, PROMPTS, SamplingConfig(max_new_tokens=2), eod_id=EOD, vocab_size=VOCAB)
    with scope.capture(model, sites=("q", "residual")) as full:
        generate(model, PROMPTS, SamplingConfig(max_new_tokens=2), eod_id=EOD, vocab_size=VOCAB)
    q = raw_cap.get("q", 0, 0)[0]
    assert q.tensors["data"].dtype == torch.int8 and list(q.tensors["data"].shape) == [3, 2, 2, 4]
    assert [op["name"] for op in q.ops] == ["slice", "reduce", "quantize"]
    ref = full.get("q", 0, 0)[0].tensors["data"][:, :2, -2:]  # (B, 2, 2, D)
    want = torch.stack([b.abs().amax(-1) for b in torch.tensor_split(ref, 4, dim=-1)], -1)
    got = q.tensors["data"].float() * q.tensors["scale"]
    assert float((got - want).abs().max()) <= float(q.tensors["scale"].max()) / 2 + 1e-7
    total = sum(it.nbytes for it in raw_cap.items)
    assert raw_cap.bytes_per_token == total / sum(s["tokens"] for s in raw_cap.steps)
    assert raw_cap.bytes_per_token < full.bytes_per_token / 4


def test_pca_of_rank_one_data():
    direction = torch.randn(16, generator=torch.Generator().manual_seed(0))
    x = torch.linspace(-1, 1, 40)[:, None] * direction[None, :] + 3.0
    coords, ratio = compute_pca(x, 2)
    assert float(ratio[0]) == pytest.approx(1.0, abs=1e-4)
    torch.testing.assert_close(
        coords[:, 0].abs(), (torch.linspace(-1, 1, 40) * direction.norm()).abs(), rtol=1e-4, atol=1e-4
    )


def _cli(args: list[str], capsys) -> tuple[int, str]:
    """`megatronapp scope ...` in this process (one rank: nothing is launched)."""
    from megatronapp.cli.main import main

    code = main(["scope", *args])
    return code, capsys.readouterr().err


def test_cli_capture_and_report(ckpt, tmp_path, capsys):
    out = tmp_path / "cap.safetensors"
    code, err = _cli(
        [
            "capture",
            "--load",
            ckpt,
            "--prompt",
            "Hi",
            "--max-new-tokens",
            "3",
            "--device",
            "cpu",
            "--sites",
            "q,attn_probs,residual,topk,logit_lens",
            "--compress",
            "quantize:dtype=fp16",
            "--perturb",
            '{"kind": "offset", "value": 0.5, "target": {"site": "residual", "layers": [0]}}',
            "--out",
            str(out),
        ],
        capsys,
    )
    assert code == 0, err
    manifest = json.loads((tmp_path / "cap.safetensors.json").read_text())
    assert manifest["perturbations"][0]["kind"] == "offset" and manifest["bytes_per_token"] > 0
    assert {it["site"] for it in manifest["items"]} == {"q", "attn_probs", "residual", "topk", "logit_lens"}
    code, err = _cli(["report", str(out), "--out", str(tmp_path / "rep")], capsys)
    assert code == 0, err
    pngs = sorted(p.name for p in (tmp_path / "rep").glob("*.png"))
    assert {"attention_0.png", "heatmap_residual.png", "pca_residual.png", "topk.png"} <= set(pngs)


@pytest.mark.parametrize(
    "args, message",
    [
        (["--sites", "q,nope"], "unknown capture site"),
        (["--layers", "7"], "layer 7 is out of range"),
        (["--compress", "reduce:op=mean"], "reduce width must be >= 1"),
        (["--perturb", '{"kind": "bitflip", "bits": [40], "target": {"site": "residual"}}'], "bit 40 is outside"),
        (["--perturb", "{not json"], "not valid JSON"),
        (["--nproc-per-node", "2", "--pipeline-model-parallel-size", "3"], "not divisible"),
    ],
)
def test_cli_capture_bad_input_one_line(ckpt, tmp_path, args, message, capsys):
    code, err = _cli(["capture", "--load", ckpt, "--prompt", "Hi", "--out", str(tmp_path / "x"), *args], capsys)
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 2 and len(lines) == 1 and message in lines[0], err
    assert not (tmp_path / "x").exists()


def test_cli_report_rejects_foreign_file(tmp_path, capsys):
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(b"not a capture")
    code, err = _cli(["report", str(bad), "--out", str(tmp_path / "r")], capsys)
    assert code == 2 and "not a MegaScope capture file" in err


def test_cli_capture_launched_on_pp2_equals_one_process(ckpt, tmp_path, capsys):
    """`scope capture --nproc-per-node 2` (PP2 ranks through torch.distributed.run) writes the
    same file contents as the in-process run."""
    args = [
        "capture",
        "--load",
        ckpt,
        "--prompt",
        "Hello",
        "--prompt",
        "abc",
        "--max-new-tokens",
        "3",
        "--device",
        "cpu",
        "--sites",
        "q,attn_probs,fc1,residual,topk,logit_lens",
    ]
    code, err = _cli([*args, "--out", str(tmp_path / "one.safetensors")], capsys)
    assert code == 0, err
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    res = subprocess.run(
        [
            sys.executable,
            "-m",
            "megatronapp.cli.main",
            "scope",
            *args,
            "--out",
            str(tmp_path / "pp2.safetensors"),
            "--nproc-per-node",
            "2",
            "--pipeline-model-parallel-size",
            "2",
        ],
        capture_output=True,
        text=True,
        timeout=240,
        env=env,
    )
    assert res.returncode == 0, res.stderr
    _, one = load_capture(tmp_path / "one.safetensors")
    manifest, pp2 = load_capture(tmp_path / "pp2.safetensors")
    assert manifest["layout"].startswith("world=2 TP=1 PP=2") and [i.name for i in pp2] == [i.name for i in one]
    for a, b in zip(one, pp2):
        for key in a.tensors:
            torch.testing.assert_close(b.tensors[key].float(), a.tensors[key].float(), rtol=1e-3, atol=1e-4)
