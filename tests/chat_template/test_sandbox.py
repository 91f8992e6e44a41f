"""The render budget (octavo/chat_template/sandbox.py): every hostile pattern found against the
server stops at its bound, named, before it allocates or loops for long; real templates render as
before (tests/test_tokenizer.py compares them with transformers)."""

from __future__ import annotations

import resource
import time

import pytest

from octavo.chat_template.sandbox import (
    RenderBudget,
    TemplateBudgetError,
    compile_chat_template,
    cut_after_final_message,
    render_chat,
)

MESSAGES = [{"role": "user", "content": "Hi"}]
SMALL = RenderBudget(deadline_s=5.0, max_steps=100_000, max_chars=1 << 20)


def render(source: str, budget: RenderBudget = SMALL, **variables) -> str:
    return render_chat(compile_chat_template(source), MESSAGES, None, True, variables, budget)


def bound_of(source: str, budget: RenderBudget = SMALL) -> TemplateBudgetError:
    with pytest.raises(TemplateBudgetError) as info:
        render(source, budget)
    return info.value


def test_a_real_template_renders():
    source = ("{% for m in messages %}<|{{ m.role }}|>{{ m.content | trim }}{{ '\\n' }}{% endfor %}"
              "{% if add_generation_prompt %}<|assistant|>{% endif %}")
    assert render(source) == "<|user|>Hi\n<|assistant|>"


@pytest.mark.parametrize("source", [
    "{{ 'x' * 30000000 }}",                      # the memory bomb
    "{{ ['x'] * 30000000 }}",
    "{{ 30000000 * 'x' }}",
    "{{ 'x' | center(30000000) }}",              # a filter given a width
    "{{ 'x'.ljust(30000000) }}",                 # a method given a width
    "{{ 'x' | indent(30000000, true) }}",
    "{% set ns = namespace(s='x' * 1000) %}{% for i in range(20) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}",
    "{% set ns = namespace(s='x' * 1000) %}{% for i in range(20) %}{% set ns.s = ns.s + ns.s %}{% endfor %}",
    "{{ '%30000000s' % 'x' }}",
    "{% for i in range(100000) %}{{ 'y' * 100 }}{% endfor %}",   # the text written, checked as it grows
    "{{ 10 ** 100000 }}",
    "{{ (2 ** 4000) * (2 ** 4000) }}",
])
def test_size_bound(source):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    error = bound_of(source)
    assert error.bound == "size" and "size bound" in str(error), str(error)
    # stopped before a 30-million-item allocation (~30-240 MB): the peak grew by far less
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before < 100_000, "KiB of peak RSS"


@pytest.mark.parametrize("source", [
    # the wedges: 10^10 steps that write nothing
    "{% for a in range(100000) %}{% for b in range(100000) %}{% endfor %}{% endfor %}",
    "{% for a in range(100000) %}{% for b in range(100000) %}{% if false %}x{% endif %}{% endfor %}{% endfor %}",
    "{% macro f(n) %}{% for i in range(2) %}{{ f(n) }}{% endfor %}{% endmacro %}{{ f(0) }}",
    "{% for a in range(100000) %}{{ ''.join(['a', 'b']) if false }}{{ 'x'.upper() if false }}{% endfor %}"
    "{% for a in range(100000) %}{% for b in range(100000) %}{% endfor %}{% endfor %}",
])
def test_step_bound(source):
    start = time.monotonic()
    error = bound_of(source)
    assert error.bound == "steps", str(error)
    assert time.monotonic() - start < SMALL.deadline_s  # the step bound, not the deadline, stopped it


def test_deadline_bound():
    budget = RenderBudget(deadline_s=0.3, max_steps=10**12, max_chars=1 << 20)
    start = time.monotonic()
    error = bound_of("{% for a in range(100000) %}{% for b in range(100000) %}{% endfor %}{% endfor %}", budget)
    assert error.bound == "deadline" and "0.3 s" in str(error), str(error)
    assert time.monotonic() - start < 0.3 * 20, "the deadline is read at every step"


def test_recursion_is_a_step_error():
    error = bound_of("{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}")
    assert error.bound == "steps" and "recursed" in str(error)


def test_constants_are_not_folded_at_compile_time():
    start = time.monotonic()
    compile_chat_template("{{ 'x' | center(300000000) }}{{ 'x' * 300000000 }}")  # nothing runs until render
    assert time.monotonic() - start < 5


def test_a_bad_budget_is_refused():
    with pytest.raises(ValueError, match="chat-template-timeout"):
        RenderBudget(deadline_s=float("nan"))


def test_continue_final_message_matches_transformers(smol_tokenizer):
    from octavo.tokenizer import hf_tokenizer

    hf = hf_tokenizer(smol_tokenizer)
    conversation = [{"role": "user", "content": "Name a colour."}, {"role": "assistant", "content": "Blue and "}]
    ours = smol_tokenizer.apply_chat_template(conversation, tokenize=False, continue_final_message=True)
    theirs = hf.apply_chat_template(conversation, tokenize=False, continue_final_message=True)
    assert ours == theirs and ours.endswith("assistant\nBlue and ")
    with pytest.raises(ValueError, match="does not appear"):
        cut_after_final_message("<|user|>x", {"role": "assistant", "content": "y"})
