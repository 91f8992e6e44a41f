"""octavo.tokenizer.Tokenizer (tokenizer.json through `tokenizers`, chat templates through jinja2)
against transformers' tokenizer of the same directory: the same ids, text, special tokens and
rendered chats, on the two real models and on templates that use every helper transformers gives
a template. A start that needs neither transformers' import nor its object rests on this."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest

from octavo.tokenizer import Tokenizer, load_hf_tokenizer, load_tokenizer

TEXTS = ["Hello world", " leading space", "  two  spaces ", "\n\nnew\tlines\r\n", "héllo wörld 你好 🙂 ß",
         "<|im_start|>user\nhi<|im_end|>", "<bos><start_of_turn>user x<end_of_turn>", "a" * 60, "", " ",
         "don't stop 12345 3.14159 — «quotes»", "<eos>", "<pad><unk>", "def f(x):\n    return x  # ok\n"]


@pytest.fixture(scope="module", params=["smollm2", "gemma3-270m"])
def pair(request, smol_dir):
    """(Octavo's Tokenizer, transformers' tokenizer) of a real model's directory."""
    if request.param == "smollm2":
        model_dir = smol_dir
    else:
        from octavo.models.loader import packaged_gguf, resolve_model

        model_dir = resolve_model(packaged_gguf("gemma3-270m"))
    ours = load_tokenizer(model_dir)
    assert isinstance(ours, Tokenizer), "a converted GGUF's tokenizer is served without transformers"
    return ours, load_hf_tokenizer(model_dir)


