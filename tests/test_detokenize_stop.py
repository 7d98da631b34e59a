"""Incremental detokenization with a SentencePiece-style tokenizer (pieces carry a leading-space
marker "▁", and the Metaspace decoder drops that space on the first piece it decodes), and stop
strings that span tokens, through the engine."""

import pytest
from hypothesis import given, strategies as st
from hetero_infer.core.sampling_params import SamplingParams
from hetero_infer.engine.llm import LLM
from hetero_infer.engine.tokenization import IncrementalDetokenizer
from hetero_infer.testing import tiny_hf_checkpoint

SPECIALS = ["<unk>", "<s>", "</s>"]
WORDS = ["hello", "world", "the", "cat", "sat", "on", "mat", "stop", "here", "a", "b"]
PIECES = ["lo", "he", "ll", "o", "w", "r", "ld", "ca", "t", "s", "at", "m", "e", "h", "n"]


def sentencepiece_tokenizer():
    """A small Unigram tokenizer with Metaspace pre-tokenizer and decoder, as a transformers fast
    tokenizer."""
    from tokenizers import Tokenizer, models, pre_tokenizers, decoders
    from transformers import PreTrainedTokenizerFast

    vocab = (
        [(s, 0.0) for s in SPECIALS]
        + [("\u2581" + w, -1.0) for w in WORDS]
        + [(p, -2.0) for p in PIECES]
        + [("\u2581", -3.0)]
    )
    tok = Tokenizer(models.Unigram(vocab, unk_id=0))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="always")
    tok.decoder = decoders.Metaspace(replacement="\u2581", prepend_scheme="always")
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>"
    )


TOK = sentencepiece_tokenizer()
V = len(TOK)
NORMAL = list(range(len(SPECIALS), V))  # ids of the non-special pieces


def reference_text(prompt_ids, output_ids, tok=TOK):
    "What the completion's text must be: the decoded whole minus the decoded prompt."
    full = tok.decode(prompt_ids + output_ids, skip_special_tokens=True)
    head = tok.decode(prompt_ids, skip_special_tokens=True)
    assert full.startswith(head)
    return full[len(head) :]


def detokenize(prompt_ids, output_ids, **kw):
    d = IncrementalDetokenizer(TOK, prompt_ids, **kw)
    deltas = [d.add(t) for t in output_ids]
    assert "".join(deltas) == d.text
    return d.text


def test_tokenizer_drops_the_space_without_left_context():
    "The premise: decoding a '▁word' piece alone loses the space it has after other text."
    ids = TOK.encode("hello world")
    assert TOK.convert_ids_to_tokens(ids) == ["\u2581hello", "\u2581world"]
    assert TOK.decode(ids) == "hello world" and TOK.decode(ids[1:]) == "world"


def test_incremental_detokenizer_keeps_the_space_of_the_first_output_piece():
    prompt = TOK.encode("hello")
    out = TOK.convert_tokens_to_ids(["\u2581world", "lo", "\u2581the", "\u2581", "at"])
    assert detokenize(prompt, out) == " worldlo the at" == reference_text(prompt, out)


def test_incremental_detokenizer_short_context():
    "A one-token left context is enough for the leading space; pieces glued without '▁' stay glued."
    prompt = TOK.encode("the cat sat")
    out = TOK.convert_tokens_to_ids(["at", "\u2581on", "\u2581mat", "s"])
    assert detokenize(prompt, out, context=1) == "at on mats" == reference_text(prompt, out)


@given(
    prompt=st.lists(st.sampled_from(NORMAL), min_size=1, max_size=8),
    out=st.lists(st.sampled_from(NORMAL), max_size=12),
)
def test_incremental_text_equals_decoding_the_whole(prompt, out):
    assert detokenize(prompt, out) == reference_text(prompt, out)


# ---- through the engine, with a tiny random model over this tokenizer's vocabulary


