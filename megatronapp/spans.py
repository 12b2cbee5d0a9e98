"""The span vocabulary: every category, span name and comm op the engine records and MegaScan reads.

Defined here, at the bottom of the import graph next to config/, because the engine, the
pipeline runtime and the model emit these names and must not import the scanner; MegaScan
(megatronapp.scan) imports them from here too. A new span kind is added once, in this file,
and both sides see it.
"""

from __future__ import annotations

# Categories: one per timeline track; "calib" rows carry clock calibration pairs, not spans.
CAT_STEP, CAT_COMPUTE, CAT_COMM, CAT_USER, CAT_CALIB = "step", "compute", "comm", "user", "calib"
CATEGORIES = (CAT_STEP, CAT_COMPUTE, CAT_COMM, CAT_USER, CAT_CALIB)

# Step track.
ITERATION = "iteration"  # one optimizer step, opened by step_begin and closed by step_end

# Compute track.
FORWARD, BACKWARD = "forward", "backward"  # one microbatch pass of one model chunk
COMPUTE_KINDS = (FORWARD, BACKWARD)
# split backward (parallel/wgrad_defer.py): "backward" is then B, the input gradient, and this
# the deferred weight-gradient GEMMs of one microbatch pass of one chunk
WEIGHT_GRAD = "weight_grad"
LOSS = "loss"  # nested at the end of the last stage's forward
OPTIMIZER = "optimizer"
ATTENTION, MLP = "attention", "mlp"  # per-layer detail (granularity "full")
MODULE_FORWARD, MODULE_BACKWARD = "module_forward", "module_backward"  # per-module detail, zero-code tracing
# Nested compute spans whose work differs between pipeline stages (excluded from "pure" compute).
NESTED_NON_COMPUTE = (LOSS,)

# Comm track: ops recorded by the torch.distributed instrumentation.
SEND, RECV = "send", "recv"
P2P_OPS = (SEND, RECV)
ALL_REDUCE, ALL_GATHER, REDUCE_SCATTER = "all_reduce", "all_gather", "reduce_scatter"
BROADCAST, BARRIER, ALL_TO_ALL = "broadcast", "barrier", "all_to_all"
COLLECTIVE_OPS = (ALL_REDUCE, ALL_GATHER, REDUCE_SCATTER, BROADCAST, BARRIER, ALL_TO_ALL)
# Collectives whose members all leave together; broadcast is not (the root need not wait).
SYNC_COLLECTIVES = frozenset({ALL_REDUCE, ALL_GATHER, REDUCE_SCATTER, ALL_TO_ALL, BARRIER})
# A comm span the engine records around its bucketed DP gradient reduction (no group/seq of
# its own: one instance per iteration among the DP replicas).
GRAD_REDUCE = "grad_reduce"
UNKEYED_DP_COLLECTIVES = (GRAD_REDUCE,)

# MegaFBD (megatronapp.fbd): comm-track spans of a worker blocked on the other role. A
# forward worker waits for versioned weights or for its run-ahead window to free up; a
# backward worker waits for a stage input or the forward losses. Unkeyed, like grad_reduce.
WAIT_WEIGHTS, WAIT_BACKWARD, WAIT_FORWARD = "wait_weights", "wait_backward", "wait_forward"
FBD_WAITS = (WAIT_WEIGHTS, WAIT_BACKWARD, WAIT_FORWARD)

# Written by the merge only (never recorded): the short slice at a message's arrival on the
# receiver, where its flow arrow ends (so arrows run send -> arrival in Perfetto).
ARRIVAL = "arrival"
