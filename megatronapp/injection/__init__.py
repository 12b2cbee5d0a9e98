"""In-process injection for tests and studies: our own code slows itself on purpose, so the
program knows (inject.py: compute slowdowns, GPU link delays; link_delay.py: late-arriving CPU
messages). The flags that ask for it are cli/injection.py's; real faults the program cannot see
are the fault lab's (faultlab/)."""
