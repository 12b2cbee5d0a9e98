"""Run by tests/engine/test_master_adam_interpret.py in a child with TRITON_INTERPRET=1: the master-AdamW
kernel (engine/master_adam.py) executed by Triton's CPU interpreter against torch's AdamW.
Prints one line per case; exits non-zero on the first mismatch."""

import os
import sys

assert os.environ.get("TRITON_INTERPRET") == "1"  # read when the kernel is defined

import torch  # noqa: E402

from megatronapp.engine.master_adam import MasterAdamW  # noqa: E402
from megatronapp.engine.precision_adam import PrecisionAwareAdamW, StatePrecision, join_master  # noqa: E402

CASES = [  # (shapes, elements per program): multi-program tensors, masked tails, both paths
    ([(513, 77), (4097,), (3,), (8192,)], 4096),  # odd sizes: scalar path
    ([(64, 32), (12288,), (16,), (8192,)], 4096),  # aligned: vector path
    ([(64, 32), (12288,), (16,), (8192,)], 1024),
    ([(40, 24), (2047,), (5,)], 512),
]


def run_case(shapes, block: int) -> float:
    torch.manual_seed(0)
    ref = [torch.randn(s) for s in shapes]
    mains = [r.clone() for r in ref]
    models = {id(m): m.to(torch.bfloat16) for m in mains}
    for m in mains:
        m.grad = torch.zeros_like(m)

    def adamw(ps):
        half = (len(ps) + 1) // 2
        return torch.optim.AdamW(
            [{"params": ps[:half], "weight_decay": 0.1}, {"params": ps[half:], "weight_decay": 0.0}],
            lr=1e-2,
            betas=(0.9, 0.95),
        )

    torch_opt, kernel_opt = adamw(ref), adamw(mains)
    kernel = MasterAdamW(kernel_opt, models, block=block, num_warps=4)
    for _ in range(3):  # tables built once, grads written in place
        grads = [torch.randn_like(r) for r in ref]
        for r, g in zip(ref, grads):
            r.grad = g / 2.0
        for m, g in zip(mains, grads):
            m.grad.copy_(g)
        torch_opt.step()
        kernel.step(torch.tensor(2.0))
    worst = 0.0
    for r, m in zip(ref, mains):
        torch.testing.assert_close(m, r, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(
            kernel_opt.state[m]["exp_avg_sq"], torch_opt.state[r]["exp_avg_sq"], rtol=1e-6, atol=0
        )
        # the interpreter truncates to bf16 (the GPU rounds to nearest even: tests/engine/test_mixed_precision.py)
        torch.testing.assert_close(models[id(m)].float(), m, rtol=2**-7, atol=0)
        worst = max(worst, float((m - r).abs().max()))
    return worst


def run_skip_case(block: int = 512) -> None:
    """A step with the skip flag set and non-finite grads leaves every tensor and counter as it was."""
    torch.manual_seed(0)
    mains = [torch.randn(s) for s in ((40, 24), (2047,))]
    models = {id(m): m.to(torch.bfloat16) for m in mains}
    opt = torch.optim.AdamW(mains, lr=1e-2)
    kernel = MasterAdamW(opt, models, block=block, num_warps=4)
    for m in mains:
        m.grad = torch.randn_like(m)
    kernel.step(None)
    before = [(m.clone(), models[id(m)].clone(), {k: v.clone() for k, v in opt.state[m].items()}) for m in mains]
    for m in mains:
        m.grad.fill_(float("nan"))
    kernel.step(None, skip=torch.tensor(1.0))
    for m, (main, model, state) in zip(mains, before):
        assert torch.equal(m, main) and torch.equal(models[id(m)], model)
        assert all(torch.equal(opt.state[m][k], v) for k, v in state.items())


def _precision_setup(start, precision: StatePrecision, block: int):
    """A PrecisionAwareAdamW over copies of `start` and its kernel: (optimizer, params, grads, kernel)."""
    params = [t.to(torch.bfloat16) if precision.param_remainders else t.clone() for t in start]
    grads = [torch.zeros_like(t) for t in start]
    grad_of = dict(zip(map(id, params), grads))
    opt = PrecisionAwareAdamW(
        [{"params": params[:2], "weight_decay": 0.1}, {"params": params[2:], "weight_decay": 0.0}],
        lr=1e-3,
        betas=(0.9, 0.95),
        eps=1e-8,
        precision=precision,
        grad_of=grad_of,
    )
    models = {id(p): p if precision.param_remainders else p.to(torch.bfloat16) for p in params}
    kernel = MasterAdamW(opt, models, block=block, num_warps=4, grad_of=grad_of, remainders=precision.param_remainders)
    return opt, params, grads, kernel


def run_precision_case(block: int = 1024) -> float:
    """The kernel with remainders equals the kernel with fp32 masters bit for bit and the
    precision-aware torch path to rounding; with bf16 moments it is within one bf16 rounding of
    the moments per step of the torch path (the interpreter truncates to bf16, torch rounds)."""
    torch.manual_seed(0)
    shapes = [(64, 32), (12288,), (16,), (2047,)]
    start = [torch.randn(s).to(torch.bfloat16).float() for s in shapes]
    fp32 = _precision_setup(start, StatePrecision(), block)
    rem = _precision_setup(start, StatePrecision(param_remainders=True), block)
    rem_torch = _precision_setup(start, StatePrecision(param_remainders=True), block)
    low = StatePrecision(exp_avg=torch.bfloat16, exp_avg_sq=torch.bfloat16, param_remainders=True)
    low_kernel, low_torch = _precision_setup(start, low, block), _precision_setup(start, low, block)
    for _ in range(3):
        for i, s in enumerate(shapes):
            g = torch.randn(s) * 10.0 ** (i - 2)
            for setup in (fp32, rem, rem_torch, low_kernel, low_torch):
                setup[2][i].copy_(g)
        for setup in (fp32, rem, low_kernel):
            setup[3].step(torch.tensor(2.0))
        for setup in (rem_torch, low_torch):
            setup[0].step(torch.tensor(2.0))
    worst = 0.0
    for i in range(len(shapes)):
        master = join_master(rem[1][i], rem[0].state[rem[1][i]]["param_remainder"])
        assert torch.equal(master.view(torch.int32), fp32[1][i].view(torch.int32)), i
        torch.testing.assert_close(master, rem_torch[0].master_value(rem_torch[1][i]), rtol=1e-6, atol=1e-6)
        mine, ref = low_kernel[0].master_value(low_kernel[1][i]), low_torch[0].master_value(low_torch[1][i])
        torch.testing.assert_close(mine, ref, rtol=0, atol=3 * 1e-3 * 2**-6)  # 3 steps of lr x a bf16 ulp
        for key in ("exp_avg", "exp_avg_sq"):  # the interpreter truncates to bf16, torch rounds to nearest
            a, b = (o[0].state[o[1][i]][key] for o in (low_kernel, low_torch))
            assert a.dtype == torch.bfloat16
            torch.testing.assert_close(a.float(), b.float(), rtol=2**-6, atol=2**-6 * float(b.float().abs().max()))
        worst = max(worst, float((mine - ref).abs().max()))
    return worst


if __name__ == "__main__":
    for shapes, block in CASES:
        print(f"shapes {shapes} block {block}: max |kernel - torch| {run_case(shapes, block):.2e}", flush=True)
    run_skip_case()
    print("skip flag: nothing written", flush=True)
    worst = run_precision_case()
    print(f"remainders: masters equal the fp32-master kernel's bit for bit; bf16 moments vs torch {worst:.2e}")
    sys.exit(0)
