"""Fast engine tests (a few seconds, CPU): the step loop, its counters, metrics and outputs, stop
conditions, failures and retries, aborts, and the `LLM` front end (prompt forms, chat, progress
bar, argument conversion), through the public API.

Two models: the shipped demo model (with a tokenizer and chat template; it answers "reverse: a b
c d" with "d c b a" and EOS), and a tiny random Llama without a tokenizer (token-id prompts).
Loops over `step()` are bounded, so a broken stop condition fails a test instead of hanging it."""

import itertools
import json
import shutil
import time
import types
from pathlib import Path

import pytest
import torch
import hetero_infer.engine.llm as engine_mod
from hetero_infer.core.config import EngineConfig
from hetero_infer.core.sampling_params import SamplingParams
from hetero_infer.core.config import DEMO_MODEL_DIR
from hetero_infer.engine.llm import LLM, EngineStepError, as_prompt_list, engine_kwargs
from hetero_infer.engine.llm_engine import LLMEngine
from hetero_infer.engine.tokenization import (
    IncrementalDetokenizer,
    find_stop_string,
    load_tokenizer,
)
from hetero_infer.testing import tiny_hf_checkpoint

CPU = dict(device="cpu", dtype="float32")
CHAT = [{"role": "user", "content": "reverse: a b c d"}]
ANSWER = [
    73,
    295,
    280,
    272,
    2,
]  # the demo model's greedy reply to CHAT: 'd', ' c', ' b', ' a', <|eos|>
EOS = 2
GREEDY = SamplingParams(temperature=0, max_tokens=30)
P6 = [3, 14, 15, 92, 65, 35]


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_fast")
    tiny_hf_checkpoint(path, "llama", bos_token_id=None, eos_token_id=None, pad_token_id=None)
    return path


def tiny(path, **kw):
    "A fresh engine on the tiny model (vocab 256, no tokenizer, no EOS)."
    return LLM(str(path), **{**CPU, "block_size": 4, "num_blocks": 64, "max_model_len": 64, **kw})


@pytest.fixture(scope="module")
def demo():
    return LLM(**CPU, num_blocks=64)


@pytest.fixture(scope="module")
def tok(demo):
    return demo.get_tokenizer()


def chat_ids(tok, conv=CHAT):
    return tok.encode(
        tok.apply_chat_template(conv, tokenize=False, add_generation_prompt=True),
        add_special_tokens=False,
    )


def drain(eng, max_steps=200):
    "Step until nothing is unfinished; every output step() returned, in order."
    outs = []
    for _ in range(max_steps):
        if not eng.has_unfinished_requests():
            return outs
        outs += eng.step()
    raise AssertionError(f"the engine did not finish within {max_steps} steps")


def final(outs, rid):
    (o,) = [o for o in outs if o.request_id == rid and o.finished]
    return o


def run_one(eng, prompt, params, rid="r"):
    eng.add_request(rid, prompt, params)
    return final(drain(eng), rid)


# ---- find_stop_string


def test_find_stop_string_only_sees_stops_overlapping_the_new_text():
    assert find_stop_string("stop and more", 3, ["stop"]) is None  # wholly before the new text
    assert find_stop_string("xaby", 1, ["ab"]) is None  # ended just before the new 'y'
    assert find_stop_string("xab", 1, ["ab"]) == ("ab", 1)  # ends in the new 'b'
    assert find_stop_string("ab", 2, ["ab"]) == ("ab", 0)  # at the very start
    assert find_stop_string("ab", 0, ["ab"]) is None and find_stop_string("ab", 2, []) is None


def test_find_stop_string_takes_the_earliest_match_and_the_first_listed_on_a_tie():
    assert find_stop_string("abab", 4, ["ab"]) == ("ab", 0)  # the first occurrence, not the last
    assert find_stop_string("xbcab", 5, ["ab", "bc"]) == (
        "bc",
        1,
    )  # earliest position wins over list order
    assert find_stop_string("abc", 3, ["ab", "abc"]) == ("ab", 0)  # same position: the first listed


# ---- IncrementalDetokenizer


def test_detokenizer_holds_back_a_partial_utf8_character(tok):
    ids = tok.encode("é", add_special_tokens=False)
    assert (
        len(ids) == 2 and tok.decode(ids[:1]) == "\ufffd"
    )  # the premise: one byte alone decodes to U+FFFD
    d = IncrementalDetokenizer(tok, tok.encode("say", add_special_tokens=False))
    assert [d.add(t) for t in ids] == ["", "é"] and d.text == "é"


def test_detokenizer_skips_special_tokens_by_default(tok):
    d = IncrementalDetokenizer(tok, [70])
    assert [d.add(t) for t in [73, EOS, 295]] == ["d", "", " c"] and d.text == "d c"
    keep = IncrementalDetokenizer(tok, [70], skip_special_tokens=False)
    assert "".join(keep.add(t) for t in [73, EOS]) == "d<|eos|>"


def test_detokenizer_keeps_its_context_across_a_skipped_token():
    """A skipped special token adds no text and must not move the left context (a '▁word' piece
    keeps its space)."""
    from test_detokenize_stop import TOK

    d = IncrementalDetokenizer(TOK, TOK.encode("hello"))
    world, eos = TOK.convert_tokens_to_ids(["\u2581world", "</s>"])
    assert [d.add(eos), d.add(world)] == ["", " world"]


