"""MegaDPP: dynamic pipeline scheduling.

Each pipeline rank decides at run time which ready (chunk, microbatch) task runs next, in a
traversal's order (policies.py; default in-order: interleaved 1F1B's), under a cap on the
activation sets it holds; with the split backward, pending weight-gradient tasks (W) fill
whatever wait is left (scheduler.py). Pure parts (task matrix, policies, scheduler state
machine) are replayable without processes; `runtime.py` executes the decisions over
asynchronous torch.distributed P2P; `sim/` is the offline simulator, bounds and scenarios
behind `cli.py` (`megatronapp schedule`).
"""
