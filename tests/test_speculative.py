"""Speculative decoding (12_speculative_decoding): greedy output with either proposer equals greedy
output without it, for every family and under prefix caching, chunked prefill, preemption and
stop strings; sampled output keeps the target's distribution (chi-square against the exact
distribution); blocks all come back, the prefix cache holds only KV of accepted tokens, and a
failed step is retried with its proposals taken back."""

import pathlib

import pytest
import torch
from hetero_infer.core.config import EngineConfig
from hetero_infer.core.sampling_params import SamplingParams
from hetero_infer.engine.llm import LLM
from hetero_infer.testing import FAMILIES, tiny_hf_checkpoint
from hetero_infer.sample.sampler import Sampler, sampling_probs
from hetero_infer.core.sequence import Sequence, SequenceStatus
from hetero_infer.spec_decode.proposers import ngram_propose, truncated_draft
from hetero_infer.spec_decode.speculator import Speculator, speculative_metrics
from hetero_infer.engine.plugins import PLUGINS
from hetero_infer.core.config import DEMO_MODEL_DIR
from hetero_infer.demo.task import format_prompt

CPU = dict(device="cpu", dtype="float32", block_size=8)
GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=2)


def looping_prompts(vocab=256, seed=1):
    """Prompts with repeats in them, so prompt lookup finds something (a random model's greedy
    output also loops)."""
    g = torch.Generator().manual_seed(seed)
    base = [torch.randint(0, vocab, (n,), generator=g).tolist() for n in (5, 9, 13)]
    return [
        base[0] * 3,
        base[1] + base[0] + base[1][:4],
        base[2],
        base[1] * 2 + [7],
        base[2][:3] * 4,
    ]


@pytest.fixture(scope="module", params=list(FAMILIES))
def family_ckpt(request, tmp_path_factory):
    "A tiny random model of each family, its 1-layer truncated draft, and its plain greedy outputs."
    path = tmp_path_factory.mktemp(request.param)
    hf = tiny_hf_checkpoint(
        path,
        request.param,
        initializer_range=0.2,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
    )
    draft = truncated_draft(path, path / "draft", 1)
    ps = looping_prompts()
    ref = LLM(str(path), num_blocks=128, **CPU).generate(ps + ps[:2], GREEDY, use_tqdm=False)
    for p, o in zip(ps, ref):  # the reference is transformers' greedy output too
        with torch.no_grad():
            want = hf.generate(
                torch.tensor([p]),
                attention_mask=torch.ones(1, len(p), dtype=torch.long),
                max_new_tokens=GREEDY.max_tokens,
                do_sample=False,
                pad_token_id=0,
                eos_token_id=None,
            )[0, len(p) :].tolist()
        assert o.outputs[0].token_ids == want
    return path, draft, ps, ref


def same(a, b):
    for x, y in zip(a, b):
        assert x.outputs[0].token_ids == y.outputs[0].token_ids
        got = [lp[t].logprob for lp, t in zip(x.outputs[0].logprobs, x.outputs[0].token_ids)]
        want = [lp[t].logprob for lp, t in zip(y.outputs[0].logprobs, y.outputs[0].token_ids)]
        torch.testing.assert_close(torch.tensor(got), torch.tensor(want), atol=2e-4, rtol=1e-4)


@pytest.mark.parametrize("method", ["ngram", "draft"])
def test_greedy_equals_plain(family_ckpt, method):
    """Both proposers, prefix caching (prompts repeated), and then chunked prefill with preemption
    in a 10-block cache."""
    path, draft, ps, ref = family_ckpt
    kw = dict(
        speculative_method=method,
        num_speculative_tokens=3,
        speculative_model=draft if method == "draft" else None,
    )
    llm = LLM(str(path), num_blocks=128, enable_prefix_caching=True, **CPU, **kw)
    same(llm.generate(ps, GREEDY, use_tqdm=False), ref[:5])
    same(
        llm.generate(ps[:2], GREEDY, use_tqdm=False), ref[5:]
    )  # prompts seen before: their full blocks come from the cache
    st = llm.engine.stats
    assert st["speculative"]["num_draft_tokens"] > 0 and st["prefix_cache"]["cache_hits"] > 0
    if method == "ngram":
        assert st["speculative"]["num_accepted_tokens"] > 0
    tight = LLM(str(path), num_blocks=10, max_num_batched_tokens=16, max_model_len=64, **CPU, **kw)
    same(tight.generate(ps, GREEDY, use_tqdm=False), ref)
    assert tight.engine.stats["preemptions"] > 0
    assert tight.engine.block_manager.num_free_blocks() == 10


def test_draft_equal_to_target_accepts_everything(tmp_path):
    path = tmp_path / "m"
    tiny_hf_checkpoint(
        path,
        "llama",
        initializer_range=0.2,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
    )
    llm = LLM(
        str(path),
        num_blocks=64,
        **CPU,
        speculative_method="draft",
        speculative_model=str(path),
        num_speculative_tokens=4,
    )
    ps = looping_prompts()
    llm.generate(ps, GREEDY, use_tqdm=False)
    st = llm.engine.stats["speculative"]
    assert st["num_draft_tokens"] > 0 and st["acceptance_rate"] == 1.0
    llm.generate(
        ps,
        SamplingParams(temperature=0.8, top_k=50, max_tokens=24, ignore_eos=True, seed=1),
        use_tqdm=False,
    )
    assert (
        llm.engine.stats["speculative"]["acceptance_rate"] > 0.98
    )  # p == q up to float rounding across batch shapes


def demo(**kw):
    return LLM(device="cpu", **kw)


def test_stops_inside_an_accepted_run():
    """On the demo model a sorted input is copied, so whole runs are accepted: stop strings,
    max_tokens and min_tokens cut inside them."""
    q = [format_prompt("sort: a b c d e f g h"), format_prompt("sort: b c d e f g h i")]
    plain, spec = demo(), demo(speculative_method="ngram", num_speculative_tokens=5)
    for sp in (
        SamplingParams(temperature=0, max_tokens=16, stop=["e f"]),
        SamplingParams(temperature=0, max_tokens=16, stop=["d"], include_stop_str_in_output=True),
        SamplingParams(temperature=0, max_tokens=5),
        SamplingParams(temperature=0, max_tokens=16, stop_token_ids=[285]),
        SamplingParams(temperature=0, max_tokens=16, min_tokens=12),
    ):
        a, b = plain.generate(q, sp, use_tqdm=False), spec.generate(q, sp, use_tqdm=False)
        for x, y in zip(a, b):
            assert (
                y.outputs[0].text,
                y.outputs[0].token_ids,
                y.outputs[0].finish_reason,
                y.outputs[0].stop_reason,
            ) == (
                x.outputs[0].text,
                x.outputs[0].token_ids,
                x.outputs[0].finish_reason,
                x.outputs[0].stop_reason,
            ), sp
    st = spec.engine.stats["speculative"]
    assert st["num_accepted_tokens"] >= 20 and st["accepted_per_position"][4] > 0
    assert spec.engine.block_manager.num_free_blocks() == spec.engine.config.num_blocks


def test_penalties_n2_and_abort_with_speculation(tmp_path):
    path = tmp_path / "m"
    tiny_hf_checkpoint(
        path,
        "qwen2",
        initializer_range=0.2,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
    )
    ps = looping_prompts()
    plain, spec = (
        LLM(str(path), num_blocks=64, **CPU),
        LLM(str(path), num_blocks=64, **CPU, speculative_method="ngram", num_speculative_tokens=4),
    )
    sp = SamplingParams(
        n=2,
        temperature=0,
        max_tokens=20,
        ignore_eos=True,
        repetition_penalty=1.3,
        frequency_penalty=0.5,
        presence_penalty=0.2,
    )
    a, b = plain.generate(ps, sp, use_tqdm=False), spec.generate(ps, sp, use_tqdm=False)
    assert [[c.token_ids for c in o.outputs] for o in a] == [
        [c.token_ids for c in o.outputs] for o in b
    ]
    assert sorted(c.index for c in b[0].outputs) == [0, 1]
    eng = spec.engine
    eng.add_request("x", ps[0], SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))
    for _ in range(4):
        eng.step()
    eng.abort_request("x")
    while eng.has_unfinished_requests():
        eng.step()
    assert eng.block_manager.num_free_blocks() == 64