def test_detokenizer_does_not_clean_up_spaces():
    """Text is what the tokens spell, as in vLLM: no clean-up of the space before punctuation, even
    where the tokenizer defaults to it."""
    from tokenizers import Tokenizer, models, pre_tokenizers, decoders
    from transformers import PreTrainedTokenizerFast

    t = Tokenizer(models.WordLevel({"[UNK]": 0, "hello": 1, "world": 2, ".": 3}, unk_token="[UNK]"))
    t.pre_tokenizer, t.decoder = pre_tokenizers.WhitespaceSplit(), decoders.WordPiece(cleanup=False)
    tok = PreTrainedTokenizerFast(
        tokenizer_object=t, unk_token="[UNK]", clean_up_tokenization_spaces=True
    )
    assert (
        tok.decode([1, 2, 3]) == "hello world."
    )  # the premise: this tokenizer cleans up by default
    d = IncrementalDetokenizer(tok, [1])
    assert [d.add(i) for i in (2, 3)] == [" world", " ."]


# ---- load_tokenizer


def test_load_tokenizer(tiny_path, tmp_path):
    assert (
        load_tokenizer(None) is None and load_tokenizer(tiny_path) is None
    )  # no tokenizer files: None, not an error
    assert len(load_tokenizer(DEMO_MODEL_DIR)) == 297
    with pytest.raises(ValueError) as e:
        load_tokenizer(tmp_path, required=True)
    assert str(e.value) == (
        f"tokenizer: {str(tmp_path)!r} is not a directory holding a tokenizer "
        "(none of tokenizer.json, tokenizer.model, vocab.json, tokenizer_config.json)"
    )


# ---- LLMEngine construction


def test_engine_defaults_to_the_demo_model_and_takes_keyword_overrides():
    eng = LLMEngine(EngineConfig(**CPU), num_blocks=24, block_size=8)
    assert (
        eng.config.model == str(DEMO_MODEL_DIR) and eng.config.max_model_len == 64
    )  # the model's limit
    assert (eng.config.num_blocks, eng.block_manager.num_blocks, eng.block_manager.block_size) == (
        24,
        24,
        8,
    )
    assert eng.eos_token_ids == {EOS} and eng.last_error is None and eng.stream_outputs is True
    assert eng.tokenizer is not None and eng.stats["num_blocks"] == 24


def test_engine_takes_num_blocks_from_the_runner_when_not_given(tiny_path):
    eng = LLMEngine(
        EngineConfig(model=str(tiny_path), **CPU, block_size=4, max_num_seqs=2, max_model_len=16)
    )
    assert (
        eng.config.num_blocks == eng.runner.num_blocks == eng.block_manager.num_blocks == 8
    )  # 2 seqs x 16 tokens / 4


def test_engine_rejects_a_named_tokenizer_directory_without_one(tiny_path):
    with pytest.raises(ValueError, match="is not a directory holding a tokenizer"):
        LLMEngine(EngineConfig(model=str(tiny_path), tokenizer=str(tiny_path), **CPU, num_blocks=8))


def _demo_copy(tmp_path, gen_eos, cfg_eos):
    d = tmp_path / "demo"
    shutil.copytree(DEMO_MODEL_DIR, d)
    for name, eos in (("generation_config.json", gen_eos), ("config.json", cfg_eos)):
        if eos == "missing":
            (d / name).unlink()
            continue
        c = json.loads((d / name).read_text())
        c["eos_token_id"] = eos
        (d / name).write_text(json.dumps(c))
    return d


@pytest.mark.parametrize(
    "gen_eos,cfg_eos,want", [([7, 8], 9, {2, 7, 8, 9}), ("missing", [9], {2, 9}), (None, 7, {2, 7})]
)
def test_eos_ids_are_the_union_of_both_configs_and_the_tokenizer(tmp_path, gen_eos, cfg_eos, want):
    assert (
        LLM(_demo_copy(tmp_path, gen_eos, cfg_eos), **CPU, num_blocks=8).engine.eos_token_ids
        == want
    )


# ---- prompts and add_request


def _error(fn, *a, **k) -> str:
    with pytest.raises(ValueError) as e:
        fn(*a, **k)
    return str(e.value)


def test_prompt_forms_give_the_same_ids_and_keep_the_text(demo, tok):
    eng, text = demo.engine, "reverse: a b"
    ids = tok.encode(text)
    outs = demo.generate(
        [
            text,
            {"prompt": text},
            {"prompt_token_ids": tuple(ids)},
            {"prompt_token_ids": ids, "prompt": "mine"},
        ],
        SamplingParams(temperature=0, max_tokens=2),
        use_tqdm=False,
    )
    assert [o.prompt for o in outs] == [text, text, None, "mine"]
    assert all(o.prompt_token_ids == ids for o in outs)
    assert len({tuple(o.outputs[0].token_ids) for o in outs}) == 1
    assert not eng.has_unfinished_requests()


