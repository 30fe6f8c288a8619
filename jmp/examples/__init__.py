"""Runnable examples (``python -m jmp.examples.<name>``)."""