def test_ids_and_text_equal_transformers(pair):
    ours, hf = pair
    for text in TEXTS:
        for specials in (True, False):
            assert ours.encode(text, add_special_tokens=specials) == hf.encode(text, add_special_tokens=specials), text
        ids = hf.encode(text)
        for skip in (True, False):
            assert ours.decode(ids, skip_special_tokens=skip) == hf.decode(ids, skip_special_tokens=skip), text
    # every single token, as the detokenizer and the logprobs' token strings decode them
    for token_id in range(0, len(hf), max(1, len(hf) // 3000)):
        assert ours.decode([token_id]) == hf.decode([token_id]), token_id


def test_vocabulary_and_special_tokens_equal_transformers(pair):
    ours, hf = pair
    assert ours.get_vocab() == hf.get_vocab() and len(ours) == len(hf)
    assert ours.special_tokens_map == hf.special_tokens_map
    for name in ("bos_token", "eos_token", "unk_token", "pad_token", "bos_token_id", "eos_token_id", "pad_token_id"):
        assert getattr(ours, name) == getattr(hf, name), name
    assert ({i: (t.content, t.special) for i, t in ours.added_tokens_decoder.items()}
            == {i: (t.content, t.special) for i, t in hf.added_tokens_decoder.items()})
    assert ours.chat_template == hf.chat_template
    ids = hf.encode("Hello there, world")
    assert ours.convert_ids_to_tokens(ids) == hf.convert_ids_to_tokens(ids)


CHATS = [
    [{"role": "user", "content": "Hi!"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"},
     {"role": "assistant", "content": "4"}, {"role": "user", "content": "  and 3+3?  "}],
    [{"role": "user", "content": "<|im_end|> not a special \u00e9 \U0001F600", "name": None}],
]


def test_the_models_own_chat_templates_render_as_transformers(pair):
    ours, hf = pair
    for chat in CHATS:
        for gen in (True, False):
            assert (ours.apply_chat_template(chat, tokenize=False, add_generation_prompt=gen)
                    == hf.apply_chat_template(chat, tokenize=False, add_generation_prompt=gen))


# A template that reaches for everything transformers gives a template: trimmed blocks, loop
# controls, tojson with its arguments, namespace, dict, raise_exception, strftime_now, the special
# tokens as variables, tools, a generation block, reasoning under each of its names, extra variables.
TEMPLATE = """{%- set ns = namespace(count=0, last='') -%}
{{ bos_token }}{% if tools %}Tools: {{ tools | tojson }}
{{ tools[0] | tojson(indent=2, sort_keys=true) }}
{% endif %}
    {% for message in messages %}
        {% if message.role == 'skip' %}{% continue %}{% endif %}
        {% if message.role == 'stop' %}{% break %}{% endif %}
        {% set ns.count = ns.count + 1 %}
        {% set d = dict(role=message.role, n=ns.count) %}
[{{ d | tojson }}] {% if message.content is not defined %}(no content){% elif message.content is string %}{{ message.content }}{% else %}{{ message.content | tojson }}{% endif %}
{%- if message.reasoning_content is defined %} <think>{{ message.reasoning_content }}|{{ message.thinking }}</think>{% endif %}
{%- if message.tool_calls is defined %} calls={{ message.tool_calls | tojson(separators=(',', ':')) }}{% endif %}
{%- if 'name' in message %} name={{ message.name }}{% endif %}
{% if message.role == 'assistant' %}{% generation %}<{{ eos_token }}>{% endgeneration %}{% endif %}
    {% endfor %}
{% if messages | length > 5 %}{{ raise_exception('too many messages: ' ~ (messages | length)) }}{% endif %}
{% if add_generation_prompt %}assistant({{ strftime_now('%Y') }}){% if enable_thinking is defined and not enable_thinking %} no-think{% endif %}:{% endif %}
"""

TEMPLATE_CHATS = [
    [{"role": "user", "content": "héllo \"quoted\" <tag> & 你好"}],
    [{"role": "skip", "content": "x"}, {"role": "user", "content": "a", "name": None},
     {"role": "assistant", "content": None, "tool_calls": [{"type": "function", "function": {
         "name": "f", "arguments": {"x": 1, "y": [1.5, "é"]}}}]},
     {"role": "tool", "content": "42", "name": "f"},
     {"role": "stop", "content": "not rendered"}],
    [{"role": "user", "content": [{"type": "text", "text": "parts"}]},
     {"role": "assistant", "content": "b", "reasoning": "because"},
     {"role": "assistant", "content": "c", "thinking": "hmm", "reasoning_content": None}],
]
TOOLS = [{"type": "function", "function": {"name": "f", "description": "Adds. «x»", "parameters": {
    "type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]}}}]


@pytest.fixture(scope="module")
def template_pair(smol_dir, tmp_path_factory):
    """SmolLM2's tokenizer files with TEMPLATE as their chat template."""
    model_dir = tmp_path_factory.mktemp("template")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(smol_dir / name, model_dir / name)
    (model_dir / "chat_template.jinja").write_text(TEMPLATE)
    return load_tokenizer(model_dir), load_hf_tokenizer(model_dir)


def test_every_template_helper_renders_as_transformers(template_pair):
    ours, hf = template_pair
    assert isinstance(ours, Tokenizer)
    for chat in TEMPLATE_CHATS:
        for tools in (None, TOOLS):
            for extra in ({}, {"enable_thinking": False}):
                want = hf.apply_chat_template(chat, tools=tools, tokenize=False, add_generation_prompt=True, **extra)
                got = ours.apply_chat_template(chat, tools=tools, tokenize=False, add_generation_prompt=True, **extra)
                assert got == want, (chat, tools, extra)
    assert "because|because" in ours.apply_chat_template(TEMPLATE_CHATS[2], tokenize=False)  # aliased
    too_many = [{"role": "user", "content": str(i)} for i in range(6)]
    with pytest.raises(Exception, match="too many messages: 6"):
        ours.apply_chat_template(too_many, tokenize=False)


def test_templates_run_in_the_sandbox(template_pair, tmp_path):
    """A template cannot reach Python's internals, nor store an underscore name on a namespace."""
    import jinja2

    from octavo.tokenizer import compile_chat_template, render_chat

    for source in ("{{ ''.__class__.__mro__ }}", "{% set ns = namespace(_x=1) %}",
                   "{% set ns = namespace() %}{% set ns._y = 2 %}", "{{ messages.append(1) }}"):
        with pytest.raises(jinja2.exceptions.SecurityError):
            render_chat(compile_chat_template(source), [{"role": "user", "content": "x"}], None, False, {})


def test_transformers_options_and_tokenizing_go_to_transformers(template_pair):
    ours, hf = template_pair
    chat = TEMPLATE_CHATS[0]
    assert ours.apply_chat_template(chat, tokenize=True, return_dict=False) == hf.apply_chat_template(
        chat, tokenize=True, return_dict=False)
    assert ours.apply_chat_template(chat, tokenize=False, continue_final_message=True) == hf.apply_chat_template(
        chat, tokenize=False, continue_final_message=True)
    assert ours.hf is ours.hf  # made once


def test_directories_whose_config_changes_the_encoding_get_transformers(smol_dir, tmp_path):
    for key, value in (("add_bos_token", True), ("clean_up_tokenization_spaces", True),
                       ("tokenizer_class", "LlamaTokenizer")):
        model_dir = tmp_path / key
        model_dir.mkdir()
        shutil.copy(smol_dir / "tokenizer.json", model_dir / "tokenizer.json")
        config = json.loads((smol_dir / "tokenizer_config.json").read_text())
        (model_dir / "tokenizer_config.json").write_text(json.dumps({**config, key: value}))
        assert not isinstance(load_tokenizer(model_dir), Tokenizer), key


def test_loading_and_chatting_do_not_import_transformers(smol_dir):
    """The point of the class: a start (and a chat) without transformers' ~1 s import."""
    code = ("import sys; from octavo.tokenizer import load_tokenizer, apply_chat_template;"
            f"t = load_tokenizer({str(smol_dir)!r});"
            "ids = apply_chat_template(t, [{'role': 'user', 'content': 'hi'}]);"
            "t.decode(ids); t.encode('x'); t.eos_token_id;"
            "print(sorted(m for m in sys.modules if m.split('.')[0] == 'transformers'))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=True)
    assert out.stdout.strip() == "[]", out.stdout


def test_a_tokenizer_pickles(pair):
    import pickle

    ours, _ = pair
    again = pickle.loads(pickle.dumps(ours))
    assert again.encode("Hello world") == ours.encode("Hello world") and again.chat_template == ours.chat_template