def test_bad_prompts_are_rejected_with_a_message(tiny_path):
    eng = tiny(tiny_path).engine
    keys = "prompt dict must have 'prompt' or 'prompt_token_ids' (and nothing else), got keys"
    assert _error(eng.add_request, "a", {"prompt_ids": P6}) == f"{keys} ['prompt_ids']"
    assert (
        _error(eng.add_request, "a", {"prompt_token_ids": P6, "x": 1})
        == f"{keys} ['prompt_token_ids', 'x']"
    )
    assert _error(eng.add_request, "a", {}) == f"{keys} []"
    kinds = (
        "prompt must be a string, a list of token ids or a dict with 'prompt'/'prompt_token_ids', "
        "got"
    )
    assert _error(eng.add_request, "a", 5) == f"{kinds} int"
    assert _error(eng.add_request, "a", None) == f"{kinds} NoneType"
    assert _error(eng.add_request, "a", [1.0, 2.0]) == f"{kinds} list"
    assert _error(eng.add_request, "a", [True, 2]) == f"{kinds} list"
    assert _error(eng.add_request, "a", ["a", "b"]) == f"{kinds} list"
    assert _error(eng.add_request, "a", torch.tensor(P6)) == f"{kinds} Tensor"
    assert (
        _error(eng.add_request, "a", {"prompt_token_ids": torch.tensor(P6)})
        == "prompt_token_ids must be a list of token ids, got Tensor"
    )
    assert (
        _error(eng.add_request, "a", "text")
        == "prompt: this model directory has no tokenizer; pass token ids instead of text"
    )
    assert _error(eng.add_request, "a", {"prompt": "text"}).startswith(
        "prompt: this model directory has no tokenizer"
    )
    assert _error(eng.add_request, "a", []) == "prompt must not be empty"
    assert (
        _error(eng.add_request, "a", P6, {"max_tokens": 3})
        == "params must be SamplingParams, got dict"
    )
    assert not eng.has_unfinished_requests() and eng.counters["requests"] == 0


def test_prompt_token_ids_must_be_in_the_vocabulary(tiny_path):
    eng = tiny(tiny_path).engine
    assert (
        _error(eng.add_request, "a", [-1, 5]) == "prompt token ids must be in [0, 256), got -1..5"
    )
    assert (
        _error(eng.add_request, "a", [5, 256]) == "prompt token ids must be in [0, 256), got 5..256"
    )
    eng.add_request("ok", [0, 255], SamplingParams(max_tokens=1))  # both ends of the range are fine
    assert _error(eng.add_request, "ok", [1]) == "request_id 'ok' is already in use"
    assert final(drain(eng), "ok").outputs[0].finish_reason == "length"


def test_prompt_must_leave_room_for_one_token(tiny_path):
    eng = tiny(tiny_path, max_model_len=16).engine
    assert _error(eng.add_request, "a", list(range(16))) == (
        "prompt is 16 tokens, but max_model_len is 16 "
        "(prompt + at least one generated token must fit)"
    )
    out = run_one(eng, list(range(15)), SamplingParams(max_tokens=None, ignore_eos=True))
    assert len(out.outputs[0].token_ids) == 1 and out.outputs[0].finish_reason == "length"


def test_max_tokens_none_stops_at_max_model_len(tiny_path):
    eng = tiny(tiny_path, max_model_len=16).engine
    out = run_one(eng, list(range(10)), SamplingParams(max_tokens=None, ignore_eos=True))
    assert len(out.outputs[0].token_ids) == 6 and out.outputs[0].finish_reason == "length"


def _first_to_run(eng, *requests):
    for rid, kw in requests:
        eng.add_request(rid, P6, SamplingParams(max_tokens=2), **kw)
    first = {o.request_id for o in eng.step()}
    drain(eng)
    return first


def test_priority_orders_the_queue_and_defaults_to_zero(tiny_path):
    eng = tiny(tiny_path, max_num_seqs=1).engine
    assert _first_to_run(eng, ("low", dict(priority=5)), ("high", dict(priority=0))) == {"high"}
    assert _first_to_run(eng, ("default", {}), ("zero", dict(priority=0))) == {
        "default"
    }  # equal priority: arrival order


# ---- the step loop: counters, metrics, outputs


def test_counters_count_requests_steps_and_tokens(tiny_path):
    eng = tiny(tiny_path).engine
    run_one(eng, P6, SamplingParams(max_tokens=4, ignore_eos=True), "one")
    s = eng.stats
    assert (
        s["requests"],
        s["prompt_tokens"],
        s["steps"],
        s["generation_tokens"],
        s["batched_tokens"],
    ) == (1, 6, 4, 4, 6 + 3)
    run_one(
        eng,
        [50, 51, 52, 53, 54],
        SamplingParams(n=3, temperature=1.0, seed=3, max_tokens=4, ignore_eos=True),
        "three",
    )
    s = eng.stats  # n = 3 forks at its first token: 1 + 3 x 3 sampled tokens
    assert (
        s["requests"],
        s["prompt_tokens"],
        s["steps"],
        s["generation_tokens"],
        s["batched_tokens"],
    ) == (2, 11, 8, 4 + 12, 9 + 5 + 9)
    assert s["running"] == s["waiting"] == 0 and s["kv_usage"] == 0


def test_metrics_are_set_in_order(tiny_path):
    eng = tiny(tiny_path).engine
    t0 = time.monotonic() - 5
    eng.add_request("given", P6, SamplingParams(max_tokens=3), arrival_time=t0)
    eng.add_request("now", P6, SamplingParams(max_tokens=3))
    outs = drain(eng)
    m = final(outs, "given").metrics
    assert m.arrival_time == t0
    for m in (final(outs, "given").metrics, final(outs, "now").metrics):
        times = [
            m.arrival_time,
            m.first_scheduled_time,
            m.first_token_time,
            m.last_token_time,
            m.finished_time,
        ]
        assert all(isinstance(t, float) for t in times) and times == sorted(times)
        assert m.first_token_time < m.last_token_time  # 3 tokens over 3 steps


def test_batched_requests_equal_solo_runs(tiny_path):
    eng = tiny(tiny_path).engine
    ps = [P6, [9, 8, 7], list(range(20, 31))]
    solo = [
        run_one(eng, p, SamplingParams(temperature=0, max_tokens=5), f"s{i}").outputs[0].token_ids
        for i, p in enumerate(ps)
    ]
    for i, p in enumerate(ps):
        eng.add_request(f"b{i}", p, SamplingParams(temperature=0, max_tokens=5))
    outs = drain(eng)
    assert [final(outs, f"b{i}").outputs[0].token_ids for i in range(3)] == solo


