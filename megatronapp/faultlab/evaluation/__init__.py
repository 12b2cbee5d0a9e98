"""Evaluation of MegaScan's detection (entry point: benchmarks/scan_eval.py, CLI in cli.py).

* frozen.py / frozen_run.py: frozen splits of real faults from the fault lab: the detector's
  version is recorded before a split's scenarios are drawn, a split runs once, and a changed
  detector never re-scores it. The figures that are quoted come from here.
* injected.py / injected_runner.py / report.py: the older evaluation of the in-process fault
  injectors (scenarios from fixed seeds, scores with Wilson intervals, threshold tuning on the
  design split), kept to compare with; no accuracy figure is quoted from it.
"""
