"""Chat templates: rendered in jinja2's sandbox under a budget (sandbox.py), and for the server in
worker processes that a deadline or a memory bound can stop (isolated.py)."""