def test_step_streams_unfinished_outputs_from_a_fresh_engine(tiny_path):
    eng = tiny(tiny_path).engine
    eng.add_request("s", P6, SamplingParams(max_tokens=3, ignore_eos=True))
    outs = drain(eng)
    assert [(o.finished, len(o.outputs[0].token_ids)) for o in outs] == [
        (False, 1),
        (False, 2),
        (True, 3),
    ]
    assert [o.outputs[0].finish_reason for o in outs] == [None, None, "length"]


def test_generate_leaves_the_engine_streaming(tiny_path):
    llm = tiny(tiny_path)
    llm.generate(P6, SamplingParams(max_tokens=2), use_tqdm=False)
    assert llm.engine.stream_outputs is True
    llm.engine.add_request("s", P6, SamplingParams(max_tokens=2))
    assert [o.finished for o in drain(llm.engine)] == [False, True]


def test_generate_builds_only_the_finished_outputs(tiny_path, monkeypatch):
    llm, built = tiny(tiny_path), []
    out = llm.engine.output
    real = out.output
    monkeypatch.setattr(out, "output", lambda req: built.append(req.request_id) or real(req))
    llm.generate([P6, P6[:3]], SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)
    assert sorted(built) == ["gen-0", "gen-1"]


def test_prefix_cache_hits_are_reported():
    demo = LLM(**CPU, num_blocks=64)  # its own engine: prefix caching is on by default
    p = list(range(6, 26))  # 20 tokens: one full block of 16 to share
    sp = SamplingParams(temperature=0, max_tokens=2)
    first, again = (
        demo.generate([p], sp, use_tqdm=False)[0],
        demo.generate([p], sp, use_tqdm=False)[0],
    )
    assert (first.num_cached_tokens, again.num_cached_tokens) == (0, 16)
    assert again.outputs[0].token_ids == first.outputs[0].token_ids
    off = LLM(**CPU, num_blocks=64, enable_prefix_caching=False)
    assert [off.generate([p], sp, use_tqdm=False)[0].num_cached_tokens for _ in range(2)] == [0, 0]


# ---- logprobs


def test_logprobs_are_decoded_and_sum_to_the_cumulative_logprob(demo, tok):
    (o,) = demo.chat(CHAT, SamplingParams(temperature=0, max_tokens=30, logprobs=2), use_tqdm=False)
    c = o.outputs[0]
    assert c.token_ids == ANSWER and len(c.logprobs) == len(ANSWER)
    chosen = [step[t].logprob for step, t in zip(c.logprobs, c.token_ids)]
    assert c.cumulative_logprob == pytest.approx(sum(chosen), abs=1e-5) and c.cumulative_logprob < 0
    assert all(lp.decoded_token == tok.decode([t]) for step in c.logprobs for t, lp in step.items())
    assert c.logprobs[0][73].decoded_token == "d"
    plain = demo.chat(CHAT, SamplingParams(temperature=0, max_tokens=30), use_tqdm=False)[
        0
    ].outputs[0]
    assert plain.logprobs is None and plain.cumulative_logprob == pytest.approx(
        c.cumulative_logprob, abs=1e-5
    )


def test_logprobs_without_a_tokenizer_are_not_decoded(tiny_path):
    c = (
        tiny(tiny_path)
        .generate(P6, SamplingParams(max_tokens=3, logprobs=1), use_tqdm=False)[0]
        .outputs[0]
    )
    assert len(c.logprobs) == 3 and all(
        t in step and all(lp.decoded_token is None for lp in step.values())
        for step, t in zip(c.logprobs, c.token_ids)
    )


# ---- stopping: EOS, stop tokens, stop strings, min_tokens


def reply(demo, **kw):
    return demo.chat(
        CHAT, SamplingParams(temperature=0, **{"max_tokens": 30, **kw}), use_tqdm=False
    )[0].outputs[0]


def test_eos_stops_unless_ignored(demo):
    c = reply(demo)
    assert (c.text, c.token_ids, c.finish_reason, c.stop_reason) == (
        "d c b a",
        ANSWER,
        "stop",
        None,
    )
    c = reply(demo, ignore_eos=True, max_tokens=8)
    assert (len(c.token_ids), c.token_ids[4], c.finish_reason) == (8, EOS, "length")


def test_min_tokens_keeps_eos_out_until_reached():
    c = reply(
        LLM(**CPU, num_blocks=64), min_tokens=8, max_tokens=10
    )  # its own engine: the sampler is told the EOS ids
    assert EOS not in c.token_ids[:8] and len(c.token_ids) >= 8


def test_stop_token_sets_the_stop_reason(demo):
    c = reply(demo, stop_token_ids=[280])
    assert (c.text, c.token_ids, c.finish_reason, c.stop_reason) == ("d c", ANSWER[:3], "stop", 280)
    c = reply(
        demo, stop_token_ids=[280], stop=["b"], include_stop_str_in_output=True
    )  # the token ended it, not the string
    assert (c.text, c.finish_reason, c.stop_reason) == ("d c b", "stop", 280)


def test_a_stop_string_is_cut_at_its_start_or_kept_whole(demo):
    "The text ends before the stop string, or with it when include_stop_str_in_output."
    assert (reply(demo, stop=[" b"]).text, reply(demo, stop=["c b"]).text) == ("d c", "d ")
    kept = reply(demo, stop=["c b"], include_stop_str_in_output=True)
    assert (kept.text, kept.stop_reason) == ("d c b", "c b")