def chi2_sf(x: float, dof: int) -> float:
    return float(
        torch.special.gammaincc(
            torch.tensor(dof / 2, dtype=torch.float64), torch.tensor(x / 2, dtype=torch.float64)
        )
    )


@pytest.mark.parametrize(
    "method,params",
    [
        ("ngram", dict(temperature=1.0)),
        ("draft", dict(temperature=0.8, top_k=6, top_p=0.9)),
        (
            "draft",
            dict(
                temperature=1.0,
                min_p=0.05,
                repetition_penalty=1.5,
                presence_penalty=0.6,
                frequency_penalty=0.3,
            ),
        ),
    ],
)
def test_sampled_distribution_is_the_targets(tmp_path, method, params):
    """Tokens 2 and 3 of 3000 seeded samples on an 8-token vocabulary follow the exact target
    distribution (chi-square, p > 0.001)."""
    V, path, dpath = 8, tmp_path / "m", tmp_path / "d"
    model = tiny_hf_checkpoint(
        path,
        "llama",
        vocab_size=V,
        initializer_range=0.1,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
    )
    truncated_draft(path, dpath, 1)  # a correlated draft: accepted often, rejected often
    prompt, N = [1, 2, 3, 1, 2, 5, 1, 2], 3000
    sp = [SamplingParams(max_tokens=3, ignore_eos=True, seed=i, **params) for i in range(N)]
    llm = LLM(
        str(path),
        num_blocks=512,
        max_num_seqs=256,
        **CPU,
        speculative_method=method,
        num_speculative_tokens=2,
        speculative_model=str(dpath) if method == "draft" else None,
    )
    outs = llm.generate([prompt] * N, sp, use_tqdm=False)
    st = llm.engine.stats["speculative"]
    assert 0.05 < st["acceptance_rate"] < 0.95  # both the accept and the reject paths ran

    def probs(ctx):  # the plain sampler's distribution after `ctx` (penalties included)
        with torch.no_grad():
            x = model(torch.tensor([ctx])).logits[0, -1].float()
        p = SamplingParams(**params)
        x = Sampler().adjust_logits(x[None], [Sequence(0, "r", ctx, len(prompt), p)])
        return sampling_probs(
            x,
            torch.tensor([p.temperature]),
            torch.tensor([min(p.top_k, V) if p.top_k > 0 else V]),
            torch.tensor([p.top_p]),
            torch.tensor([p.min_p]),
        )[0]

    p1 = probs(prompt)
    exact = torch.zeros(V, V, V, dtype=torch.float64)  # P(t1, t2, t3)
    for a in range(V):
        if p1[a] == 0:
            continue
        p2 = probs(prompt + [a])
        for b in range(V):
            if p2[b] > 0:
                exact[a, b] = p1[a] * p2[b] * probs(prompt + [a, b]).double()
    seen = torch.zeros(V, V, V, dtype=torch.float64)
    for o in outs:
        seen[tuple(o.outputs[0].token_ids)] += 1
    e, s = exact.flatten() * N, seen.flatten()
    assert s[e == 0].sum() == 0  # nothing outside the filtered support
    big = e >= 5  # pool the cells with small expected counts
    e_, s_ = torch.cat([e[big], e[~big].sum()[None]]), torch.cat([s[big], s[~big].sum()[None]])
    stat = float(((s_ - e_) ** 2 / e_.clamp_min(1e-9)).sum())
    assert chi2_sf(stat, len(e_) - 1) > 1e-3, (stat, len(e_))


def test_seeded_requests_reproduce():
    q = [format_prompt("sort: a b c d e f g"), format_prompt("reverse: q w e r")]
    sp = SamplingParams(temperature=1.0, max_tokens=12, seed=7)
    spec = demo(speculative_method="ngram", num_speculative_tokens=4)
    a = spec.generate(q, sp, use_tqdm=False)
    b = spec.generate(q[::-1] + q, sp, use_tqdm=False)  # another batch around them
    assert [o.outputs[0].token_ids for o in a] == [
        b[1].outputs[0].token_ids,
        b[0].outputs[0].token_ids,
    ]
    assert [o.outputs[0].token_ids for o in a] == [o.outputs[0].token_ids for o in b[2:]]


def test_prefix_cache_holds_only_accepted_kv(tmp_path):
    """A draft that is mostly rejected writes KV for many rejected tokens: none of it is cached, and
    reusing the cache changes nothing."""
    path, dpath = tmp_path / "m", tmp_path / "d"
    tiny_hf_checkpoint(
        path,
        "llama",
        initializer_range=0.2,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
    )
    tiny_hf_checkpoint(
        dpath,
        "llama",
        seed=9,
        initializer_range=0.2,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
    )
    ps, sp = looping_prompts(), SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    llm = LLM(
        str(path),
        num_blocks=128,
        **CPU,
        speculative_method="draft",
        speculative_model=str(dpath),
        num_speculative_tokens=4,
    )
    outs = llm.generate(ps, sp, use_tqdm=False)
    bm = llm.engine.block_manager
    assert (
        llm.engine.stats["speculative"]["acceptance_rate"] < 0.5
        and bm.num_free_blocks() == bm.num_blocks
    )
    written = set()
    for o in outs:
        toks = o.prompt_token_ids + o.outputs[0].token_ids
        written |= {tuple(toks[i : i + 8]) for i in range(0, len(toks) - 7, 8)}
    cached = [bm.blocks[b].token_ids for b in bm.cache.cached.values()]
    assert cached and all(t in written for t in cached)
    again = LLM(str(path), num_blocks=128, **CPU).generate(
        [o.prompt_token_ids + o.outputs[0].token_ids[:20] for o in outs],
        SamplingParams(temperature=0, max_tokens=10, ignore_eos=True),
        use_tqdm=False,
    )
    reuse = llm.generate(
        [o.prompt_token_ids + o.outputs[0].token_ids[:20] for o in outs],
        SamplingParams(temperature=0, max_tokens=10, ignore_eos=True),
        use_tqdm=False,
    )
    assert all(r.num_cached_tokens > 0 for r in reuse)
    assert [r.outputs[0].token_ids for r in reuse] == [r.outputs[0].token_ids for r in again]


def test_ngram_propose():
    assert ngram_propose([1, 2, 3, 9, 1, 2], 2) == [
        3,
        9,
    ]  # the longest suffix [1, 2] matched, then what followed
    assert ngram_propose([1, 2, 3, 4, 2, 3, 5, 3], 3) == [
        5,
        3,
    ]  # latest occurrence of [3]: the one before 5
    assert ngram_propose([4, 5, 6], 3) == []
    assert ngram_propose([7, 7, 7], 2, n_min=1, n_max=2) == [
        7
    ]  # a match may run into the suffix itself


