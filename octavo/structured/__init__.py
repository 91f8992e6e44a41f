"""Structured outputs: the JSON-schema check (pure Python) and the xgrammar-backed manager."""