def test_completions_carry_their_index_in_order(tiny_path):
    (o,) = tiny(tiny_path).generate(
        [P6], SamplingParams(n=3, temperature=1.0, seed=2, max_tokens=3), use_tqdm=False
    )
    assert [c.index for c in o.outputs] == [0, 1, 2]


def test_skip_special_tokens_false_keeps_eos_text(demo):
    assert (
        reply(demo, skip_special_tokens=False, include_stop_str_in_output=True).text
        == "d c b a<|eos|>"
    )
    assert reply(demo, include_stop_str_in_output=True).text == "d c b a"


def test_stop_string_counts_only_from_min_tokens(demo):
    c = reply(demo, stop=["c"], min_tokens=2)  # ' c' is the 2nd token: it may stop there
    assert (c.text, c.token_ids, c.finish_reason, c.stop_reason) == ("d ", ANSWER[:2], "stop", "c")
    c = reply(demo, stop=["c"], min_tokens=3)  # too early, and never seen again
    assert (c.text, c.finish_reason, c.stop_reason) == ("d c b a", "stop", None)


@pytest.mark.parametrize("stop,hold", [([], 0), (["zzzz"], 3), (["zz", "zzzzzzzzzzzz"], 11)])
def test_streamed_text_holds_back_the_longest_stop_minus_one(demo, tok, stop, hold):
    eng = demo.engine
    eng.add_request("hold", chat_ids(tok), SamplingParams(temperature=0, max_tokens=30, stop=stop))
    outs = [o for o in drain(eng) if o.request_id == "hold"]
    *running, last = outs
    assert last.outputs[0].text == "d c b a" and len(running) == 4
    for o in running:
        full = tok.decode(o.outputs[0].token_ids, skip_special_tokens=True)
        assert o.outputs[0].text == full[: max(0, len(full) - hold)]


# ---- n > 1

STOP_EVEN = dict(
    temperature=1.0, max_tokens=8, stop_token_ids=list(range(0, 256, 2))
)  # each completion stops at its first even token


def _uneven_pair(tiny_path):
    "An engine and a seed whose n = 2 completions both stop, after different numbers of tokens."
    for seed in range(50):
        eng = tiny(tiny_path).engine
        out = run_one(eng, P6, SamplingParams(n=2, seed=seed, **STOP_EVEN))
        lens = [len(c.token_ids) for c in out.outputs]
        stopped = all(c.finish_reason == "stop" for c in out.outputs)  # not cut at max_tokens
        if stopped and lens[0] != lens[1] and min(lens) >= 2:
            return seed, lens
    raise AssertionError("no seed gives completions of different lengths")


def test_request_finishes_when_all_n_completions_have(tiny_path):
    seed, lens = _uneven_pair(tiny_path)
    eng = tiny(tiny_path).engine
    eng.add_request("r", P6, SamplingParams(n=2, seed=seed, **STOP_EVEN))
    outs = drain(eng)
    assert [o.finished for o in outs] == [False] * (max(lens) - 1) + [True]
    assert [len(c.token_ids) for c in outs[-1].outputs] == lens
    assert all(
        c.finish_reason == "stop" and c.stop_reason == c.token_ids[-1] for c in outs[-1].outputs
    )


def test_abort_keeps_the_reason_of_a_completion_that_already_finished(tiny_path):
    seed, lens = _uneven_pair(tiny_path)
    eng = tiny(tiny_path).engine
    eng.add_request("r", P6, SamplingParams(n=2, seed=seed, **STOP_EVEN))
    for _ in range(min(lens)):
        eng.step()
    eng.abort_request("r")
    (o,) = eng.step()
    short = lens.index(min(lens))
    assert o.finished and [c.finish_reason for c in o.outputs] == [
        "stop" if i == short else "abort" for i in range(2)
    ]


# ---- aborts


def test_abort_many_skips_unknown_ids_and_counts(tiny_path):
    eng = tiny(tiny_path).engine
    for rid in "abc":
        eng.add_request(rid, P6, SamplingParams(max_tokens=10))
    eng.step()
    eng.abort_request(["missing", "a", "b"])
    eng.abort_request("missing")
    assert eng.stats["aborted"] == 2 and eng.get_num_unfinished_requests() == 1
    outs = drain(eng)
    aborted = [o for o in outs if o.request_id in "ab"]
    assert [o.request_id for o in aborted] == ["a", "b"] and all(o.finished for o in aborted)
    assert all(
        o.outputs[0].finish_reason == "abort" and len(o.outputs[0].token_ids) == 1 for o in aborted
    )
    assert final(outs, "c").outputs[0].finish_reason == "length"


# ---- failed steps


def fail_on(eng, calls, exc=lambda: RuntimeError("injected boom\nsecond line")):
    "The model's forward raises on the given 1-based call numbers (before anything is written)."
    n = itertools.count(1)

    def hook(module, args):
        if next(n) in calls:
            raise exc()

    return eng.runner.model.register_forward_pre_hook(hook)


def test_a_failed_step_is_retried_once_within_the_limit(tiny_path):
    want = [
        run_one(tiny(tiny_path).engine, p, SamplingParams(temperature=0, max_tokens=4))
        .outputs[0]
        .token_ids
        for p in (P6, P6[:4])
    ]
    eng = tiny(tiny_path, max_retry_attempts=1).engine
    fail_on(eng, {1})
    for i, p in enumerate((P6, P6[:4])):
        eng.add_request(str(i), p, SamplingParams(temperature=0, max_tokens=4))
    outs = drain(eng)
    assert [final(outs, str(i)).outputs[0].token_ids for i in range(2)] == want
    assert all(o.error is None for o in outs)
    assert (eng.counters["failed_steps"], eng.counters["retries"], eng.counters["failed"]) == (
        1,
        2,
        0,
    )
    assert isinstance(eng.last_error, RuntimeError) and str(eng.last_error).startswith(
        "injected boom"
    )


