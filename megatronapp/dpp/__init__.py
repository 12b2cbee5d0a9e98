"""MegaDPP: dynamic pipeline scheduling.

Each pipeline rank decides at run time which ready (chunk, microbatch) task runs next,
traversing its task matrix depth-first, breadth-first or adaptively, under a cap on the
microbatches whose activations it holds. Pure parts (task matrix, policies, scheduler
state machine, simulator) are replayable without processes; `runtime.py` executes the
decisions over asynchronous torch.distributed P2P, `cli.py` is `megatronapp schedule`.
"""
