"""Conversion between the engine's checkpoints and other frameworks' model formats (Hugging Face GPT-NeoX)."""