def test_a_step_failing_past_the_limit_ends_its_requests_with_an_error(tiny_path):
    eng = tiny(tiny_path, max_retry_attempts=1).engine
    fail_on(eng, set(range(1, 100)))
    for i in range(2):
        eng.add_request(str(i), P6[: 4 + i], SamplingParams(max_tokens=4))
    assert eng.step() == []  # the first failure is retried
    outs = eng.step()
    assert [o.request_id for o in outs] == ["0", "1"] and all(o.finished for o in outs)
    msg = (
        "the engine step failed 2 times (max_retry_attempts=1); last error: RuntimeError: "
        "injected boom"
    )
    assert all(
        o.error == msg and o.outputs[0].finish_reason == "error" and o.outputs[0].token_ids == []
        for o in outs
    )
    assert (eng.counters["failed_steps"], eng.counters["retries"], eng.counters["failed"]) == (
        2,
        2,
        2,
    )
    assert not eng.has_unfinished_requests() and eng.block_manager.usage() == 0


def test_generate_raises_engine_step_error_with_every_output(tiny_path):
    llm = tiny(tiny_path, max_retry_attempts=0)
    fail_on(llm.engine, {1})
    with pytest.raises(EngineStepError) as e:
        llm.generate([P6], SamplingParams(max_tokens=2), use_tqdm=False)
    err = (
        "the engine step failed 1 times (max_retry_attempts=0); last error: RuntimeError: "
        "injected boom"
    )
    assert str(e.value) == f"1 of 1 requests failed: {err}"
    assert [o.error for o in e.value.outputs] == [err] and isinstance(
        e.value.__cause__, RuntimeError
    )
    assert (
        llm.generate([P6], SamplingParams(max_tokens=2), use_tqdm=False)[0].error is None
    )  # only the first call failed


# ---- LLM front end


def test_as_prompt_list():
    assert as_prompt_list("a") == ["a"] and as_prompt_list({"prompt": "a"}) == [{"prompt": "a"}]
    assert as_prompt_list(("a", "b")) == ["a", "b"] and isinstance(as_prompt_list(("a", "b")), list)
    assert as_prompt_list([1, 2, 3]) == [[1, 2, 3]] and as_prompt_list([[1], [2]]) == [[1], [2]]
    assert as_prompt_list([True, False]) == [True, False] and as_prompt_list([]) == []
    assert (
        _error(as_prompt_list, 5)
        == "prompts must be a string, token ids, a prompt dict or a list of them, got int"
    )


def test_engine_kwargs_converts_as_vllm():
    assert engine_kwargs(None, {}) == {"model": None}
    assert engine_kwargs(Path("/m"), {"max_num_seqs": 4}) == {"model": "/m", "max_num_seqs": 4}
    out = engine_kwargs("m", {"tokenizer": Path("/t"), "dtype": torch.float16, "seed": 5})
    assert (
        out == {"model": "m", "tokenizer": "/t", "dtype": "float16", "seed": 5}
        and type(out["tokenizer"]) is str
    )
    assert engine_kwargs("m", {"tokenizer": "/t"})["tokenizer"] == "/t"
    seeds = [engine_kwargs("m", {"seed": None})["seed"] for _ in range(8)]
    assert all(isinstance(s, int) and 0 <= s < 2**32 for s in seeds) and len(set(seeds)) > 1


def test_seed_fixes_unseeded_sampling(tiny_path):
    def run(seed):
        return (
            tiny(tiny_path, seed=seed)
            .generate(P6, SamplingParams(temperature=1.0, max_tokens=12), use_tqdm=False)[0]
            .outputs[0]
            .token_ids
        )

    assert run(7) == run(7) and run(7) != run(8)


def test_generate_takes_one_params_per_prompt(tiny_path):
    llm = tiny(tiny_path)
    outs = llm.generate(
        [P6, P6[:3]], [SamplingParams(max_tokens=2), SamplingParams(max_tokens=5)], use_tqdm=False
    )
    assert [len(o.outputs[0].token_ids) for o in outs] == [2, 5]
    assert (
        _error(llm.generate, [P6, P6], [SamplingParams()], use_tqdm=False)
        == "sampling_params has 1 entries for 2 prompts"
    )


def test_a_bad_prompt_leaves_nothing_of_its_call_behind(tiny_path):
    llm = tiny(tiny_path)
    eng = llm.engine
    eng.add_request("other", P6, SamplingParams(max_tokens=4))
    eng.abort_request("other")  # someone else's abort output
    with pytest.raises(ValueError, match="no tokenizer"):
        llm.generate([P6, "text"], use_tqdm=False)
    assert eng.get_num_unfinished_requests() == 0
    assert [o.request_id for o in eng.step()] == ["other"] and not eng.has_unfinished_requests()


def test_close_runs_every_plugins_close_hook(tiny_path):
    from hetero_infer.engine.plugins import EnginePlugin

    class Closing(EnginePlugin):
        closed = 0

        def close(self, engine):
            self.closed += 1

    llm = tiny(tiny_path)
    llm.close()  # a single-process engine with nothing plugged in: nothing to do
    a, b = Closing(), Closing()
    llm.engine.plugins += [a, b]
    llm.close()
    assert (a.closed, b.closed) == (1, 1)