def test_config_errors_name_the_field(tmp_path):
    for kw, field in [
        (dict(speculative_method="medusa"), "speculative_method"),
        (dict(speculative_method="draft"), "speculative_model"),
        (dict(num_speculative_tokens=0, speculative_method="ngram"), "num_speculative_tokens"),
        (dict(speculative_model="x"), "speculative_model"),
        (dict(prompt_lookup_min=4, prompt_lookup_max=2), "prompt_lookup_min"),
    ]:
        with pytest.raises(ValueError, match=field):
            EngineConfig(**kw)
    other = tmp_path / "v"
    tiny_hf_checkpoint(other, "llama", vocab_size=300)
    with pytest.raises(ValueError, match="speculative_model.*vocab_size"):
        LLM(device="cpu", speculative_method="draft", speculative_model=str(other))
    with pytest.raises(ValueError, match="speculative_model"):
        LLM(device="cpu", speculative_method="draft", speculative_model=str(tmp_path / "missing"))


def test_verification_through_the_triton_backend():
    """The verification chunk runs through the Triton kernels too (the interpreter on a CPU): same
    greedy tokens, proposals accepted."""
    qs = [
        format_prompt("sort: a b c d e f g h"),
        format_prompt("reverse: a b c"),
        format_prompt("sort: b a c d e"),
    ]
    sp = SamplingParams(temperature=0, max_tokens=12)
    ref = [o.outputs[0].token_ids for o in demo().generate(qs, sp, use_tqdm=False)]
    llm = demo(attention_backend="triton", speculative_method="ngram", num_speculative_tokens=4)
    assert [o.outputs[0].token_ids for o in llm.generate(qs, sp, use_tqdm=False)] == ref
    assert llm.engine.stats["speculative"]["num_accepted_tokens"] > 0


# --- proposals trimmed by the budget, the cache or n > 1 ---


def test_draft_speculation_with_a_small_budget_does_not_crash():
    """A budget or a cache too small for every proposal: the draft's sync must still feed its last
    token again (never ask for 0 slots)."""
    d, sp = str(DEMO_MODEL_DIR), SamplingParams(temperature=0, max_tokens=12)
    prompts = [[1, 5, 6, 7], [1, 8, 9, 10]]
    plain = LLM(d, **CPU, num_blocks=64).generate(prompts, sp, use_tqdm=False)
    kw = dict(speculative_method="draft", speculative_model=d, num_speculative_tokens=3)
    got = LLM(d, **CPU, num_blocks=64, max_num_batched_tokens=6, **kw)
    for a, b in zip(got.generate(prompts, sp, use_tqdm=False), plain):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
    six = [[1, 5 + i, 6, 7, 8 + i] for i in range(6)]
    sp2 = SamplingParams(temperature=0, max_tokens=10, n=2)
    plain = LLM(d, **CPU, num_blocks=64).generate(six, sp2, use_tqdm=False)
    tight = LLM(d, device="cpu", dtype="float32", block_size=4, num_blocks=20, **kw)
    for a, b in zip(tight.generate(six, sp2, use_tqdm=False), plain):
        assert [c.token_ids for c in a.outputs] == [c.token_ids for c in b.outputs]


@pytest.mark.parametrize("method", ["ngram", "draft"])
def test_trimmed_proposals_keep_greedy_output(family_ckpt, method):
    """Random small budgets, tight caches, n in {1, 2}, k in [1, 4]: greedy output stays plain
    greedy."""
    import random

    path, draft, ps, _ = family_ckpt
    sp = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    outs = LLM(str(path), num_blocks=128, **CPU).generate(ps, sp, use_tqdm=False)
    plain = {tuple(p): o.outputs[0].token_ids for p, o in zip(ps, outs)}
    rng = random.Random(f"{path.name}-{method}")
    extra = dict(speculative_model=str(draft)) if method == "draft" else {}
    for _ in range(3):
        n, prompts = rng.choice([1, 2]), rng.sample(ps, rng.randint(2, len(ps)))
        llm = LLM(
            str(path),
            device="cpu",
            dtype="float32",
            block_size=4,
            num_blocks=rng.randint(14, 40),
            max_num_batched_tokens=rng.randint(2, 12),
            max_num_seqs=rng.randint(2, 6),
            speculative_method=method,
            num_speculative_tokens=rng.randint(1, 4),
            **extra,
        )
        got = llm.generate(
            prompts,
            SamplingParams(temperature=0, max_tokens=10, n=n, ignore_eos=True),
            use_tqdm=False,
        )
        for p, o in zip(prompts, got):
            assert [c.token_ids for c in o.outputs] == [plain[tuple(p)]] * n
        assert llm.engine.block_manager.num_free_blocks() == llm.engine.config.num_blocks


def test_the_plugin_is_registered_and_off_by_default():
    assert Speculator in PLUGINS
    assert Speculator.create(EngineConfig()) is None
    llm = demo()
    assert "speculative" not in llm.engine.stats
    assert not any(isinstance(p, Speculator) for p in llm.engine.plugins)


def test_a_failed_step_takes_its_proposals_back_and_the_retry_gives_the_same_output():
    """The forward pass raises once in a speculating step: the step's proposals leave the
    sequences before the retry, and the output is the run without the failure."""
    q = [format_prompt("sort: a b c d e f g h"), format_prompt("reverse: a b c d")]
    sp = SamplingParams(temperature=0, max_tokens=16)
    want = [o.outputs[0].token_ids for o in demo().generate(q, sp, use_tqdm=False)]
    llm = demo(speculative_method="ngram", num_speculative_tokens=4)
    eng = llm.engine
    spec = next(p for p in eng.plugins if isinstance(p, Speculator))
    seen = []

    def boom(module, args):
        if spec.proposals.seqs and not seen:  # the first forward pass with proposals in it
            seen.append({s.seq_id: list(s.token_ids) for s in spec.proposals.seqs.values()})
            raise RuntimeError("injected")

    hook = eng.runner.model.register_forward_pre_hook(boom)
    try:
        got = llm.generate(q, sp, use_tqdm=False)
    finally:
        hook.remove()
    assert seen and seen[0], "the failing step carried proposals"
    assert not spec.proposals.seqs and eng.counters["failed_steps"] == 1
    assert [o.outputs[0].token_ids for o in got] == want
    assert eng.block_manager.num_free_blocks() == eng.config.num_blocks


def test_a_request_failing_while_speculating_ends_without_unverified_tokens():
    """Every forward pass from the first speculating step on raises: before each retry the
    step's proposals have left the sequence; past max_retry_attempts the request ends in "error"
    with only the tokens verified before the failures, and every block comes back."""
    from hetero_infer.testing import fail_forward

    q = format_prompt("sort: a b c d e f g h")
    sp = SamplingParams(temperature=0, max_tokens=16)
    want = demo().generate([q], sp, use_tqdm=False)[0].outputs[0].token_ids

    def run(fail_from=None):
        "Step the request to its end; per forward pass, (proposals, verified output tokens)."
        llm = demo(speculative_method="ngram", num_speculative_tokens=4, max_retry_attempts=2)
        eng = llm.engine
        spec = next(p for p in eng.plugins if isinstance(p, Speculator))
        passes = []

        def spy(module, args):
            s = eng.requests["r"].seqs[0]
            k = spec.proposals.num.get(s.seq_id, 0)
            passes.append((k, s.num_output_tokens - k))

        hooks = [eng.runner.model.register_forward_pre_hook(spy)]
        if fail_from is not None:
            hooks.append(fail_forward(eng.runner.model, set(range(fail_from, 100)))[0])
        eng.add_request("r", q, sp)
        outs, seq = [], eng.requests["r"].seqs[0]
        try:
            while eng.has_unfinished_requests():
                outs += eng.step()
                if eng.counters["failed_steps"] and "r" in eng.requests:  # a retry comes
                    assert not spec.proposals.seqs
                    assert seq.output_token_ids == want[: seq.num_output_tokens]
        finally:
            for h in hooks:
                h.remove()
        return eng, spec, passes, outs

    _, _, passes, _ = run()
    first = next(i for i, (k, _) in enumerate(passes) if k)  # the first speculating pass
    eng, spec, failed, outs = run(first + 1)
    assert failed[first:] == [passes[first]] * 3  # it and its two retries carry proposals
    out = outs[-1]
    assert out.finished and [o.request_id for o in outs if o.finished] == ["r"]
    assert out.outputs[0].finish_reason == "error" and eng.counters["failed_steps"] == 3
    assert out.outputs[0].token_ids == want[: passes[first][1]]  # verified tokens, no proposal
    assert out.outputs[0].text == eng.tokenizer.decode(out.outputs[0].token_ids)
    assert not spec.proposals.seqs
    assert eng.block_manager.num_free_blocks() == eng.config.num_blocks


