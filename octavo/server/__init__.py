"""The OpenAI-compatible HTTP server: routes (app.py), request models (protocol.py), engine thread."""
