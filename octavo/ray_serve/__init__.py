"""Octavo replicas as a Ray Serve application (pip install 'octavo[ray]').

    serve run octavo.ray_serve:build_app model=/models/llama-3.2-1b.gguf min_replicas=1 max_replicas=4

app.py holds the deployments (an ingress that proxies the OpenAI routes, streams included, to
replicas that each run an engine and Octavo's own HTTP app) and the builder; router.py the
request router that sends a prompt to the replica holding most of its KV blocks, from what the
replicas report they cache. Nothing here is imported by the rest of Octavo; `ray` is needed only
to import these modules.
"""

from __future__ import annotations

from typing import Any


def __getattr__(name: str) -> Any:
    """`octavo.ray_serve:build_app`, the import string `serve run` and Serve's YAML take, resolved
    on first use (importing this package alone does not import ray)."""
    if name == "build_app":
        from octavo.ray_serve.app import build_app

        return build_app
    raise AttributeError(f"module 'octavo.ray_serve' has no attribute {name!r}")
