"""Local launch of ranks through torch's own launcher, and naming the rank that failed.

`local.run_local_ranks` starts N ranks of a module on this machine (standalone torchrun) for
`train`, `generate`, `scope` and `trace run`; `failures.pick_root_failure` names which rank's
failure ended the job.
"""
