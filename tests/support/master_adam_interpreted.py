"""Run by tests/engine/test_master_adam_interpret.py in a child with TRITON_INTERPRET=1: the master-AdamW
kernel (engine/master_adam.py) executed by Triton's CPU interpreter against torch's AdamW.
Prints one line per case; exits non-zero on the first mismatch."""

import os
import sys

assert os.environ.get("TRITON_INTERPRET") == "1"  # read when the kernel is defined

import torch  # noqa: E402

from megatronapp.engine.master_adam import MasterAdamW  # noqa: E402

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


if __name__ == "__main__":
    for shapes, block in CASES:
        print(f"shapes {shapes} block {block}: max |kernel - torch| {run_case(shapes, block):.2e}", flush=True)
    run_skip_case()
    print("skip flag: nothing written", flush=True)
    sys.exit(0)
