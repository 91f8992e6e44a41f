"""Schemathesis fuzzes the server from its own /openapi.json: the /v1 and tokenizer routes never
answer 5xx, and every error is in the OpenAI shape. Generated bodies keep n and max_tokens small
(big values are covered by the hostile list), so the run stays short."""

from __future__ import annotations

import httpx
import schemathesis
from hypothesis import HealthCheck, given, settings

from tests.live_server import API_KEY

ROUTES = r"^/(v1/completions|v1/chat/completions|v1/responses|v1/models|tokenize|detokenize)$"


def _bounded(body, path: str):
    """Keep generation short: cap n, and max_tokens (which chat would otherwise default to the rest
    of the context, ~500 tokens)."""
    if isinstance(body, dict) and path.startswith("/v1/") and "completions" in path:
        if "max_tokens" not in body and "max_completion_tokens" not in body:
            body["max_tokens"] = 8
        for key, cap in (("n", 2), ("max_tokens", 8), ("max_completion_tokens", 8), ("min_tokens", 4)):
            if isinstance(body.get(key), int) and not isinstance(body.get(key), bool) and body[key] > cap:
                body[key] = cap
    if isinstance(body, dict) and path == "/v1/responses":
        if not isinstance(body.get("max_output_tokens"), int) or isinstance(body.get("max_output_tokens"), bool) \
                or body["max_output_tokens"] > 8:
            body["max_output_tokens"] = 8
    return body


def test_no_5xx_and_errors_in_the_openai_shape(fault_server):
    schema = schemathesis.openapi.from_url(f"{fault_server.url}/openapi.json").include(path_regex=ROUTES)
    operations = [result.ok() for result in schema.get_all_operations()]
    assert len(operations) == 6
    seen: dict[int, int] = {}
    for operation in operations:

        @given(case=operation.as_strategy())
        @settings(max_examples=100, deadline=None, suppress_health_check=list(HealthCheck), database=None)
        def check(case):
            case.body = _bounded(case.body, operation.path)
            response = case.call(headers={"Authorization": f"Bearer {API_KEY}"}, timeout=120)
            seen[response.status_code] = seen.get(response.status_code, 0) + 1
            assert response.status_code < 500, f"{operation.label}: {response.text[:500]}"
            if response.status_code >= 400:
                error = response.json()["error"]
                assert set(error) == {"message", "type", "param", "code"} and error["code"] == response.status_code

        check()
    assert seen.get(200, 0) > 0 and sum(v for k, v in seen.items() if 400 <= k < 500) > 0  # both sides reached


def test_server_is_healthy_after_fuzzing(fault_server):
    assert httpx.get(f"{fault_server.url}/health").status_code == 200
    report = httpx.get(f"{fault_server.url}/debug/kv_cache", headers={"Authorization": f"Bearer {API_KEY}"}).json()
    assert report["problems"] == []
