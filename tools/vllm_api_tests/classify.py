"""What each of vLLM's tests is about, for the shim's results (run.py writes report.json):

- "standard": OpenAI's (or Anthropic's) own API behaviour;
- "vllm": one of vLLM's extensions (extra fields, flags, routes);
- "n/a": not applicable here: the test exercises vLLM's own classes (it fails on the stub, or
  its module does not import without vLLM), or it is named in NOT_APPLICABLE with the reason
  written for that test after reading it (a feature refused by name, a decision that differs
  from vLLM's, or what its own model writes while the shim serves the embedded SmolLM2-135M under
  every name). No name pattern makes a test n/a.

    python tools/vllm_api_tests/classify.py [/tmp/vllm-shim/report.json]
"""

from __future__ import annotations

import json
import re
import sys

# Tests that fail here and are not applicable, each with the reason written after reading that test
# ("module::test", parametrisations included): what the test's own model writes (the shim serves
# the embedded SmolLM2-135M under every name: a 135M model does not reason, seldom calls tools,
# and ends early), a feature refused by name (docs/API.md), or a decision that differs from vLLM's.
# A failing test not named here counts as a failure of its kind.
NOT_APPLICABLE = {
    "anthropic.test_messages::test_anthropic_streaming_cache_usage":
        "SmolLM2's template writes a default system prompt: the 'cold' request shares its first block with earlier ones",
    "anthropic.test_messages::test_anthropic_tool_call": "model: SmolLM2 must choose to call the tool (auto)",
    "openai.chat_completion.test_chat::test_complex_message_content": "model: the answer must be exactly \"2\"",
    "openai.chat_completion.test_chat::test_more_than_one_prompt_logprobs_chat":
        "model: zephyr's top-1 token equals the prompt token there; SmolLM2's does not",
    "openai.chat_completion.test_chat::test_response_format_json_object": "model: the answer must be {\"result\": 2}",
    "openai.chat_completion.test_chat::test_response_format_json_schema": "model: the answer must be {\"result\": 2}",
    "openai.chat_completion.test_chat::test_single_chat_session": "model: zephyr's template makes the prompt 37 tokens",
    "openai.chat_completion.test_chat_completion::test_kv_transfer_prompt_token_ids_round_trip":
        "refused: KV transfer between instances (disaggregated prefill) is not served",
    "openai.chat_completion.test_chat_completion::test_kv_transfer_prompt_token_ids_streaming":
        "refused: KV transfer between instances (disaggregated prefill) is not served",
    "openai.chat_completion.test_chat_echo::test_chat_session_with_echo_and_continue_final_message":
        "model: the saying must end within the shim's 256-token cap",
    "openai.chat_completion.test_completion_with_function_calling::test_function_tool_use":
        "model: Qwen3 reasons before its call (enable_thinking) or calls on its own (auto); SmolLM2 does neither, and "
        "a forced call that never began is now an error saying so (issue 60)",
    "openai.chat_completion.test_completion_with_function_calling::test_max_tokens_with_tool_choice_required":
        "decision: a forced call cut by max_tokens comes back as far as it went, with finish_reason length (issue 60); "
        "vLLM answers no call",
    "openai.chat_completion.test_completion_with_function_calling::test_named_tool_use":
        "model: SmolLM2 must close its JSON strings within 1,000 tokens",
    "openai.chat_completion.test_extra_content_fields::test_translategemma_extra_lang_code_fields":
        "model: translategemma must translate into Spanish",
    "openai.chat_completion.test_include_reasoning::test_default_includes_reasoning": "model: Qwen3 must reason",
    "openai.chat_completion.test_include_reasoning::test_include_reasoning_true_non_streaming": "model: Qwen3 must reason",
    "openai.chat_completion.test_include_reasoning::test_include_reasoning_true_streaming": "model: Qwen3 must reason",
    "openai.chat_completion.test_include_reasoning::test_reasoning_tokens_in_usage":
        "model: Qwen3 must reason (and usage's reasoning_tokens is not counted yet)",
    "openai.chat_completion.test_root_path::test_chat_session_root_path_with_api_key":
        "model: the saying must end within the shim's 256-token cap",
    "openai.chat_completion.test_thinking_token_budget::test_thinking_token_budget_limits_reasoning":
        "model: Qwen3's reasoning markers must be in the output",
    "openai.completion.test_completion::test_completion_streaming": "model: must not end within 5 tokens",
    "openai.completion.test_completion::test_parallel_no_streaming": "model: 3 samples must differ; SmolLM2 often ends at once",
    "openai.completion.test_completion::test_parallel_streaming": "model: 3 samples must differ; SmolLM2 often ends at once",
    "openai.responses.test_basic::test_chat": "model: the answer must contain 30",
    "openai.responses.test_basic::test_chat_with_input_type":
        "model: must end within the shim's 256-token cap (else the response is incomplete, as OpenAI marks it)",
    "openai.responses.test_basic::test_instructions": "model: the answer must contain 312",
    "openai.responses.test_basic::test_simple_input": "model: the answer must contain 312",
    "openai.responses.test_function_call::test_function_calling_with_streaming_expected_arguments":
        "model: Qwen3 must call the tool on its own",
    "openai.responses.test_function_call::test_function_calling_with_streaming_forced_tool_choice":
        "model: Qwen3 must call the tool on its own (auto)",
    "openai.responses.test_function_call::test_function_calling_with_streaming_types":
        "model: the stream must end within the shim's 256-token cap (else it ends with response.incomplete, as "
        "OpenAI's does, where the test waits for response.completed); with enable_thinking the forced call never "
        "begins on SmolLM2 and the stream ends with the error event that says so",
    "openai.responses.test_function_call::test_max_tokens_with_tool_choice_required":
        "decision: a forced call cut by max_output_tokens comes back as far as it went (status incomplete, issue "
        "60); vLLM answers a message item",
    "openai.responses.test_namespace_tool_separator::test_namespace_tool_separator":
        "refused: namespace tools (OpenAI's built-in tool grouping) are not run; function tools are",
    "openai.responses.test_namespace_tool_separator::test_namespace_tool_separator_streaming":
        "refused: namespace tools (OpenAI's built-in tool grouping) are not run; function tools are",
    "openai.responses.test_parsable_context::test_basic": "refused: gpt-oss's Harmony format (needs gpt_oss)",
    "openai.responses.test_parsable_context::test_function_call_first_turn": "refused: gpt-oss's Harmony format",
    "openai.responses.test_parsable_context::test_max_tokens": "refused: gpt-oss's Harmony format",
    "openai.responses.test_parsable_context::test_reasoning_and_function_items": "refused: gpt-oss's Harmony format",
    "openai.responses.test_simple::test_max_tokens": "model: must not end within 30 tokens",
    "openai.responses.test_simple::test_non_streaming_reasoning_tokens_e2e": "model: Qwen3 must reason",
    "openai.responses.test_simple::test_reasoning_item": "model: Qwen3 must reason",
    "openai.responses.test_simple::test_streaming_reasoning_tokens_e2e": "model: Qwen3 must reason",
    "openai.responses.test_stateful::test_previous_response_id": "model: must recall the name Mark from the history",
    "openai.responses.test_stateful::test_two_responses_with_same_prev_id": "model: must recall the name John",
    "openai.responses.test_structured_output::test_structured_output": "model: must name the event 'science fair'",
    "openai.responses.test_structured_output::test_structured_output_with_parse": "model: must name the event 'science fair'",
    "openai.test_openai_schema::test_openapi_stateless": "schemathesis over vLLM's own app object",
    "openai.test_return_token_ids::test_chat_completion_with_tool_use": "model: must call the tool on its own",
    "openai.test_return_token_ids::test_comparison_with_prompt_logprobs_and_logprobs":
        "model: must not end within 20 tokens (its end token is in token_ids, not in the text)",
    "openai.test_return_tokens_as_ids::test_completion_return_tokens_as_token_ids_completion":
        "model: zephyr's tokenizer (its BOS is the first token)",
    "serve.instrumentator.test_basic::test_show_version": "vLLM's version string: this server reports Octavo's",
    "serve.instrumentator.test_uds::test_show_version": "serving on a Unix socket (--uds) is not offered",
    "serve.tokenize.test_tokenization_vlm::test_tokenize_chat_expands_image_placeholders":
        "images are not served yet (and its local_asset_server fixture is vLLM's)",
    "serve.tokenize.test_tokenize_then_chat_vlm::test_tokenize_then_chat_completion_with_image":
        "images are not served yet (and its local_asset_server fixture is vLLM's)",
}
VLLM = (r"serve\.dev\.|orca|server_load|sagemaker|v2_endpoint|structured_outputs|prompt_logprobs|return_token|token_ids|truncat|continuous|force_include|root_path|echo"
        r"|thinking|reasoning|kv_transfer|per_request_metrics|lora|invocations|decisions|custom_role|long_seed"
        r"|extra_fields|chunked_prompt|stop_token|logit_bias|enable_response_messages|extra_sampling|top_logprobs"
        r"|n_parameter|min_tokens|echo|include_reasoning|models::|beam")


def classify(name: str, outcome: str, detail: str = "") -> tuple[str, str]:
    if outcome == "needs vLLM" or "_Thing" in detail:  # (a stub raised, or was used as an exception or number)
        return "n/a", "exercises vLLM's own classes"
    if name.startswith("::"):  # a module that failed to import (pybase64, gpt_oss, vLLM's own modules)
        return "n/a", "does not import without vLLM's package"
    test = name.removeprefix("tests.entrypoints.").split("[")[0]
    if outcome not in ("passed", "skipped") and test in NOT_APPLICABLE:
        return "n/a", NOT_APPLICABLE[test]
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
