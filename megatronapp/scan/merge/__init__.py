"""MegaScan merge: clock alignment, comm matching and the Chrome/Perfetto timeline writer."""
