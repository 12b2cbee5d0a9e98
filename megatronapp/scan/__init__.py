"""MegaScan: tracing, timeline merge and slow-rank / slow-link detection."""


def step() -> None:
    """Mark an iteration boundary in a program traced by `megatronapp trace run` (optional: by
    default every optimizer step is one). A no-op when the program runs untraced."""
    from megatronapp.scan.record.run import mark_step

    mark_step()
