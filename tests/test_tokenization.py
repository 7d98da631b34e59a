"""tokenization.py: chat rendering, message checks and stop strings, each refusal with its message.

A template of our own (set on the demo model's tokenizer) renders tools, roles and the generation
prompt visibly, so every argument `render_chat` passes to it is seen in the text it makes."""

import copy

import pytest

from hetero_infer.core.config import DEMO_MODEL_DIR
from hetero_infer.engine.tokenization import (
    CHAT_ROLES,
    check_text,
    find_stop_string,
    load_tokenizer,
    render_chat,
)

TEMPLATE = (
    "{% for t in tools or [] %}T:{{ t['function']['name'] }};{% endfor %}"
    "{% for m in messages %}{{ m['role'] }}:{{ m['content'] }};{% endfor %}"
    "{% if add_generation_prompt %}A:{% endif %}{% if flavour %}F:{{ flavour }}{% endif %}"
)


@pytest.fixture(scope="module")
def tok():
    t = copy.deepcopy(load_tokenizer(DEMO_MODEL_DIR))
    t.chat_template = TEMPLATE
    return t


def text_of(tok, ids):
    return tok.decode(ids, skip_special_tokens=False)


def test_load_tokenizer_reads_the_directory():
    t = load_tokenizer(DEMO_MODEL_DIR)
    assert t.decode(t.encode("sort: a b", add_special_tokens=False)) == "sort: a b"


def test_render_chat_passes_every_argument_to_the_template(tok):
    msgs = [{"role": "user", "content": "hi"}]
    assert text_of(tok, render_chat(tok, msgs)) == "user:hi;A:"
    assert text_of(tok, render_chat(tok, msgs, add_generation_prompt=False)) == "user:hi;"
    tools = [{"type": "function", "function": {"name": "get_time", "parameters": {}}}]
    assert text_of(tok, render_chat(tok, msgs, tools=tools)) == "T:get_time;user:hi;A:"
    said = render_chat(tok, msgs, chat_template_kwargs={"flavour": "x"})
    assert text_of(tok, said) == "user:hi;A:F:x"


def test_content_parts_are_joined_and_tool_only_assistant_turns_are_empty(tok):
    parts = [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]
    msgs = [{"role": "user", "content": parts}, {"role": "assistant", "content": None}]
    msgs.append({"role": "tool", "content": "42"})
    assert text_of(tok, render_chat(tok, msgs)) == "user:ab;assistant:;tool:42;A:"
    assert CHAT_ROLES == ("system", "user", "assistant", "tool")


@pytest.mark.parametrize(
    "messages, message",
    [
        ([], "messages must be a non-empty list of messages, got []"),
        ("hi", "messages must be a non-empty list of messages, got 'hi'"),
        (["hi"], "messages[0] must be an object with role and content, got 'hi'"),
        (
            [{"role": "robot", "content": "x"}],
            "messages[0].role must be one of ('system', 'user', 'assistant', 'tool'), got 'robot'",
        ),
        (
            [{"content": "x"}],
            "messages[0].role must be one of ('system', 'user', 'assistant', 'tool'), got None",
        ),
        (
            [{"role": "user", "content": [{"type": "image_url", "image_url": "u"}]}],
            "messages[0].content: only text content parts are supported",
        ),
        (
            [{"role": "user", "content": ["plain"]}],
            "messages[0].content: only text content parts are supported",
        ),
        (
            [{"role": "user", "content": [{"type": "text", "text": 3}]}],
            "messages[0].content: a text part needs a string `text`",
        ),
        ([{"role": "user", "content": None}], "messages[0].content must be a string, got NoneType"),
        ([{"role": "user", "content": 5}], "messages[0].content must be a string, got int"),
        (
            [{"role": "user", "content": "ok"}, {"role": "user", "content": "a\ud800"}],
            "messages[1].content holds a lone UTF-16 surrogate '\\ud800' at character 1 "
            "(no UTF-8 form); send valid Unicode",
        ),
    ],
)
def test_each_bad_message_is_refused_with_its_message(tok, messages, message):
    with pytest.raises(ValueError) as e:
        render_chat(tok, messages)
    assert str(e.value) == message


@pytest.mark.parametrize(
    "kwargs",
    ["x", {"conversation": 1}, {"tools": 1}, {"tokenize": 1}, {"add_generation_prompt": 1}],
)
def test_chat_template_kwargs_that_are_not_template_variables_are_refused(tok, kwargs):
    with pytest.raises(ValueError) as e:
        render_chat(tok, [{"role": "user", "content": "hi"}], chat_template_kwargs=kwargs)
    assert str(e.value) == (
        "chat_template_kwargs must be a dict of template variables (not ['add_generation_prompt', "
        f"'conversation', 'tokenize', 'tools']), got {kwargs!r}"
    )


def test_no_template_and_a_refusing_template(tok):
    plain = copy.deepcopy(tok)
    plain.chat_template = None
    msgs = [{"role": "user", "content": "hi"}]
    with pytest.raises(ValueError, match="^messages: this model has no chat template$"):
        render_chat(plain, msgs)
    with pytest.raises(ValueError, match="^messages: this model has no chat template$"):
        render_chat(None, msgs)
    plain.chat_template = "{{ raise_exception('roles must alternate') }}"
    with pytest.raises(ValueError, match="^messages: the model's chat template refused them: "):
        render_chat(plain, msgs)


def test_check_text_names_the_field():
    assert check_text("héllo", "prompt") == "héllo"
    with pytest.raises(ValueError, match=r"^prompt holds a lone UTF-16 surrogate '\\udc00' at "):
        check_text("x\udc00", "prompt")


def test_find_stop_string_looks_only_at_new_text():
    assert find_stop_string("abcSTOP", 0, ["STOP"]) is None  # nothing new: nothing to find
    assert find_stop_string("abcSTOP", 2, []) is None
    assert find_stop_string("abcSTOP", 2, ["STOP", "cS"]) == ("STOP", 3)  # cS ends before them
    assert find_stop_string("abcSTOP", 4, ["STOP", "cS"]) == ("cS", 2)  # the earliest that overlaps
    assert find_stop_string("abSTcSTOP", 1, ["STOP"]) == ("STOP", 5)