class Bar:
    "Records what the engine does with its progress bar."

    made = []

    def __init__(self, **kw):
        self.kw, self.updates, self.postfix = kw, [], []
        Bar.made.append(self)

    def __enter__(self):
        return self

    def __exit__(self, *a):
        return False

    def update(self, n):
        self.updates.append(n)

    def set_postfix_str(self, s):
        self.postfix.append(s)


@pytest.fixture
def bar(monkeypatch):
    Bar.made = []
    clock = itertools.count(100.0, 2.0)  # perf_counter: 100, 102, 104, ...
    monkeypatch.setattr(engine_mod, "tqdm", Bar)
    monkeypatch.setattr(
        engine_mod,
        "time",
        types.SimpleNamespace(perf_counter=lambda: next(clock), monotonic=time.monotonic),
    )
    return Bar


def test_generate_progress_bar_counts_prompts_and_tokens(tiny_path, bar):
    llm = tiny(tiny_path)
    llm.generate(
        [P6, P6[:4]],
        [
            SamplingParams(max_tokens=2, ignore_eos=True),
            SamplingParams(max_tokens=9, ignore_eos=True),
        ],
    )
    (b,) = bar.made
    assert b.kw == dict(
        total=2, desc="Processed prompts", dynamic_ncols=True, disable=False
    )  # shown by default
    assert b.updates == [1, 1]
    assert b.postfix == [
        "input: 3 toks/s, output: 1 toks/s",
        "input: 2 toks/s, output: 3 toks/s",
    ]  # (6, 2)/2 s, (10, 11)/4 s


def test_progress_bar_can_be_turned_off_and_chat_passes_it_on(demo, bar):
    demo.generate([P6], SamplingParams(max_tokens=1), use_tqdm=False)
    demo.chat(CHAT, SamplingParams(max_tokens=1))
    demo.chat(CHAT, SamplingParams(max_tokens=1), use_tqdm=False)
    assert [b.kw["disable"] for b in bar.made] == [True, False, True]


# ---- chat


def test_chat_one_or_many_conversations(demo, tok):
    (one,) = demo.chat(CHAT, GREEDY, use_tqdm=False)
    assert one.outputs[0].text == "d c b a" and one.prompt_token_ids == chat_ids(tok)
    two = demo.chat(
        [CHAT, [{"role": "user", "content": "reverse: e f g h"}]], GREEDY, use_tqdm=False
    )
    assert [o.outputs[0].text for o in two] == ["d c b a", "h g f e"]
    assert (
        len(
            demo.chat(CHAT, SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)[0]
            .outputs[0]
            .token_ids
        )
        == 2
    )
    (bare,) = demo.chat(CHAT, GREEDY, use_tqdm=False, add_generation_prompt=False)
    assert bare.prompt_token_ids == chat_ids(tok)[:-1]  # without the trailing <|assistant|>


def test_chat_does_not_add_a_second_bos(tmp_path):
    """A tokenizer that adds BOS when encoding (as Llama's does): the chat template already holds
    one, so the prompt has one."""
    from tokenizers.processors import TemplateProcessing

    llm = LLM(**CPU, num_blocks=8)
    t = llm.get_tokenizer()
    t._tokenizer.post_processor = TemplateProcessing(
        single="<|bos|> $A", special_tokens=[("<|bos|>", 1)]
    )
    assert t.encode("a")[0] == 1  # the premise: encode adds BOS
    (o,) = llm.chat(CHAT, SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)
    assert o.prompt_token_ids.count(1) == 1 and o.prompt_token_ids[0] == 1


def test_chat_needs_a_chat_template(tiny_path):
    msg = "messages: this model has no chat template"
    assert _error(tiny(tiny_path).chat, CHAT) == msg  # no tokenizer at all
    llm = LLM(**CPU, num_blocks=8)
    llm.get_tokenizer().chat_template = None
    assert _error(llm.chat, CHAT) == msg


# ---- speculative decoding (prompt lookup) changes how many steps, never what comes out


def test_speculation_gives_the_plain_outputs_in_fewer_steps():
    """The demo model copies a sorted input, so prompt lookup's proposals are accepted in runs; a
    reversal mixes in plain rows."""
    from hetero_infer.demo.task import format_prompt

    q = [
        format_prompt("sort: a b c d e f g h"),
        format_prompt("reverse: a b c d"),
        format_prompt("sort: b c d e f g h i"),
    ]
    plain = LLM(**CPU, num_blocks=64)
    spec = LLM(**CPU, num_blocks=64, speculative_method="ngram", num_speculative_tokens=5)
    for sp in (
        SamplingParams(temperature=0, max_tokens=16, logprobs=1),
        SamplingParams(n=2, temperature=0, max_tokens=16),
        SamplingParams(temperature=0, max_tokens=16, stop=["e f"]),
        SamplingParams(temperature=0, max_tokens=5),
        SamplingParams(temperature=0, max_tokens=16, min_tokens=12),
    ):
        a, b = plain.generate(q, sp, use_tqdm=False), spec.generate(q, sp, use_tqdm=False)
        for x, y in zip(a, b):
            assert [
                (c.index, c.text, c.token_ids, c.finish_reason, c.stop_reason) for c in y.outputs
            ] == [
                (c.index, c.text, c.token_ids, c.finish_reason, c.stop_reason) for c in x.outputs
            ], sp
            for cx, cy in zip(x.outputs, y.outputs):
                assert cy.cumulative_logprob == pytest.approx(cx.cumulative_logprob, abs=1e-4)
                if cx.logprobs:
                    assert [
                        {t: round(l.logprob, 3) for t, l in d.items()} for d in cy.logprobs
                    ] == [{t: round(l.logprob, 3) for t, l in d.items()} for d in cx.logprobs]
    ps, ss = plain.engine.stats, spec.engine.stats
    assert ss["generation_tokens"] == ps["generation_tokens"] and ss["steps"] < ps["steps"]
    assert (
        ss["speculative"]["num_accepted_tokens"] > 0
        and ss["speculative"]["num_draft_tokens"] > ss["speculative"]["num_accepted_tokens"]
    )
    assert (
        spec.engine.block_manager.num_free_blocks() == 64
        and not spec.engine.has_unfinished_requests()
    )