def test_the_metrics_lines():
    llm = demo(speculative_method="ngram", num_speculative_tokens=4)
    llm.generate([format_prompt("sort: a b c d e f g h")], SamplingParams(max_tokens=12))
    sp = llm.engine.stats["speculative"]
    lines = {n: v for n, _, v in speculative_metrics(llm.engine.stats, *[lambda *a: a] * 2)}
    assert lines == {
        "spec_decode_num_drafts": sp["num_drafts"],
        "spec_decode_num_draft_tokens": sp["num_draft_tokens"],
        "spec_decode_num_accepted_tokens": sp["num_accepted_tokens"],
        "spec_decode_acceptance_rate": sp["acceptance_rate"],
        "spec_decode_mean_accepted_length": sp["mean_accepted_length"],
    }
    assert sp["num_drafts"] > 0
    assert (sp["method"], sp["num_speculative_tokens"]) == ("ngram", 4)


def test_the_flags_of_generate_and_bench(capsys):
    """`generate` speculates with its flags (same output, a bad value exits 2 naming the flag), and
    `bench offline` times ours with speculation against ours without it."""
    import json

    from hetero_infer.bench.main import main as bench_main
    from hetero_infer.cli.main import main

    base = ["generate", "--chat", "--max-tokens", "12", "--json", "sort: a b c d e f"]
    assert main(base) == 0
    plain = json.loads(capsys.readouterr().out)
    assert main(base + ["--speculative-method", "ngram", "--num-speculative-tokens", "4"]) == 0
    assert json.loads(capsys.readouterr().out) == plain
    assert main(base + ["--num-speculative-tokens", "0"]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("hetero-infer: error: --num-speculative-tokens: num_speculative_tokens")
    argv = ["offline", "--num-requests", "4", "--input-len", "4,8", "--output-len", "4,8"]
    argv += ["--peers", "", "--repeats", "1", "--warmup", "0", "--speculative-method", "ngram"]
    assert bench_main(argv) == 0
    out = capsys.readouterr().out
    assert "hetero_infer without speculative_method=ngram" in out
    assert "speculative: acceptance_rate" in out
    assert bench_main(["offline", "--speculative-method", "ngram", "--prompt-lookup-min", "0"]) == 2
    assert "--prompt-lookup-min: prompt_lookup_min" in capsys.readouterr().err


# ---- the pieces of verification, one by one (fast: no model)

from hetero_infer.spec_decode import speculator as spec  # noqa: E402
from hetero_infer.spec_decode.speculator import (  # noqa: E402
    AcceptanceStats,
    accept_sampled,
    emitted_logprobs,
    row_states,
    verify_proposals,
)


def test_acceptance_stats_count_each_position():
    a = AcceptanceStats(3)
    for proposed, accepted in [(3, 2), (2, 0), (3, 3)]:
        a.record(proposed, accepted)
    d = a.as_dict("ngram")
    assert d == dict(
        method="ngram",
        num_speculative_tokens=3,
        num_drafts=3,
        num_draft_tokens=8,
        num_accepted_tokens=5,
        acceptance_rate=5 / 8,
        mean_accepted_length=(5 + 3) / 3,  # tokens emitted per verification
        accepted_per_position=[2, 2, 1],
    )
    assert d["accepted_per_position"] is not a.accepted_at  # a copy: the caller may keep it
    one = AcceptanceStats(1)
    one.record(1, 1)
    assert (one.as_dict("x")["acceptance_rate"], one.as_dict("x")["mean_accepted_length"]) == (1, 2)
    assert AcceptanceStats(2).as_dict("draft") == dict(
        method="draft",
        num_speculative_tokens=2,
        num_drafts=0,
        num_draft_tokens=0,
        num_accepted_tokens=0,
        acceptance_rate=0,
        mean_accepted_length=0,
        accepted_per_position=[0, 0],
    )


def seeded_rows(seed: int):
    "A `gen_of` for accept_sampled: row j's own seeded generator; and the rows it was asked for."
    asked = []

    def gen_of(j):
        asked.append(j)
        return torch.Generator().manual_seed(1000 * seed + j)

    return gen_of, asked


def test_accept_sampled_keeps_rejects_and_replaces_by_the_rule():
    e = torch.eye(5)
    # every proposal has all the target's mass: all kept, one more drawn from the last row
    gen_of, asked = seeded_rows(0)
    assert accept_sampled(e[[1, 2, 4]], None, [1, 2], gen_of) == [1, 2, 4] and asked == [0, 1, 2]
    # the first kept, the second has no target mass: rejected, replaced from its row without it
    p = torch.stack([e[1], torch.tensor([0.6, 0.4, 0.0, 0.0, 0.0]), e[4]])
    seen = set()
    for seed in range(20):
        gen_of, asked = seeded_rows(seed)
        out = accept_sampled(p, None, [1, 2], gen_of)
        assert out[0] == 1 and len(out) == 2 and asked == [0, 1], out
        seen.add(out[1])
    assert seen == {0, 1}
    # a draft distribution q: rejected where q over-proposes; the leftover max(0, p - q) is empty
    # here (q >= p everywhere), so the replacement comes from p itself, never the rejected token
    p = torch.tensor([[0.0, 0.5, 0.5, 0.0, 0.0]])
    q = torch.tensor([[0.2, 0.5, 0.5, 0.0, 0.0]])
    for seed in range(20):
        gen_of, _ = seeded_rows(seed)
        assert accept_sampled(p, q, [0], gen_of)[0] in (1, 2)


def test_accept_sampled_emits_the_targets_distribution_from_its_own_generators():
    """Proposals drawn from q, kept with probability min(1, p/q), else replaced from max(0, p - q):
    the first token emitted follows p (chi-square over 4000 seeds). Each row's draws come from
    its own generator: the global random state does not change a single token."""
    p = torch.tensor([[0.1, 0.2, 0.3, 0.4], [0.25] * 4])
    q = torch.tensor([[0.4, 0.3, 0.2, 0.1]])
    counts, outs = torch.zeros(4), []
    for seed in range(4000):
        d = int(torch.multinomial(q[0], 1, generator=torch.Generator().manual_seed(-seed - 1)))
        torch.manual_seed(seed % 7)
        out = accept_sampled(p, q, [d], seeded_rows(seed)[0])
        counts[out[0]] += 1
        outs.append(out)
    want = p[0] * 4000
    stat = float(((counts - want) ** 2 / want).sum())
    assert chi2_sf(stat, 3) > 1e-3, (counts, want)
    assert 0.2 < sum(len(o) == 2 for o in outs) / 4000 < 0.9  # both paths taken
    torch.manual_seed(12345)
    again = []
    for seed in range(200):
        d = int(torch.multinomial(q[0], 1, generator=torch.Generator().manual_seed(-seed - 1)))
        again.append(accept_sampled(p, q, [d], seeded_rows(seed)[0]))
    assert again == outs[:200]


def test_row_states_give_each_row_its_own_prefix_only_when_it_matters():
    toks = [5, 6, 7, 8, 9, 10]
    plain = Sequence(0, "r", toks, 2, SamplingParams())
    assert row_states(plain, 3) == [plain] * 4
    for p in (SamplingParams(presence_penalty=0.5), SamplingParams(min_tokens=6)):
        s = Sequence(0, "r", toks, 2, p)
        views = row_states(s, 3)
        assert [v.token_ids for v in views] == [toks[:3], toks[:4], toks[:5], toks]
        assert all(v is not s and v.params is p for v in views)


def test_verify_proposals_draws_each_row_from_the_seed_of_its_output_position(monkeypatch):
    """A seeded request's acceptance test at row j uses the generator of output position
    n0 + j, n0 the outputs before the proposals: each position its own seed, in every step."""
    asked, make = [], spec.row_generator

    def row_generator(sampler, s, num_output, device, salt):
        asked.append((s.seq_id, num_output, salt))
        return make(sampler, s, num_output, device, salt)

    monkeypatch.setattr(spec, "row_generator", row_generator)
    V = 6
    logits = torch.zeros(3 + 2, V)
    logits[0, 4] = logits[1, 5] = 20.0  # the target all but certain of a's proposals 4, 5
    sp = SamplingParams(temperature=1.0, seed=3)
    a = Sequence(0, "a", [1, 2, 3, 4, 5], 2, sp)  # 3 outputs, the last 2 of them proposals
    b = Sequence(1, "b", [1, 2, 3], 1, SamplingParams(temperature=0))  # greedy: no draws
    out = verify_proposals(Sampler(), logits, [a, b], [None, None], [2, 1])
    assert out[0][:2] == [4, 5] and len(out[0]) == 3  # both kept, one more drawn
    assert asked == [(0, 1 + j, spec.ACCEPT_SALT) for j in range(3)]
    assert out[1] == [0]  # greedy: the argmax (the first of equals), proposal 3 rejected


def test_emitted_logprobs_reads_each_token_from_the_row_that_chose_it():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3 + 2, 7, generator=g)  # a: 2 proposals (3 rows), b: 1 (2 rows)
    a = Sequence(0, "a", [1, 2, 3, 4], 1, SamplingParams())  # no logprobs asked
    b = Sequence(1, "b", [1, 2, 3], 1, SamplingParams(logprobs=2))
    toks = [[4, 6], [2, 5]]  # a: one accepted, then one more; b: all (1) accepted, one more
    lsm = logits.log_softmax(-1)
    want = [[lsm[0, 4], lsm[1, 6]], [lsm[3, 2], lsm[4, 5]]]
    everyone = emitted_logprobs(logits, [a, b], toks, [2, 1])
    for (t, lps, tops), tt, w in zip(everyone, toks, want):
        assert t == tt and lps == pytest.approx([float(x) for x in w], abs=1e-5)
    assert everyone[0][2] == [None, None]
    assert len(everyone[1][2]) == 2 and all(len(d) >= 2 for d in everyone[1][2])
    only = emitted_logprobs(logits, [a, b], toks, [2, 1], only_top=True)
    assert only[0][1] == [None, None] and only[1][1] == pytest.approx(everyone[1][1])


