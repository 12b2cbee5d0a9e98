"""MegaDPP offline: the event simulator, its static-schedule agents, lower bounds, the
benchmark scenarios, task costs read from traces, and Gantt/Chrome-trace rendering. Nothing
here runs during training; the run-time scheduler (dpp/scheduler.py, dpp/runtime.py) does not
import it."""
