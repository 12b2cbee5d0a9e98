"""cli.validate.validate directly, one rule at a time, for every launching command: each case
changes one thing of a run that passes and must be refused with that rule's one-line message.
(The model x training x layout rules are job.validate_job's: test_validate_job.py.)"""

from __future__ import annotations

from dataclasses import replace

import pytest

from megatronapp.cli.injection import InjectionConfig
from megatronapp.cli.run import TrainRun
from megatronapp.cli.validate import validate
from megatronapp.config import JobConfig, ModelConfig, TrainConfig
from megatronapp.dpp.cli import ScheduleRun
from megatronapp.dpp.config import DppConfig, JitterSpec
from megatronapp.fbd.config import FbdConfig, FbdInjection
from megatronapp.inference.cli import InferenceRun
from megatronapp.inference.generate import SamplingConfig
from megatronapp.injection.inject import FaultPlan
from megatronapp.parallel.layout import ParallelLayout
from megatronapp.scan.record.autotrace import AutoTraceConfig
from megatronapp.scan.trace_run import TraceRun
from megatronapp.scope.capture import make_capture_config
from megatronapp.scope.cli import CaptureRequest
from megatronapp.scope_ui.cli import TrainingScopeConfig

SCOPE = TrainingScopeConfig(host="127.0.0.1", port=0, token=None, probe="The", every=10)
MODEL = ModelConfig(
    num_layers=4,
    hidden_size=32,
    num_attention_heads=4,
    vocab_size=100,
    seq_length=16,
    hidden_dropout=0.0,
    attention_dropout=0.0,
)


def train_run(world=2, pp=2, schedule="1f1b", vpp=1, layout_world=None, **kw) -> TrainRun:
    """A run of `world` ranks; layout_world: the engine's (FBD: the backward ranks)."""
    job = JobConfig(
        model=MODEL,
        train=TrainConfig(micro_batch_size=1, global_batch_size=4, schedule=schedule),
        layout=ParallelLayout(layout_world or world, 1, pp, vpp),
    )
    return TrainRun(job=job, world_size=world, **{"device": "cpu", **kw})


def _refused(run, message: str) -> None:
    with pytest.raises(ValueError) as info:
        validate(run)
    text = str(info.value)
    assert message in text and "\n" not in text, text


def test_the_base_runs_pass():
    validate(train_run())
    validate(train_run(world=4, layout_world=2, fbd=FbdConfig()))  # 2 backward + 2 forward ranks
    validate(train_run(schedule="dynamic", vpp=2, dpp=DppConfig(max_inflight=5)))
    validate(INFERENCE)
    validate(replace(INFERENCE, capture=CAPTURE))
    validate(TRACE)
    validate(SCHEDULE)


TRAIN_RULES = [
    (
        "job",
        dict(schedule="interleaved", vpp=3),
        "num layers 4 is not divisible by pipeline-parallel size 2 x virtual stages 3",
    ),
    ("fbd split backward", dict(world=4, layout_world=2, schedule="zb-h1", fbd=FbdConfig()), "runs the whole backward"),
    (
        "fbd crash rank",
        dict(world=4, layout_world=2, fbd=FbdConfig(), injection=InjectionConfig(fbd=FbdInjection(crash=(4, 1)))),
        "--inject-crash rank 4 is outside world size 4",
    ),
    ("fbd layout", dict(world=5, layout_world=2, fbd=FbdConfig()), "world size 5"),
    (
        "jitter rank",
        dict(injection=InjectionConfig(jitter=(JitterSpec(2, 1.5),))),
        "--inject-jitter rank 2 is outside world size 2",
    ),
    (
        "jitter on a forward worker",
        dict(world=4, layout_world=2, fbd=FbdConfig(), injection=InjectionConfig(jitter=(JitterSpec(2, 1.5),))),
        "--inject-jitter rank 2 is outside world size 2",
    ),
    (
        "dynamic cap",
        dict(schedule="dynamic", vpp=2, dpp=DppConfig(max_inflight=1)),
        "--dpp-max-inflight 1 is below the 2 activation sets",
    ),
    ("no gpu", dict(device="cuda", visible_gpus=0), "--device cuda requested but no GPU is visible"),
    ("two ranks on a gpu", dict(device="cuda", visible_gpus=1), "would put ranks 0 and 1 on GPU 0"),
    (
        "slowdown rank",
        dict(injection=InjectionConfig(FaultPlan({2: 2.0}))),
        "--inject-slowdown rank 2 is outside world size 2",
    ),
    (
        "link",
        dict(injection=InjectionConfig(FaultPlan(link_delays={(0, 0): 5.0}))),
        "--inject-link-delay 0:0 is not a link",
    ),
    ("scope world", dict(scope=SCOPE), "--scope serves one training process"),
    ("checkpoint", dict(saved_model={"hidden_size": 64}), "checkpoint model differs: hidden_size 64 -> 32"),
    ("data", dict(data_paths=("/nonexistent/corpus.txt",)), "--data-path /nonexistent/corpus.txt does not exist"),
]