# ---- the proposers' pieces

from hetero_infer.spec_decode import proposers  # noqa: E402
from hetero_infer.spec_decode.proposers import NgramIndex, NgramProposer  # noqa: E402


def test_ngram_propose_tries_the_longest_suffix_first():
    "By default the last 3 tokens; a longer match earlier on does not count."
    toks = [1, 2, 3, 4, 7, 9, 2, 3, 4, 8, 1, 2, 3, 4]
    assert ngram_propose(toks, 1) == [8]  # [2, 3, 4] last came before 8
    assert ngram_propose(toks, 1, n_max=4) == [7]  # [1, 2, 3, 4] before 7


def test_the_ngram_index_answers_as_the_scan_token_by_token():
    "Over random sequences with repeats, fed a token at a time: the same proposals as the scan."
    g = torch.Generator().manual_seed(0)
    for trial in range(30):
        n_min, n_max = 1 + trial % 2, 2 + trial % 3
        toks = torch.randint(0, 4, (40,), generator=g).tolist()
        ix = NgramIndex(n_min, n_max)
        for L in range(1, len(toks) + 1):
            k = 1 + L % 4
            want = ngram_propose(toks[:L], k, n_min, n_max)
            assert ix.propose(toks[:L], k) == want, (trial, L)


def test_the_ngram_proposer_keeps_one_index_per_live_sequence():
    from types import SimpleNamespace

    prop = NgramProposer(SimpleNamespace(prompt_lookup_min=1, prompt_lookup_max=2))
    a = Sequence(1, "a", [1, 2, 3, 1, 2], 2)
    b = Sequence(2, "b", [7, 8, 7], 1)
    toks, qs = prop.propose([a, b], [2, 0])
    assert toks == [[3, 1], []] and qs == [None, None] and set(prop.index) == {1}
    assert (prop.index[1].n_min, prop.index[1].n_max) == (1, 2)
    toks, _ = prop.propose([a, b], [1, 3])
    assert toks == [[3], [8, 7]] and set(prop.index) == {1, 2}
    ix = prop.index[1]  # kept from step to step: each call reads only the new tokens
    a.token_ids += [3]
    assert prop.propose([b, a], [0, 2]) == ([[], [1, 2]], [None, None])
    assert prop.index[1] is ix and ix.upto == len(a.token_ids) - 1
    prop.drop({2})
    assert set(prop.index) == {2}
    prop.forget(2)
    prop.forget(2)  # twice: nothing to forget
    assert prop.index == {}


def test_seq_view_and_the_state_a_row_needs():
    p = SamplingParams(temperature=1.0, seed=5)
    s = Sequence(3, "r", [1, 2, 3, 4, 5], 2, p, index=1, arrival_time=7.0, priority=-2)
    s.status = SequenceStatus.RUNNING
    v = proposers.seq_view(s, 4)
    got = (v.seq_id, v.request_id, v.token_ids, v.num_prompt_tokens, v.params, v.index)
    assert got == (3, "r", [1, 2, 3, 4], 2, p, 1)
    assert (v.arrival_time, v.priority, v.status) == (7.0, -2, SequenceStatus.RUNNING)
    v.token_ids.append(9)
    assert s.token_ids == [1, 2, 3, 4, 5]  # a copy
    state = proposers.needs_own_state
    assert not state(s) and not state(s, 2)
    for kw in (
        dict(presence_penalty=0.1),
        dict(frequency_penalty=-0.1),
        dict(repetition_penalty=1.2),
        dict(min_tokens=4),  # 3 outputs so far: below min_tokens
    ):
        assert state(Sequence(0, "r", [1, 2, 3, 4, 5], 2, SamplingParams(**kw))), kw
    # min_tokens counts the outputs before the last k (the proposals) only
    m = Sequence(0, "r", [1, 2, 3, 4, 5], 2, SamplingParams(min_tokens=2))
    assert not state(m) and not state(m, 1) and state(m, 2)
    m3 = Sequence(0, "r", [1, 2, 3, 4, 5], 2, SamplingParams(min_tokens=3))
    assert not state(m3) and state(m3, 1)  # by default every output counts


def test_row_generators_are_seeded_per_position_or_shared():
    sampler = Sampler(seed=11)
    seeded = Sequence(0, "r", [1, 2], 1, SamplingParams(temperature=1.0, seed=4), index=1)
    gens = [proposers.row_generator(sampler, seeded, n, "cpu", 99) for n in (3, 3, 4)]
    draws = [float(torch.rand((), generator=gen)) for gen in gens]
    assert draws[0] == draws[1] != draws[2]
    other_salt = proposers.row_generator(sampler, seeded, 3, "cpu", 98)
    assert float(torch.rand((), generator=other_salt)) != draws[0]
    plain = Sequence(1, "r", [1, 2], 1, SamplingParams(temperature=1.0))
    assert proposers.row_generator(sampler, plain, 3, "cpu", 99) is sampler.generator("cpu")