def test_prompt_token_ids_must_be_a_list():
    "{'prompt_token_ids': 'text'} is refused, not tokenized as text (found by a mutation run)."
    llm = LLM(device="cpu")
    with pytest.raises(ValueError, match="prompt_token_ids must be a list"):
        llm.generate({"prompt_token_ids": "some text"}, use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()
    assert llm.generate(
        {"prompt_token_ids": (5, 6, 7)}, SamplingParams(max_tokens=2), use_tqdm=False
    )[0].prompt_token_ids == [5, 6, 7]


# --- issue 29: chat templates, text from strangers, paths (items 3, 6, 7, 15, 18) ---


def test_chat_template_kwargs_reach_the_template(demo):
    t = demo.get_tokenizer()
    old = t.chat_template
    t.chat_template = old.replace("{{ bos_token }}", "{% if thinking %}T{% endif %}{{ bos_token }}")
    try:
        sp = SamplingParams(temperature=0, max_tokens=1)
        (a,) = demo.chat(CHAT, sp, use_tqdm=False, chat_template_kwargs={"thinking": True})
        (b,) = demo.chat(CHAT, sp, use_tqdm=False)
    finally:
        t.chat_template = old
    assert len(a.prompt_token_ids) > len(b.prompt_token_ids)


def test_a_template_that_refuses_is_a_value_error_naming_messages(demo):
    t = demo.get_tokenizer()
    old = t.chat_template
    t.chat_template = "{{ raise_exception('Conversation roles must alternate user/assistant') }}"
    try:
        msg = _error(demo.chat, CHAT, use_tqdm=False)
    finally:
        t.chat_template = old
    assert msg.startswith("messages:") and "must alternate" in msg


def test_role_tool_is_accepted_and_unknown_roles_are_named(demo):
    sp = SamplingParams(temperature=0, max_tokens=1)
    tool = [*CHAT, {"role": "tool", "content": "42"}]
    assert demo.chat(tool, sp, use_tqdm=False)[0].outputs[0].token_ids
    assert "messages[0].role" in _error(demo.chat, [{"role": "robot", "content": "x"}])


def test_a_lone_surrogate_is_a_value_error_naming_the_field(demo):
    assert _error(demo.generate, "a\ud800b", use_tqdm=False).startswith("prompt holds a lone")
    bad = [{"role": "user", "content": "a\ud800b"}]
    assert _error(demo.chat, bad, use_tqdm=False).startswith("messages[0].content holds")


def test_logit_bias_outside_the_vocabulary_is_refused_at_the_door(tiny_path):
    llm = tiny(tiny_path)
    msg = _error(llm.generate, [[1, 2]], SamplingParams(logit_bias={256: 1.0}), use_tqdm=False)
    assert msg.startswith("logit_bias:") and "[0, 256)" in msg
    assert llm.engine.requests == {}


def test_a_hub_name_says_it_is_not_a_local_directory():
    msg = _error(LLM, "meta-llama/Llama-3.2-1B")
    assert msg.startswith("model: 'meta-llama/Llama-3.2-1B' is not a local directory")
    assert "huggingface-cli download meta-llama/Llama-3.2-1B" in msg


def test_a_model_path_with_a_tilde_loads(tiny_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tiny_path.parent))
    llm = LLM(f"~/{tiny_path.name}", **CPU, num_blocks=8)
    assert llm.engine.config.model == str(tiny_path)


def test_bf16_spellings_agree():
    assert (
        EngineConfig(dtype="bf16").dtype
        == "bfloat16"
        == engine_kwargs(None, {"dtype": "bf16"})["dtype"]
    )


def test_vllm_constructor_arguments_are_taken_or_refused_by_name(tiny_path):
    "Issue 29 item 14: LLM(enforce_eager=True, ...) no longer dies with an internal TypeError."
    llm = tiny(
        tiny_path,
        enforce_eager=True,
        trust_remote_code=True,
        disable_log_stats=True,
        swap_space=4,
        tokenizer_mode="auto",
        quantization=None,
    )
    assert llm.engine.config.num_blocks == 64
    for kw, name in [
        ({"enable_lora": True}, "enable_lora"),
        ({"cpu_offload_gb": 4}, "cpu_offload_gb"),
    ]:
        msg = _error(tiny, tiny_path, **kw)
        assert msg.startswith(name) and "not supported by hetero_infer" in msg


def test_a_plugins_default_hooks_change_nothing():
    "The base hooks hold no sequence, end none, pass logits through and report nothing."
    from hetero_infer.engine.plugins import EnginePlugin

    p, logits = EnginePlugin(), torch.zeros(2, 3)
    assert EnginePlugin.create(EngineConfig()).__class__ is EnginePlugin and p.name == "plugin"
    assert p.add_sequence(None, None) is False and p.check_stop(None, None, 1) is None
    assert p.process_logits(None, logits, []) is logits and p.stats(None) == {}
    assert p.verify(None, logits, []) is None and p.make_runner(None, None) is None


# `make mutation` over chapter 07's `engine.request_state`: `append` starting from `hit = ""`
# instead of None is equivalent (both are falsy, and a hit is a tuple).
