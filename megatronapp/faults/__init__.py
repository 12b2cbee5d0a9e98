"""Fault injection: in-process injectors for unit tests (inject.py, link_delay.py) and the fault lab
(lab/), which slows the machine rather than the program."""