def test_draw_and_request_probs():
    g = torch.Generator().manual_seed(0)
    assert {proposers.draw(torch.tensor([0.0, 0.0, 3.0, 0.0]), g) for _ in range(20)} == {2}
    counts = torch.bincount(
        torch.tensor([proposers.draw(torch.tensor([1.0, 3.0]), g) for _ in range(2000)])
    )
    assert 0.2 < float(counts[0]) / 2000 < 0.3  # unnormalised: 1 in 4
    x = torch.tensor([[2.0, 1.0, 0.0, -1.0], [0.0, 0.0, 0.0, 5.0]])
    p = proposers.request_probs(x, SamplingParams(temperature=0.5, top_k=2))
    want = torch.zeros(4)
    want[:2] = torch.softmax(torch.tensor([2.0, 1.0]) / 0.5, -1)
    torch.testing.assert_close(p[0], want)
    assert int((p[1] > 0).sum()) == 2 and float(p[1, 3]) > 0.99  # top-2 of three ties and a 5
    top1 = proposers.request_probs(x, SamplingParams(temperature=1.0, top_k=1))
    assert top1.tolist() == [[1, 0, 0, 0], [0, 0, 0, 1]]
    full = proposers.request_probs(x, SamplingParams(temperature=1.0, top_k=0))  # all V
    torch.testing.assert_close(full, torch.softmax(x, -1))
    nucleus = proposers.request_probs(x[:1], SamplingParams(temperature=1.0, top_p=0.5))
    assert nucleus[0].tolist() == pytest.approx([1.0, 0, 0, 0], abs=1e-6)
    floor = proposers.request_probs(x[:1], SamplingParams(temperature=1.0, min_p=0.3))
    assert int((floor[0] > 0).sum()) == 2  # e^-1 = 0.37 of the top kept, e^-2 = 0.14 not


def test_truncated_draft_keeps_the_bottom_layers_and_refuses_a_bad_count(tmp_path):
    import json
    from safetensors import safe_open

    src = tmp_path / "t"
    tiny_hf_checkpoint(src, "qwen3", bos_token_id=None, eos_token_id=None)
    cfg = json.loads((src / "config.json").read_text())
    cfg["layer_types"] = ["full_attention"] * 2
    (src / "config.json").write_text(json.dumps(cfg))
    (src / "tokenizer.json").write_text("{}")
    out = proposers.truncated_draft(src, tmp_path / "d", 1)
    d = json.loads((tmp_path / "d" / "config.json").read_text())
    assert (d["num_hidden_layers"], d["layer_types"]) == (1, ["full_attention"])
    assert (tmp_path / "d" / "tokenizer.json").read_text() == "{}"
    with safe_open(f"{out}/model.safetensors", "pt") as f:
        names = set(f.keys())
    assert any(".layers.0." in n for n in names) and not any(".layers.1." in n for n in names)
    assert "model.embed_tokens.weight" in names and "model.norm.weight" in names
    with safe_open(f"{out}/model.safetensors", "pt") as f:
        assert f.metadata() == {"format": "pt"}  # what transformers' loader asks of a file
    sharded = tmp_path / "s"
    tiny_hf_checkpoint(sharded, "llama", max_shard_size="20KB")
    assert (sharded / "model.safetensors.index.json").exists()
    one = pathlib.Path(proposers.truncated_draft(sharded, tmp_path / "sd", 2))
    assert sorted(p.name for p in one.glob("model*")) == ["model.safetensors"]  # no stale index
    with safe_open(one / "model.safetensors", "pt") as f:
        index = json.loads((sharded / "model.safetensors.index.json").read_text())
        assert set(f.keys()) == set(index["weight_map"])  # every tensor of every shard
    whole = proposers.truncated_draft(src, tmp_path / "w" / "nested", 2)  # every layer
    again = proposers.truncated_draft(src, tmp_path / "w" / "nested", 2)  # written over
    assert (
        whole == again
        and json.loads((tmp_path / "w/nested/config.json").read_text())["num_hidden_layers"] == 2
    )
    for bad in (0, 3):
        with pytest.raises(ValueError, match=r"num_layers must be in \[1, 2\], got " + str(bad)):
            proposers.truncated_draft(src, tmp_path / "e", bad)


def test_proposals_ride_on_the_tokens_and_leave_by_the_rule():
    from hetero_infer.scheduler.output import ScheduledSeq, SchedulerOutput
    from hetero_infer.spec_decode.speculator import Proposals

    a = Sequence(0, "a", [1, 2, 3], 2)
    b = Sequence(1, "b", [4, 5], 1)
    c = Sequence(2, "c", [6, 7], 1)
    q = torch.arange(12.0).view(3, 4)
    props = Proposals()
    props.add(a, [8, 9, 10], q)
    props.add(b, [11, 12], None)
    props.add(c, [], None)  # nothing proposed: not carried
    assert a.token_ids == [1, 2, 3, 8, 9, 10] and b.token_ids == [4, 5, 11, 12]
    assert (props.num, set(props.seqs)) == ({0: 3, 1: 2}, {0, 1})
    # the step runs a whole (a row per proposal and one more), b cut to 2 of its 3 tokens
    step = SchedulerOutput(scheduled=[ScheduledSeq(a, 4, [0] * 4), ScheduledSeq(b, 2, [0] * 2)])
    props.fit(step)
    assert [it.num_logits for it in step.scheduled] == [4, 2]
    assert b.token_ids == [4, 5, 11] and props.num[1] == 1 and props.q[1] is None
    props.strip(a, 1)  # the draft probabilities shrink with the proposals
    assert a.token_ids == [1, 2, 3, 8, 9] and props.q[0].tolist() == q[:2].tolist()
    # verification: a keeps 1 of its 2 (and emits 2 tokens), b keeps its 1 (emits 2)
    props.rewind(step, [(a, [8, 30]), (b, [11, 31])])
    assert a.token_ids == [1, 2, 3, 8] and b.token_ids == [4, 5, 11]
    assert [it.num_tokens for it in step.scheduled] == [3, 2]
    assert props.seqs == props.num == props.q == {}
    # a step that does not run a sequence at all takes every proposal back
    props.add(c, [13, 14], None)
    props.fit(SchedulerOutput(scheduled=[]))
    assert c.token_ids == [6, 7] and props.seqs == {}
    props.add(c, [15], None)
    props.abandon()  # a failed step: every proposal leaves
    assert c.token_ids == [6, 7] and props.num == {}


def test_verify_reports_chosen_logprobs_only_where_the_engine_keeps_them():
    from types import SimpleNamespace

    cfg = SimpleNamespace(speculative_method="ngram", num_speculative_tokens=2, max_model_len=64)
    sp = Speculator(cfg)
    a = Sequence(0, "a", [1, 2, 3, 4], 2, SamplingParams(temperature=0))
    sp.proposals.add(a, [5, 6], None)
    logits = torch.zeros(3, 8)
    logits[0, 5] = logits[1, 6] = logits[2, 7] = 5.0
    for keep_all, want in ((False, None), (True, float)):
        engine = SimpleNamespace(sampler=Sampler(all_logprobs=keep_all))
        ((toks, lps, _),) = sp.verify(engine, logits, [a])
        assert toks == [5, 6, 7] and all(
            (lp is None) if want is None else isinstance(lp, float) for lp in lps
        )
    assert sp.stats(None)["num_drafts"] == 2
    # a batch holding a sequence without proposals is not a verification
    assert sp.verify(engine, logits, [a, Sequence(9, "z", [1], 1)]) is None


