"""The server's template workers (octavo/chat_template/isolated.py): a render past its memory
bound or deadline is a named error and its worker is replaced; a request's template cannot hold
up the model's."""

from __future__ import annotations

import asyncio

import pytest

from octavo.chat_template.isolated import TemplateRenderer
from octavo.chat_template.sandbox import RenderBudget, TemplateBudgetError, compile_chat_template, render_chat

MESSAGES = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]
TEMPLATE = ("{% for m in messages %}<|{{ m.role }}|>{{ m.content }}{{ eos_token }}{% endfor %}"
            "{% if add_generation_prompt %}<|assistant|>{% endif %}")
LOOP = "{% for a in range(100000) %}{% for b in range(100000) %}{% endfor %}{% endfor %}"


@pytest.fixture
def renderer():
    r = TemplateRenderer(RenderBudget(deadline_s=1.0, max_steps=10**12, max_chars=1 << 20), memory_bytes=128 << 20,
                         num_model_workers=1, num_request_workers=1)
    yield r
    r.close()


def run(coro):
    return asyncio.run(coro)


def test_renders_what_the_sandbox_renders(renderer):
    variables = {"eos_token": "</s>"}
    here = render_chat(compile_chat_template(TEMPLATE), MESSAGES, None, True, variables)
    assert run(renderer.render(TEMPLATE, MESSAGES, None, True, variables)) == here == \
        "<|user|>Hi</s><|assistant|>Hello</s><|assistant|>"
    assert run(renderer.render(TEMPLATE, MESSAGES, None, False, variables, continue_final_message=True)) == \
        "<|user|>Hi</s><|assistant|>Hello"


def test_a_template_error_is_a_value_error_and_keeps_the_worker(renderer):
    with pytest.raises(ValueError, match="no tools today"):
        run(renderer.render("{{ raise_exception('no tools today') }}", MESSAGES, None, True, {}))
    assert renderer.num_replaced == 0


def test_memory_bound_replaces_the_worker(renderer):
    # '%' formats before its size can be checked: the worker's address-space limit stops it
    with pytest.raises(TemplateBudgetError, match="128 MiB") as info:
        run(renderer.render("{{ '%400000000s' % 'x' }}", MESSAGES, None, True, {}, from_request=True))
    assert info.value.bound == "memory"
    assert renderer.num_replaced == 1
    assert run(renderer.render(TEMPLATE, MESSAGES, None, True, {"eos_token": "."}, from_request=True)).startswith("<|user|>")


def test_deadline_replaces_the_worker(renderer):
    with pytest.raises(TemplateBudgetError, match="within 1 s") as info:
        run(renderer.render(LOOP, MESSAGES, None, True, {}, from_request=True))
    assert info.value.bound == "deadline" and renderer.num_replaced == 1


def test_a_requests_template_does_not_hold_up_the_models(renderer):
    async def both():
        slow = asyncio.ensure_future(renderer.render(LOOP, MESSAGES, None, True, {}, from_request=True))
        text = await renderer.render(TEMPLATE, MESSAGES, None, True, {"eos_token": "."})
        held = not slow.done()
        with pytest.raises(TemplateBudgetError):
            await slow
        return text, held
    text, held = run(both())
    assert text.startswith("<|user|>Hi") and held, "the model's template waited for the request's"
