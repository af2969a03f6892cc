"""Thin framework adapters: each maps its frameworks objects to keepalives neutral state."""
