"""Point-to-point messages between ranks: one framed format (message.py) and one Outbox of
sends in flight (outbox.py), used by the static pipeline runtime, MegaDPP and MegaFBD."""
