"""The fault lab: real faults made by the machine, which the traced program cannot see or help.

    from megatronapp.faultlab import LabPlan, EngineJob, ScriptJob, SlowRank, SlowLink, run_lab
    run_lab(LabPlan(ScriptJob("examples/ddp_train.py", ("--steps", "16"), nproc=4),
                    faults=(SlowRank(2, "quota", share=0.4),)), Path("runs/lab/trace"))

Faults (plan.py): a slow rank (a cgroup CPU quota on its process, or a busy loop pinned to its
core; either switched on and off on a Schedule for an intermittent fault); a straggler in user
code (ExtraWork: the example scripts' STRAGGLER_RANK / STRAGGLER_WORK); a slow link (SlowLink:
every rank in its own network namespace, `htb` + `u32` or `tbf` on the source's interface);
several at once; and Noise, a busy loop on every core, which must not be blamed on anyone.

Set-up and tear-down (root only; runner.run_lab does both, in this order, undoing in `finally`):
  1. Noise: one `python -c "while True: pass"` per core, killed at the end.
  2. Namespaces (nodes > 0, net.py): hub namespace `mapplab-<tag>-hub` with bridge br0, node
     namespaces `mapplab-<tag>-n<i>` with interface lab0 = 10.231.0.<i+1>/24 on a veth pair to the
     bridge. Each node runs `torchrun --nnodes N --rdzv-backend c10d --rdzv-endpoint
     10.231.0.1:29431 --local-addr <its address>` under `ip netns exec`, GLOO_SOCKET_IFNAME=lab0.
     Deleted at the end (their veths and qdiscs go with them).
  3. Once every rank's process exists: its cgroup `mapplab-<tag>-<i>` under the cpu controller
     (v1 /sys/fs/cgroup/cpu, or v2 cpu.max) with the quota, or its threads pinned with a busy loop
     on the same core; the tc qdisc on the slow link's source. Processes go back to their own
     cgroup and the lab's cgroup is removed at the end.
After a killed run, `python -m megatronapp.faultlab.cleanup` removes whatever is left by name
prefix (`mapplab-`): namespaces and cgroups.
"""

from megatronapp.faultlab.cpu import Schedule
from megatronapp.faultlab.plan import EngineJob, ExtraWork, LabPlan, Noise, ScriptJob, SlowLink, SlowRank
from megatronapp.faultlab.runner import LabResult, run_lab

__all__ = [
    "EngineJob",
    "ExtraWork",
    "LabPlan",
    "LabResult",
    "Noise",
    "Schedule",
    "ScriptJob",
    "SlowLink",
    "SlowRank",
    "run_lab",
]
