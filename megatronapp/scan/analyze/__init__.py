"""MegaScan analysis: slow-rank and slow-link detection over recorded traces, and the HTML report."""