@pytest.fixture(scope="module")
def sp_llm(tmp_path_factory):
    path = tmp_path_factory.mktemp("sp_model")
    tiny_hf_checkpoint(
        path, "llama", vocab_size=V, bos_token_id=None, eos_token_id=None, pad_token_id=None
    )
    TOK.save_pretrained(path)
    return LLM(
        str(path), device="cpu", dtype="float32", block_size=4, num_blocks=64, max_model_len=128
    )


def sampled(llm, prompt, max_tokens=24, seed=11, **kw):
    p = SamplingParams(temperature=1.0, seed=seed, max_tokens=max_tokens, ignore_eos=True, **kw)
    return llm.generate([prompt], p, use_tqdm=False)[0]


def test_engine_text_equals_decoding_the_whole(sp_llm):
    """The engine's streamed text keeps each piece's leading space, including the first output
    piece's."""
    out = sampled(sp_llm, "hello world")
    c = out.outputs[0]
    assert len(c.token_ids) == 24 and c.finish_reason == "length" and c.stop_reason is None
    assert c.text == reference_text(out.prompt_token_ids, c.token_ids)
    first = TOK.convert_ids_to_tokens(c.token_ids[:1])[0]
    if first.startswith("\u2581") and len(first) > 1:
        assert c.text.startswith(" ")


def spanning_stop(prompt_ids, token_ids):
    """A stop string made of the last character of one output piece and the first of the next (so no
    single token holds it), the number of tokens the engine must have generated when it matches,
    and the text before it."""
    text = reference_text(prompt_ids, token_ids)
    for k in range(1, len(token_ids) - 1):
        a, b = (
            reference_text(prompt_ids, token_ids[:k]),
            reference_text(prompt_ids, token_ids[: k + 1]),
        )
        if len(a) < 1 or len(b) - len(a) < 1:
            continue
        stop = a[-1] + b[len(a)]
        if stop.strip() != stop:
            continue  # keep it free of leading/trailing spaces
        if any(stop in TOK.convert_ids_to_tokens([t])[0].replace("\u2581", " ") for t in token_ids):
            continue
        i = text.find(stop)
        need = next(
            j
            for j in range(1, len(token_ids) + 1)
            if stop in reference_text(prompt_ids, token_ids[:j])
        )
        return stop, need, text[:i]
    return None


def test_stop_string_spanning_tokens(sp_llm):
    """A stop string split across two tokens ends the completion: text cut before it, finish_reason
    'stop', stop_reason set."""
    free = sampled(sp_llm, "the cat sat", max_tokens=32)
    found = spanning_stop(free.prompt_token_ids, free.outputs[0].token_ids)
    assert found, f"no stop string spanning two tokens in {free.outputs[0].text!r}"
    stop, need, before = found
    got = sampled(sp_llm, "the cat sat", max_tokens=32, stop=["zzz", stop]).outputs[0]
    assert got.finish_reason == "stop" and got.stop_reason == stop
    assert got.token_ids == free.outputs[0].token_ids[:need]
    assert got.text == before
    kept = sampled(
        sp_llm, "the cat sat", max_tokens=32, stop=[stop], include_stop_str_in_output=True
    ).outputs[0]
    assert kept.text == before + stop and kept.finish_reason == "stop" and kept.stop_reason == stop


def test_streamed_text_never_shows_a_stop_string(sp_llm):
    """While running, the engine holds back text that could still turn into the stop string; no
    output ever contains it."""
    free = sampled(sp_llm, "on the mat", max_tokens=32)
    stop, need, before = spanning_stop(free.prompt_token_ids, free.outputs[0].token_ids)
    eng = sp_llm.engine
    eng.add_request(
        "stream",
        "on the mat",
        SamplingParams(temperature=1.0, seed=11, max_tokens=32, ignore_eos=True, stop=[stop]),
    )
    texts = []
    while eng.has_unfinished_requests():
        texts += [o.outputs[0].text for o in eng.step() if o.request_id == "stream"]
    assert texts[-1] == before and all(stop not in t for t in texts)
    assert all(
        before.startswith(t) for t in texts
    )  # streamed text only grows, and is a prefix of the final text
