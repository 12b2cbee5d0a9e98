"""MegaScan recording: the tracer, the instrumentation of torch.distributed and the on-disk format."""