@pytest.mark.parametrize("name, change, message", TRAIN_RULES, ids=[r[0] for r in TRAIN_RULES])
def test_train_rule(name, change, message):
    _refused(train_run(**change), message)


def test_scope_needs_a_positive_period_and_a_port_on_one_process():
    run = replace(train_run(world=1, pp=1), scope=SCOPE)
    validate(run)
    _refused(replace(run, scope=replace(SCOPE, every=0)), "--scope-every must be >= 1, got 0")
    _refused(replace(run, scope=replace(SCOPE, port=-1)), "port must be in 0..65535, got -1")


INFERENCE = InferenceRun(
    load="ckpt",
    model=MODEL,
    nproc_per_node=2,
    tp_size=2,
    pp_size=1,
    world_size=2,
    vocab_size=100,
    device="cpu",
    visible_gpus=0,
    prompts=((1, 2, 3),),
    sampling=SamplingConfig(max_new_tokens=4),
)
CAPTURE = CaptureRequest(make_capture_config(["residual"], layers=[0, 3]), out="cap.safetensors")

INFERENCE_RULES = [
    ("size", dict(tp_size=0), "--tensor-model-parallel-size must be >= 1, got 0"),
    ("replica", dict(world_size=4), "generation runs one model replica"),
    ("device", dict(device="cuda"), "--device cuda requested but no GPU is visible"),
    ("vocab", dict(vocab_size=200), "tokenizer vocabulary 200 exceeds the model's 128"),
    ("prompt ids", dict(prompts=((1, 150),)), "prompt 0 has token ids outside the vocabulary"),
    ("length", dict(sampling=SamplingConfig(max_new_tokens=14)), "prompt length 3 + max new tokens 14 exceeds"),
    (
        "capture layer",
        dict(capture=replace(CAPTURE, config=make_capture_config(["residual"], layers=[4]))),
        "layer 4 is out of range",
    ),
    ("capture out", dict(capture=replace(CAPTURE, out=None)), "--out FILE is required"),
    ("port", dict(port=70000), "port must be in 0..65535, got 70000"),
]


@pytest.mark.parametrize("name, change, message", INFERENCE_RULES, ids=[r[0] for r in INFERENCE_RULES])
def test_inference_rule(name, change, message):
    _refused(replace(INFERENCE, **change), message)


def test_under_the_launcher_devices_are_not_checked_again():
    validate(replace(INFERENCE, device="cuda", visible_gpus=None))


TRACE = TraceRun(command=(__file__,), nproc_per_node=2, config=AutoTraceConfig(), faults=FaultPlan())
TRACE_RULES = [
    ("no program", dict(command=()), "no program given"),
    ("not a script", dict(command=("/nonexistent/train.py",)), "/nonexistent/train.py is not a Python script file"),
    ("ranks", dict(nproc_per_node=0), "--nproc-per-node must be >= 1, got 0"),
    ("fault", dict(faults=FaultPlan({3: 2.0})), "--inject-slowdown rank 3 is outside world size 2"),
]