def test_budget_proposes_only_tokens_that_can_be_emitted():
    "k at most; fewer near max_tokens (the last token is the target's own) and max_model_len."
    from types import SimpleNamespace

    cfg = SimpleNamespace(speculative_method="ngram", num_speculative_tokens=4, max_model_len=20)
    sp = Speculator(cfg)

    def seq(n, **kw):  # n tokens, 5 of them the prompt
        return Sequence(0, "r", list(range(n)), 5, SamplingParams(**kw))

    assert sp.budget(seq(10, max_tokens=None)) == 4
    assert sp.budget(seq(10, max_tokens=100)) == 4
    assert sp.budget(seq(10, max_tokens=8)) == 2  # 5 out, 3 to go: 2 proposals and the target's
    assert sp.budget(seq(10, max_tokens=6)) == 0
    assert sp.budget(seq(10, max_tokens=5)) == 0
    assert sp.budget(seq(17, max_tokens=None)) == 3  # 3 positions left in the model's length
    assert sp.budget(seq(20, max_tokens=None)) == 0


def test_settle_leaves_only_the_emitted_tokens_and_frees_rejected_blocks():
    """After the commit of a verification that kept 1 of 3 proposals: the kept proposal leaves
    `token_ids` (the engine appends every emitted token next), and the block only rejected
    proposals were written to goes back to the pool."""
    from hetero_infer.kv_cache.block_manager import BlockManager
    from hetero_infer.spec_decode.speculator import settle

    bm = BlockManager(16, 4, enable_prefix_caching=False)
    running = Sequence(0, "a", list(range(6)), 6)
    done = Sequence(1, "b", list(range(6)), 6)
    for s in (running, done):
        bm.allocate(s)
        s.token_ids += [40, 41, 42]  # three proposals ride: 9 tokens, slots in 3 blocks
        bm.append_slots(s, 9)
        del s.token_ids[7:]  # rewound: 41 and 42 rejected
        bm.commit(s, 7)  # the prompt and the kept proposal
    running.status, done.status = SequenceStatus.RUNNING, SequenceStatus.FINISHED_LENGTH
    free = bm.num_free_blocks()
    settle(bm, [(running, [40, 43]), (done, [40, 43])])
    assert running.token_ids == done.token_ids == list(range(6))
    assert len(running.block_table) == 2 and bm.num_free_blocks() == free + 1
    assert len(done.block_table) == 3  # a finished sequence's blocks go with the sequence
    one = Sequence(2, "c", list(range(3)), 3)
    settle(bm, [(one, [7])])  # nothing kept: nothing to take out
    assert one.token_ids == [0, 1, 2]


def test_candidates_are_decoding_sequences_past_their_first_token_with_all_forks():
    from types import SimpleNamespace

    cfg = SimpleNamespace(speculative_method="ngram", num_speculative_tokens=2, max_model_len=64)
    sp = Speculator(cfg)

    def seq(sid, rid, n_tokens, n_prompt, computed, n=1):
        s = Sequence(sid, rid, list(range(n_tokens)), n_prompt, SamplingParams(n=n))
        s.num_computed_tokens = computed
        return s

    decoding = seq(0, "a", 8, 5, 7)
    first = seq(1, "b", 5, 5, 4)  # its prompt's last token still to run: no output yet
    recomputing = seq(2, "c", 8, 5, 3)  # preempted with outputs, prefilling again
    fork = seq(3, "d", 8, 5, 7, n=2)  # its sibling not made yet
    running = [decoding, first, recomputing, fork]
    requests = {"a": [decoding], "b": [first], "c": [recomputing], "d": [fork]}
    engine = SimpleNamespace(
        scheduler=SimpleNamespace(running=running),
        requests={r: SimpleNamespace(seqs=s) for r, s in requests.items()},
    )
    assert sp.candidates(engine) == [decoding]
    engine.requests["d"].seqs.append(seq(4, "d", 8, 5, 7, n=2))
    assert sp.candidates(engine) == [decoding, fork]


def test_a_finished_sequence_leaves_no_proposer_state(tmp_path):
    "The draft samples with the target's end-of-sequence ids; each proposer forgets what ends."

    def plugin_of(engine, name):
        (p,) = [p for p in engine.plugins if p.name == name]
        return p

    ngram = demo(speculative_method="ngram", num_speculative_tokens=3)
    draft = demo(
        speculative_method="draft",
        num_speculative_tokens=3,
        speculative_model=truncated_draft(DEMO_MODEL_DIR, tmp_path / "d", 1),
    )
    q = [format_prompt("sort: d c b a"), format_prompt("reverse: a b c d e")]
    for llm in (ngram, draft):
        llm.generate(q, SamplingParams(temperature=0, max_tokens=12), use_tqdm=False)
        assert plugin_of(llm.engine, "speculative").acceptance.num_drafts > 0
    assert plugin_of(ngram.engine, "speculative").proposer.index == {}
    d = plugin_of(draft.engine, "speculative").proposer
    assert d.seqs == d.real == {} and d.bm.num_free_blocks() == d.bm.num_blocks
    eos = draft.engine.eos_token_ids
    assert eos and list(d.sampler.eos_token_ids) == list(eos)


# Equivalent mutants of spec_decode/speculator.py, and those only a GPU tells apart:
# - a `device=` argument dropped or None in `accept_sampled` and `emitted_logprobs` (every tensor
#   is on the CPU here; `test_verification_through_the_triton_backend` verifies on a GPU);
# - `<=` for `<` in the acceptance test (equal only on a draw of probability zero);
# - `argmax(+1)` for `argmax(-1)` on (rows, V) logits; slices one row longer in
#   `verify_proposals` (accept_greedy never reads past row k, accept_sampled never past p[k]);
# - `m >= 0` in `Proposals.strip` and `len(toks) >= 1` in `settle` (deleting a zero-length tail);
# - the initial values of `Speculator.proposer` and `Speculator.verified` ("" or None), and
#   `verified = None` after the update: each is set before it is read.

# Equivalent mutants of spec_decode/proposers.py:
# - `ngram_propose`: `and` for `or`, or `n_min - 1`, in the early return (the loop below is then
#   empty, or k = 0 slices nothing); `all(+1)` on (windows, n).
# - `NgramIndex`: dictionaries for n-grams never looked up (`range(n_max + 1)`, `n_max + 2`);
#   windows indexed again (`range(L - 1)`, `upto = L - 2`: the latest start is written again);
#   keys of another length, which no lookup matches (`end + 2 >= n`, `min(n_max, L + 1)`).
# - `row_generator`, `request_probs`, `sample_draft`: a device of None (the CPU either way here);
#   the columns' dtype left to torch (`full` of a float is float32, of an int int64 anyway).
# - `sample_draft`: a view of every row (the same tokens in a copy), `seq_view(d, None)` (all its
#   tokens, as len(d)), `argmax(+1)` on (rows, V), `x[i : i + 2][0]` (row i either way).
# - `DraftProposer`: `len(toks) - 2` in `sync` (one token's KV recomputed that was right); the
#   draft pass's entries in another order (a decode after a prefill runs the prefill path, with
#   the same logits: the sort only lets the leading decodes take the decode kernel);
#   `max(ks, default=1)` (no sequence: the first pass finds no draft and stops).
# - `load_draft`: the runner's config keeping the target's tokenizer or prefix caching (a
#   `ModelRunner` reads neither; the draft's own `BlockManager` is built without the cache).
# - `draw`: a device of None (the CPU here).
# - `truncated_draft`: the config written with another indentation, or none (the same JSON).


# ---- the draft proposer against a fresh one


