"""Perfetto's own trace processor, run offline from packages the project declares."""