@pytest.mark.parametrize("name, change, message", TRACE_RULES, ids=[r[0] for r in TRACE_RULES])
def test_trace_run_rule(name, change, message):
    _refused(replace(TRACE, **change), message)


SCHEDULE = ScheduleRun(
    pp=4,
    vpp=2,
    microbatches=8,
    schedule=None,
    dpp=DppConfig(max_inflight=4),
    weight_grad_share=0.5,
    forward_ms="1",
    backward_ms="2,2,2,3",
    jitter=(JitterSpec(2, 1.5),),
    from_trace=None,
)
SCHEDULE_RULES = [
    ("link", dict(p2p_latency_ms=-1.0), "latency, bandwidth, message bytes and decision cost must be >= 0"),
    ("w share", dict(weight_grad_share=1.0), "--weight-grad-share must be in (0, 1), got 1.0"),
    ("shape", dict(microbatches=0), "pipeline size, virtual stages and microbatches must be >= 1"),
    ("costs", dict(backward_ms="2,2"), "--backward-ms needs 1 or 4 non-negative values"),
    ("jitter", dict(jitter=(JitterSpec(4, 1.5),)), "--inject-jitter rank 4 is not on the simulated pipeline"),
    ("cap", dict(dpp=DppConfig(max_inflight=1)), "--dpp-max-inflight 1 is below the 2 activation sets"),
    ("trace", dict(from_trace="/nonexistent/trace"), "--from-trace /nonexistent/trace is not a folder"),
]


@pytest.mark.parametrize("name, change, message", SCHEDULE_RULES, ids=[r[0] for r in SCHEDULE_RULES])
def test_schedule_rule(name, change, message):
    _refused(replace(SCHEDULE, **change), message)


def test_a_static_schedule_takes_no_dynamic_cap():
    validate(replace(SCHEDULE, schedule="interleaved", dpp=DppConfig(max_inflight=1)))


@pytest.mark.parametrize(
    "argv",
    [
        ["train"],
        ["generate", "--load", "ckpt"],
        ["scope", "capture", "--load", "ckpt"],
        ["scope", "serve"],
        ["trace", "run"],
        ["schedule", "simulate"],
        ["schedule", "show"],
    ],
)
def test_every_launching_command_is_validated_by_main(argv):
    """cli.main runs build_run + validate before `launch` for every command that sets them."""
    from megatronapp.cli.main import build_parser

    args = build_parser().parse_args(argv)
    assert callable(args.build_run) and callable(args.launch) and not hasattr(args, "func")


def test_injections_come_only_from_the_inject_flags(monkeypatch):
    from megatronapp.cli.injection import build_injection_config
    from megatronapp.cli.main import build_parser

    monkeypatch.delenv("MEGATRONAPP_INJECT_SLOWDOWN", raising=False)
    monkeypatch.delenv("MEGATRONAPP_INJECT_LINK_DELAY", raising=False)
    parse = build_parser().parse_args
    none = build_injection_config(parse(["train"]))
    assert none.faults.empty and none.jitter == () and none.fbd == FbdInjection()
    inj = build_injection_config(
        parse(
            [
                "train",
                "--inject-slowdown",
                "1:2",
                "--inject-jitter",
                "3:1.5:7",
                "--forward-backward-disaggregating",
                "--inject-crash",
                "2:5",
            ]
        )
    )
    assert inj.faults.slowdowns[1].factor == 2.0 and inj.jitter == (JitterSpec(3, 1.5, 7),)
    assert inj.fbd.crash == (2, 5) and inj.fbd.random_delay_ms == 0.0
    assert inj.spec_dict == {"inject_slowdown": ["1:2"], "inject_link_delay": [], "inject_jitter": ["3:1.5:7"]}
    monkeypatch.setenv("MEGATRONAPP_INJECT_SLOWDOWN", "0:3")  # `trace run`'s carrier into a script: not train's
    assert build_injection_config(parse(["train"])).faults.empty