@pytest.fixture(scope="module")
def draft_pair(tmp_path_factory):
    "A tiny random Llama and its 1-layer truncated draft."
    path = tmp_path_factory.mktemp("target")
    tiny_hf_checkpoint(
        path, "llama", initializer_range=0.2, bos_token_id=None, eos_token_id=None,
        pad_token_id=None,
    )  # fmt: skip
    return path, truncated_draft(path, path.parent / "draft", 1)


def draft_proposer(draft_pair, num_blocks=64):
    from hetero_infer.spec_decode.proposers import DraftProposer

    path, draft = draft_pair
    cfg = EngineConfig(
        model=str(path), speculative_method="draft", speculative_model=draft,
        num_blocks=num_blocks, **CPU,
    )  # fmt: skip
    return DraftProposer(cfg, 256)


def test_the_draft_proposer_kept_in_step_proposes_as_a_fresh_one(draft_pair):
    """Proposal runs against the same target tokens from a proposer that keeps each draft's KV
    across steps and from a fresh one: the same greedy proposals, exactly ks[i] of them. Only the
    draft's KV past the first token the target did not accept is recomputed."""
    greedy = SamplingParams(temperature=0)
    g = torch.Generator().manual_seed(5)
    a = Sequence(0, "a", torch.randint(0, 256, (7,), generator=g).tolist() + [3], 7, greedy)
    b = Sequence(1, "b", torch.randint(0, 256, (12,), generator=g).tolist() + [9], 12, greedy, 1)
    kept = draft_proposer(draft_pair)

    def fresh(seqs, ks):
        return draft_proposer(draft_pair).propose(seqs, ks)

    props, qs = kept.propose([a, b], [3, 2])
    assert [len(p) for p in props] == [3, 2] and qs == [None, None]
    assert kept.sampler.seed == 1  # its shared generator apart from the target's (seed 0)
    assert props == fresh([a, b], [3, 2])[0] == [fresh([a], [3])[0][0], fresh([b], [2])[0][0]]
    da, db = kept.seqs[0], kept.seqs[1]
    assert (da.request_id, db.request_id, da.index, db.index) == ("a", "b", 0, 1)
    # a's first proposal is rejected and the target runs on for two steps without speculating;
    # b's first is kept and its second rejected: only the target's token is new to b's draft, a
    # decode beside a's 3-token chunk in the draft's next forward pass
    a.token_ids += [(props[0][0] + 1) % 256, 17, 18]
    b.token_ids += [props[1][0], (props[1][1] + 1) % 256]
    again, _ = kept.propose([a, b], [2, 3])
    assert again == fresh([a, b], [2, 3])[0] and [len(p) for p in again] == [2, 3]
    assert da.token_ids[: len(a)] == a.token_ids and db.token_ids[: len(b)] == b.token_ids
    assert kept.real == {0: len(a), 1: len(b)}
    kept.drop({0})
    assert set(kept.seqs) == set(kept.real) == {0} and not db.block_table
    kept.propose([a, b], [1, 0])  # b proposes nothing: its draft is not made again
    assert set(kept.seqs) == {0}
    kept.forget(0)
    assert kept.seqs == {} and kept.bm.num_free_blocks() == kept.bm.num_blocks


def test_drafts_never_share_blocks(draft_pair):
    """Two targets with one prompt: the second's draft computes it again. A draft's blocks hold
    the KV of proposals the target may reject, so the draft keeps no prefix cache."""
    greedy = SamplingParams(temperature=0)
    a, b = (Sequence(i, f"r{i}", list(range(17)), 16, greedy) for i in range(2))
    kept = draft_proposer(draft_pair)
    first, _ = kept.propose([a], [2])  # a's draft computes (and commits) 2 full blocks
    second, _ = kept.propose([b], [2])
    assert first == second and kept.bm.num_free_blocks() == kept.bm.num_blocks - 2 * 3
    assert not set(kept.seqs[0].block_table) & set(kept.seqs[1].block_table)


def test_a_draft_that_does_not_load_is_refused_naming_the_field(tmp_path):
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "config.json").write_text("{}")
    with pytest.raises(ValueError, match=r"^speculative_model: "):
        LLM(device="cpu", speculative_method="draft", speculative_model=str(tmp_path / "d"))


def test_a_draft_out_of_room_proposes_what_it_has(draft_pair):
    """A draft cache of 5 blocks of 8: two 15-token sequences take 2 each, a 3-token one the
    last. The long ones propose 2 of their 4 (the third needs a block), the short one all 4
    (its draft passes go on without them), and a fourth sequence gets no draft at all."""
    greedy = SamplingParams(temperature=0)
    lens = [15, 15, 3, 15]
    seqs = [Sequence(i, f"r{i}", list(range(i, i + n)), n - 1, greedy) for i, n in enumerate(lens)]
    kept = draft_proposer(draft_pair, num_blocks=5)
    props, _ = kept.propose(seqs, [4, 4, 4, 4])
    assert [len(p) for p in props] == [2, 2, 4, 0]
    want = draft_proposer(draft_pair).propose(seqs[:3], [4, 4, 4])[0]
    assert props[:3] == [want[0][:2], want[1][:2], want[2]]
    alone = draft_proposer(draft_pair, num_blocks=2)  # every draft out of room at the third pass
    assert alone.propose(seqs[:1], [4]) == ([want[0][:2]], [None])


def test_sample_draft_draws_seeded_rows_from_their_own_generator():
    "Greedy rows take the argmax; sampled ones draw from their parameters' distribution."
    from hetero_infer.spec_decode.proposers import DRAFT_SALT, sample_draft

    x = torch.randn(3, 16, generator=torch.Generator().manual_seed(0))
    greedy = Sequence(0, "g", [1, 2], 1, SamplingParams(temperature=0))
    seeded = Sequence(1, "s", [1, 2, 3], 1, SamplingParams(temperature=0.7, top_k=5, seed=9))
    shared = Sequence(2, "u", [1, 2], 1, SamplingParams(temperature=1.0))
    sampler = Sampler(seed=4)
    torch.manual_seed(0)
    toks, qs = sample_draft(sampler, x, [greedy, seeded, shared])
    assert toks[0] == int(x[0].argmax()) and qs[0] is None
    q = proposers.request_probs(x[1:2], seeded.params)[0]
    torch.testing.assert_close(qs[1], q)
    gen = proposers.row_generator(sampler, seeded, 2, "cpu", DRAFT_SALT)
    assert toks[1] == proposers.draw(q, gen) and int((q > 0).sum()) == 5
    torch.manual_seed(1)  # another global state: the seeded row's token is its own
    assert sample_draft(Sampler(seed=4), x, [greedy, seeded, shared])[0][:2] == toks[:2]
    torch.testing.assert_close(qs[2], proposers.request_probs(x[2:], shared.params)[0])


def test_sample_draft_penalizes_each_rows_tokens_as_they_are_now():
    """A draft sequence's tokens are cut back when the target rejects its proposals: its
    penalties count the tokens it holds at each pass, never those it held before."""
    from hetero_infer.spec_decode.proposers import sample_draft

    x = torch.randn(1, 16, generator=torch.Generator().manual_seed(0))
    p = SamplingParams(temperature=1.0, seed=1, frequency_penalty=1.5, presence_penalty=0.5)
    d = Sequence(0, "d", [1, 2, 3, 3, 3, 4, 5, 5], 2, p)
    sampler = Sampler()
    sample_draft(sampler, x, [d])
    del d.token_ids[4:]  # three of its proposals rejected
    _, (q,) = sample_draft(sampler, x, [d])
    fresh = Sequence(0, "d", list(d.token_ids), 2, p)
    _, (want,) = sample_draft(Sampler(), x, [fresh])
    torch.testing.assert_close(q, want)
