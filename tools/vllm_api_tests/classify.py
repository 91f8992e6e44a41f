"""What each of vLLM's tests is about, for the shim's results (run.py writes report.json):

- "standard": OpenAI's (or Anthropic's) own API behaviour;
- "vllm": one of vLLM's extensions (extra fields, flags, routes);
- "n/a": not applicable here, with the reason: the test exercises vLLM's own classes (it fails on
  the stub), needs a feature refused by name (docs/API.md), or asserts what its own model writes
  (Qwen3's reasoning and tool calls, zephyr's token counts, an answer of "2"...) while the shim
  serves the embedded SmolLM2-135M under every name: a 135M model does not reason, seldom calls
  tools, and ends early. Each such test is named below with the reason, after reading it.

    python tools/vllm_api_tests/classify.py [/tmp/vllm-shim/report.json]
"""

from __future__ import annotations

import json
import re
import sys

# (pattern on "file::test[params]", reason): the test asserts what its own model writes
MODEL_DEPENDENT = [
    (r"test_messages::test_anthropic_streaming_cache_usage",
     "SmolLM2's template writes a default system prompt: the 'cold' request shares its first block with earlier ones"),
    (r"test_messages::test_anthropic_tool_call", "the model must choose to call the tool"),
    (r"test_chat::test_single_chat_session", "zephyr's template makes the prompt 37 tokens"),
    (r"test_chat::test_more_than_one_prompt_logprobs_chat", "zephyr's top-1 token equals the prompt token there"),
    (r"test_chat::test_response_format_json_(object|schema)", "the model must answer {\"result\": 2}"),
    (r"test_chat::test_complex_message_content", "the model must answer \"2\""),
    (r"test_chat_echo::test_chat_session_with_echo_and_continue_final_message",
     "the model must end the saying within the shim's 256 tokens"),
    (r"test_root_path::test_chat_session_root_path_with_api_key",
     "the model must end the saying within the shim's 256 tokens"),
    (r"test_completion_with_function_calling::test_function_tool_use",
     "Qwen3 reasons before its call (enable_thinking) or calls on its own (auto)"),
    (r"test_completion_with_function_calling::test_named_tool_use",
     "the model must close its JSON strings within 1,000 tokens"),
    (r"test_extra_content_fields::", "translategemma must translate into Spanish"),
    (r"test_include_reasoning::", "Qwen3 must reason"),
    (r"test_thinking_token_budget::", "Qwen3's reasoning markers"),
    (r"test_completion::test_completion_streaming", "the model must not end within 5 tokens"),
    (r"test_completion::test_parallel_(no_)?streaming", "3 samples must differ: the model often ends at once"),
    (r"test_simple::test_(reasoning_item|streaming_reasoning_tokens_e2e|non_streaming_reasoning_tokens_e2e)",
     "Qwen3 must reason"),
    (r"test_simple::test_max_tokens", "the model must not end within 30 tokens"),
    (r"test_return_token_ids::test_chat_completion_with_tool_use", "the model must call the tool"),
    (r"test_return_token_ids::test_comparison_with_prompt_logprobs_and_logprobs",
     "the model must not end within 20 tokens (its end token is in token_ids, not in the text)"),
    (r"test_return_tokens_as_ids::test_completion", "zephyr's tokenizer: its BOS is the first token"),
]
# features refused by name (docs/API.md), or tests that need vLLM's package rather than a server
REFUSED = [
    (r"kv_transfer", "KV transfer between instances (disaggregated prefill) is not served"),
    (r"prompt_embeds", "prompt embeddings are not taken"),
    (r"test_harmony|test_mcp_tools|test_parsable_context", "gpt-oss's Harmony format and MCP tools"),
    (r"test_lmeval", "needs lm_eval and a 1.5B model's accuracy"),
    (r"test_tensorizer|test_token_in_token_out", "vLLM's weight loaders"),
    (r"test_openai_schema", "schemathesis over vLLM's own app object"),
]
VLLM = (r"structured_outputs|prompt_logprobs|return_token|token_ids|truncat|continuous|force_include|root_path|echo"
        r"|thinking|reasoning|kv_transfer|per_request_metrics|lora|invocations|decisions|custom_role|long_seed"
        r"|extra_fields|chunked_prompt|stop_token|logit_bias|enable_response_messages|extra_sampling|top_logprobs"
        r"|n_parameter|min_tokens|echo|include_reasoning|models::|beam")


def classify(name: str, outcome: str, detail: str = "") -> tuple[str, str]:
    if outcome == "needs vLLM" or "_Thing" in detail:  # (a stub raised, or was used as an exception or number)
        return "n/a", "exercises vLLM's own classes"
    for pattern, reason in REFUSED:
        if re.search(pattern, name):
            return "n/a", reason
    for pattern, reason in MODEL_DEPENDENT:
        if re.search(pattern, name) and outcome != "passed":
            return "n/a", f"model: {reason}"
    if name.startswith("::"):  # a module that failed to import (pybase64, vLLM's own modules at import time)
        return "n/a", "does not import without vLLM's package"
    return ("vllm" if re.search(VLLM, name) else "standard"), ""


def main() -> None:
    path = sys.argv[1] if len(sys.argv) > 1 else "/tmp/vllm-shim/report.json"
    results = json.loads(open(path).read())
    table: dict[str, dict[str, int]] = {}
    failing: list[str] = []
    for name, r in results.items():
        kind, reason = classify(name, r["outcome"], r["detail"])
        ok = r["outcome"] in ("passed", "skipped")
        table.setdefault(kind, {"passed": 0, "failed": 0})["passed" if ok else "failed"] += 1
        if kind != "n/a" and not ok:
            failing.append(f"{kind:9} {name.removeprefix('tests.entrypoints.')}: {r['detail'][:160]}")
    for kind in ("standard", "vllm", "n/a"):
        row = table.get(kind, {"passed": 0, "failed": 0})
        total = row["passed"] + row["failed"]
        share = f"{100 * row['passed'] / total:.0f}%" if total else "-"
        print(f"{kind:9} passed {row['passed']:4} failed {row['failed']:4}  ({share})")
    print("\nfailing, not n/a:")
    print("\n".join(sorted(failing)))


if __name__ == "__main__":
    main()
