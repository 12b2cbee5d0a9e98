"""`megatronapp scope capture` and `megatronapp scope report` (filled in below)."""


def add_scope_subcommands(sub) -> None:
    pass
