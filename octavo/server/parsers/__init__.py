"""Readers of what a model writes: its reasoning (reasoning.py) and its own tool calls
(tool_calls.py), whole or streamed piece by piece; pure Python, never raising on model output."""
