"""Property tests and dense sweeps for hetero_infer.sample.sampler (CPU, seconds)."""

import math
import pytest
import torch
from hypothesis import given, settings, strategies as st, HealthCheck

from hetero_infer.core.sequence import Sequence
from hetero_infer.core.sampling_params import SamplingParams
from hetero_infer.core.sequence import SequenceStatus
from hetero_infer.sample.sampler import (
    Sampler,
    apply_logit_bias,
    SamplerOutput,
    apply_top_k_top_p,
    sampling_probs,
    token_logprobs,
    inverse_cdf,
    row_seed,
)
from hetero_infer.sample.penalties import apply_penalties, seen_tokens, PenaltyCounts

SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def seq(prompt=(1,), out=(), seq_id=0, index=0, **kw) -> Sequence:
    "A sequence with prompt `prompt` that has generated `out` so far."
    return Sequence(
        seq_id,
        f"r{seq_id}",
        list(prompt) + list(out),
        len(prompt),
        SamplingParams(**kw),
        index=index,
    )


def rand_logits(n, v, seed, scale=3.0):
    return torch.randn(n, v, generator=torch.Generator().manual_seed(seed)) * scale


# --- greedy ---------------------------------------------------------------------------------------


@SETTINGS
@given(n=st.integers(1, 8), v=st.integers(2, 300), seed=st.integers(0, 10_000))
def test_greedy_is_argmax(n, v, seed):
    x = rand_logits(n, v, seed)
    out = Sampler([0])(x, [seq(temperature=0) for _ in range(n)])
    assert out.token_ids == x.argmax(-1).tolist()
    assert torch.allclose(torch.tensor(out.logprobs), x.log_softmax(-1).max(-1).values, atol=1e-5)


def test_greedy_rows_in_a_mixed_batch_are_argmax():
    x = rand_logits(6, 500, 3)
    seqs = [seq(temperature=0) if i % 2 else seq(temperature=1.0, top_p=0.9) for i in range(6)]
    out = Sampler([0])(x, seqs)
    assert out.token_ids[1::2] == x[1::2].argmax(-1).tolist()


def test_input_logits_untouched_and_shapes():
    x = rand_logits(3, 50, 0)
    x0 = x.clone()
    out = Sampler([0])(
        x, [seq(min_tokens=2, repetition_penalty=1.3, temperature=0.5, top_k=5, logprobs=2)] * 3
    )
    assert torch.equal(x, x0)
    assert (
        isinstance(out, SamplerOutput)
        and len(out.token_ids) == len(out.logprobs) == len(out.top_logprobs) == 3
    )
    assert all(isinstance(t, int) for t in out.token_ids) and all(
        isinstance(l, float) for l in out.logprobs
    )


# --- filters never emit a filtered token ----------------------------------------------------------


@SETTINGS
@given(
    v=st.integers(2, 200),
    seed=st.integers(0, 10_000),
    temperature=st.floats(0.05, 3.0),
    top_k=st.integers(-1, 60),
    top_p=st.floats(0.01, 1.0),
    min_p=st.floats(0.0, 1.0),
    sample_seed=st.integers(0, 2**40),
)
def test_filters_never_emit_a_filtered_token(
    v, seed, temperature, top_k, top_p, min_p, sample_seed
):
    x = rand_logits(16, v, seed)
    seqs = [
        seq(
            seq_id=i,
            temperature=temperature,
            top_k=top_k,
            top_p=top_p,
            min_p=min_p,
            seed=sample_seed + i,
        )
        for i in range(16)
    ]
    toks = torch.tensor(Sampler([0])(x, seqs).token_ids)
    z = x / temperature
    k = v if top_k <= 0 else min(top_k, v)
    kth = z.topk(k, dim=-1).values[:, -1]  # (16,)
    zt = z.gather(-1, toks[:, None])[:, 0]
    assert (zt >= kth).all()  # inside the top-k
    zk = torch.where(z >= kth[:, None], z, torch.tensor(float("-inf")))
    pk = zk.softmax(-1)  # the renormalized top-k distribution
    pt = pk.gather(-1, toks[:, None])[:, 0]
    above = (pk * (pk > pt[:, None])).sum(-1)  # mass strictly more likely than the token
    assert (above < top_p + 1e-5).all() or top_p >= 1  # inside the nucleus
    assert (
        pt >= min_p * pk.max(-1).values - 1e-6
    ).all()  # above the min-p cut (ratio is renormalization-free)


@pytest.mark.parametrize("case", range(12))
def test_masks_match_transformers_warpers(case):
    """top-k, top-p and min-p keep exactly the tokens Hugging Face's warpers keep (random, tie-free
    logits)."""
    from transformers.generation.logits_process import (
        TopKLogitsWarper,
        TopPLogitsWarper,
        MinPLogitsWarper,
    )

    g = torch.Generator().manual_seed(case)
    v = int(torch.randint(5, 3000, (1,), generator=g))
    x = torch.randn(4, v, generator=g) * float(torch.rand(1, generator=g) * 6 + 0.3)
    k, p, m = (
        int(torch.randint(1, v + 1, (1,), generator=g)),
        float(torch.rand(1, generator=g) * 0.98 + 0.01),
        float(torch.rand(1, generator=g) * 0.3),
    )
    hf = MinPLogitsWarper(m)(None, TopPLogitsWarper(p)(None, TopKLogitsWarper(k)(None, x.clone())))
    T, K, P, M = torch.ones(4), torch.full((4,), k), torch.full((4,), p), torch.full((4,), m)
    ours = sampling_probs(x, T, K, P, M)
    assert torch.equal(hf.isfinite(), ours > 0)
    assert torch.allclose(ours, hf.softmax(-1), atol=1e-6)


@pytest.mark.parametrize("num_candidates", [1, 7, 64, 10_000])
def test_top_k_top_p_candidates_equal_full_sort(num_candidates):
    """Looking at K candidates first, with the full-sort fallback, keeps exactly what a full sort
    keeps."""
    g = torch.Generator().manual_seed(num_candidates)
    x = torch.randn(48, 700, generator=g) * torch.linspace(0.2, 10, 48)[:, None]
    k = torch.randint(1, 900, (48,), generator=g).clamp(max=700)
    k[::4] = 700
    p = torch.rand(48, generator=g)
    p[1::5] = 1.0
    full = apply_top_k_top_p(x, k, p, num_candidates=700)
    assert torch.equal(apply_top_k_top_p(x, k, p, num_candidates=num_candidates), full)


# --- the empirical distribution ------------------------------------------------------------------


def chi_square(counts: torch.Tensor, probs: torch.Tensor) -> float:
    n = counts.sum()
    keep = probs > 0
    exp = probs[keep] * n
    return float(((counts[keep] - exp) ** 2 / exp).sum())


# 99.9% quantiles of chi-square by degrees of freedom (a correct sampler fails 1 time in 1000; all
# draws here are seeded)
CHI2_999 = {1: 10.83, 2: 13.82, 3: 16.27, 4: 18.47, 5: 20.52, 6: 22.46, 7: 24.32}


@pytest.mark.parametrize("temperature", [0.5, 1.0, 1.7])
@pytest.mark.parametrize("seeded", [False, True])
def test_temperature_sampling_matches_softmax(temperature, seeded):
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -0.5, -1.0, 1.5, 0.2])
    n = 4000
    seqs = [
        seq(seq_id=i, temperature=temperature, seed=(10_000 + i if seeded else None))
        for i in range(n)
    ]
    toks = torch.tensor(Sampler([99], seed=5)(logits.expand(n, -1), seqs).token_ids)
    counts = torch.bincount(toks, minlength=8).float()
    target = (logits / temperature).softmax(-1)
    assert chi_square(counts, target) < CHI2_999[7]
    assert 0.5 * (counts / n - target).abs().sum() < 0.04  # total-variation distance


def test_top_p_sampling_matches_renormalized_nucleus():
    logits = torch.tensor([3.0, 2.5, 2.0, 1.0, 0.0, -1.0, -2.0, -3.0])
    n = 4000
    toks = torch.tensor(
        Sampler([99], seed=1)(
            logits.expand(n, -1), [seq(seq_id=i, top_p=0.95) for i in range(n)]
        ).token_ids
    )
    probs = logits.softmax(-1)
    srt, idx = probs.sort(descending=True)
    keep = idx[(srt.cumsum(-1) - srt) < 0.95]
    target = torch.zeros(8)
    target[keep] = probs[keep]
    target /= target.sum()
    counts = torch.bincount(toks, minlength=8).float()
    assert counts[target == 0].sum() == 0
    assert chi_square(counts, target) < CHI2_999[int((target > 0).sum()) - 1]


def test_inverse_cdf_frequencies():
    probs = torch.tensor([0.05, 0.4, 0.0, 0.25, 0.3])
    n = 20_000
    u = torch.rand(n, generator=torch.Generator().manual_seed(3))
    for block in (1, 2, 4, 1024):
        counts = torch.bincount(inverse_cdf(probs.expand(n, -1), u, block), minlength=5).float()
        assert counts[2] == 0
        assert chi_square(counts, probs) < CHI2_999[3]


@SETTINGS
@given(
    v=st.integers(1, 3000),
    block=st.sampled_from([1, 7, 64, 1024]),
    zeros=st.floats(0.0, 0.99),
    seed=st.integers(0, 10_000),
)
def test_inverse_cdf_equals_a_float64_running_sum(v, block, zeros, seed):
    "The two-level search picks what one float64 running sum over the whole row picks."
    g = torch.Generator().manual_seed(seed)
    probs = torch.rand(4, v, generator=g) * (torch.rand(4, v, generator=g) >= zeros)
    probs[:, torch.randint(0, v, (1,), generator=g)] = 0.5  # no row all zero
    u = torch.rand(4, generator=g)
    cum = probs.double().cumsum(-1)
    want = torch.searchsorted(cum, (u.double() * cum[:, -1])[:, None], right=True)[:, 0]
    got = inverse_cdf(probs, u, block)
    assert bool((probs.gather(-1, got[:, None]) > 0).all())  # never a removed token
    assert got.tolist() == want.clamp_max(v - 1).tolist()


@pytest.mark.parametrize("block", [1, 2, 3, 4, 8])
def test_inverse_cdf_on_exact_boundaries_takes_the_token_after(block):
    """A u whose target equals a running sum exactly (dyadic masses, no rounding) takes the next
    token with mass: the first whose running sum passes the target, in any block layout."""
    probs = torch.tensor([0.25, 0.0, 0.25, 0.0, 0.0, 0.25, 0.25, 0.0])
    u = torch.tensor([0.0, 0.25, 0.5, 0.75, 0.875])
    got = inverse_cdf(probs.expand(len(u), -1), u, block)
    assert got.tolist() == [0, 2, 5, 6, 6]


def test_a_row_with_nothing_allowed_still_gets_an_id_in_range():
    "All -inf (a grammar at a dead end): an id in range all the same, for the caller to refuse."
    x = torch.full((3, 1500), float("-inf"))
    x[1] = 0.0
    out = Sampler([99], seed=0)(x, [seq(seq_id=i) for i in range(3)])
    assert all(0 <= t < 1500 for t in out.token_ids)


# --- penalties -----------------------------------------------------------------------------------


@SETTINGS
@given(
    v=st.integers(4, 60),
    seed=st.integers(0, 10_000),
    rep=st.floats(0.1, 3.0),
    pres=st.floats(-2, 2),
    freq=st.floats(-2, 2),
    prompt=st.lists(st.integers(0, 3), min_size=1, max_size=8),
    out=st.lists(st.integers(0, 3), max_size=8),
)
def test_penalties_follow_the_formulas(v, seed, rep, pres, freq, prompt, out):
    x = rand_logits(1, v, seed)[0]
    y = Sampler([]).adjust_logits(
        x[None],
        [seq(prompt, out, presence_penalty=pres, frequency_penalty=freq, repetition_penalty=rep)],
    )[0]
    want = x.clone()
    for t in range(v):
        if t in prompt or t in out:
            want[t] = want[t] / rep if want[t] > 0 else want[t] * rep
        c = out.count(t)
        want[t] -= freq * c + (pres if c else 0.0)
    assert torch.allclose(y, want, atol=1e-5)


def test_repetition_penalty_matches_transformers():
    from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor

    x = rand_logits(3, 100, 7)
    ids = torch.randint(0, 100, (3, 20), generator=torch.Generator().manual_seed(1))
    hf = RepetitionPenaltyLogitsProcessor(1.3)(ids, x.clone())
    seqs = [
        seq(ids[i, :12].tolist(), ids[i, 12:].tolist(), repetition_penalty=1.3) for i in range(3)
    ]
    assert torch.allclose(Sampler([]).adjust_logits(x, seqs), hf)


def test_seen_tokens_and_neutral_penalties_are_exact():
    rows, toks, counts = seen_tokens([[2, 2], [], [0, 4]], [[3, 3, 3, 1], [], [4]], 5)
    assert (rows.tolist(), toks.tolist(), counts.tolist()) == (
        [0, 0, 0, 2, 2],
        [1, 2, 3, 0, 4],
        [1.0, 0.0, 3.0, 0.0, 1.0],
    )
    x = rand_logits(3, 5, 0)
    assert torch.equal(
        apply_penalties(x, rows, toks, counts, torch.zeros(3), torch.zeros(3), torch.ones(3)), x
    )


def test_penalties_shift_sampling():
    "A token already generated many times loses to its rival under a frequency penalty (greedy)."
    x = torch.tensor([[0.0, 5.0, 4.0]])
    assert Sampler([])(x, [seq([0], [1, 1], temperature=0)]).token_ids == [1]
    assert Sampler([])(x, [seq([0], [1, 1], temperature=0, frequency_penalty=1.0)]).token_ids == [2]


# --- incremental penalty counts -------------------------------------------------------------------


def from_scratch(batch, V):
    "seen_tokens' answer for `batch`, as a sorted list of (batch row, token, output count)."
    r, t, c = seen_tokens(
        [s.prompt_token_ids for s in batch], [s.output_token_ids for s in batch], V
    )
    return sorted(zip(r.tolist(), t.tolist(), c.tolist()))


OPS = st.lists(
    st.tuples(
        st.sampled_from(["step", "finish", "fork", "preempt", "new", "skip"]), st.integers(0, 2**16)
    ),
    min_size=1,
    max_size=40,
)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    V=st.integers(2, 40),
    ops=OPS,
    seed=st.integers(0, 2**16),
    rows=st.integers(1, 4),
    pairs=st.integers(1, 16),
)
def test_penalty_counts_equal_the_from_scratch_computation(V, ops, seed, rows, pairs):
    """Through random steps (batches of any subset, a sequence named twice), finishing, n>1 forks,
    preemption with recompute (tokens kept, progress reset) and new arrivals, the kept counts equal
    seen_tokens from scratch."""
    g = torch.Generator().manual_seed(seed)
    ri = lambda n: int(torch.randint(0, n, (1,), generator=g))
    pc, ids = PenaltyCounts(V, rows=rows, pairs=pairs), iter(range(10**6))

    def new():
        return seq(
            [ri(V) for _ in range(1 + ri(6))],
            [ri(V) for _ in range(ri(3))],
            seq_id=next(ids),
            repetition_penalty=1.5,
        )

    live = [new() for _ in range(3)]
    for op, k in ops:
        if op == "finish" and len(live) > 1:
            live.pop(k % len(live)).status = SequenceStatus.FINISHED_STOPPED
        elif op == "fork":
            live.append(live[k % len(live)].fork(next(ids), index=1))
        elif op == "preempt":
            live[k % len(live)].num_computed_tokens = 0  # recompute: the tokens stay, the KV goes
        elif op == "new":
            live.append(new())
        if op == "skip":
            continue
        batch = [s for j, s in enumerate(live) if (k >> j) & 1] or live[:1]
        batch += batch[: k % 2]  # sometimes one sequence twice
        got = sorted(zip(*(x.tolist() for x in pc.pairs(pc.update(batch)))))
        assert got == from_scratch(batch, V)
        for s in set(batch):
            s.append_token(ri(V))


def test_penalty_counts_make_every_tensor_on_their_own_device():
    """With another default device (meta), the counts still work on theirs (cpu): no tensor is
    made on the default device, as none may be on a GPU. Growth, a reused row, a batch naming a
    row twice and one leaving rows out all run."""
    V = 7
    a, b, c, d = (
        seq([1, 2, 3], [4], 0, repetition_penalty=1.5),
        seq([5], [], 1, repetition_penalty=1.5),
        seq([6, 6], [1], 2, repetition_penalty=1.5),
        seq([0], [0, 0], 3, repetition_penalty=1.5),
    )
    pc = PenaltyCounts(V, device="cpu", rows=1, pairs=1)
    batches = [[a, b], [c, b, b], [c, d], [d]]
    got = []
    with torch.device("meta"):
        for i, batch in enumerate(batches):
            if i == 1:
                a.status = SequenceStatus.FINISHED_STOPPED  # its row is reused
            out = pc.pairs(pc.update(batch))
            assert all(x.device.type == "cpu" for x in out)
            got.append(sorted(zip(*(x.tolist() for x in out))))
    assert got == [from_scratch(batch, V) for batch in batches]


def test_penalty_counts_read_only_new_tokens():
    """After a sequence's first step only its new tokens are read: rewriting old ones (never done
    for real) goes unnoticed."""
    pc = PenaltyCounts(10)
    s = seq([1, 2, 3], [4], repetition_penalty=1.2)
    pc.update([s])
    s.token_ids[0] = 9
    s.append_token(5)
    got = sorted(zip(*(x.tolist() for x in pc.pairs(pc.update([s])))))
    assert got == [(0, 1, 0.0), (0, 2, 0.0), (0, 3, 0.0), (0, 4, 1.0), (0, 5, 1.0)]
    assert pc.synced[pc.row_of[id(s)]] == 2


def test_penalty_counts_reclaim_rows_of_finished_sequences():
    pc = PenaltyCounts(50, rows=2)
    seqs = [seq([i], seq_id=i, repetition_penalty=1.2) for i in range(2)]
    pc.update(seqs)
    for s in seqs:
        s.status = SequenceStatus.FINISHED_STOPPED
    more = [seq([10 + i], seq_id=10 + i, repetition_penalty=1.2) for i in range(2)]
    pc.update(more)
    assert len(pc.owner) == 2 and pc.seen.n == 2  # rows reused, old pairs dropped


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(V=st.integers(4, 80), seed=st.integers(0, 10_000), steps=st.integers(1, 6))
def test_sampler_penalties_over_steps_equal_from_scratch(V, seed, steps):
    """The sampler's penalized logits, step after step, equal apply_penalties over seen_tokens
    computed from scratch."""
    g = torch.Generator().manual_seed(seed)
    kinds = [
        dict(repetition_penalty=1.3),
        dict(presence_penalty=0.7, frequency_penalty=-0.4),
        dict(),
        dict(repetition_penalty=0.8, frequency_penalty=1.0),
    ]
    seqs = [
        seq(
            torch.randint(
                0, V, (int(torch.randint(1, 9, (1,), generator=g)),), generator=g
            ).tolist(),
            seq_id=i,
            temperature=0,
            **kinds[i % 4],
        )
        for i in range(6)
    ]
    smp = Sampler([])
    for step in range(steps):
        x = rand_logits(len(seqs), V, seed + step)
        r, t, c = seen_tokens(
            [s.prompt_token_ids for s in seqs], [s.output_token_ids for s in seqs], V
        )
        col = lambda f: torch.tensor([getattr(s.params, f) for s in seqs], dtype=torch.float32)
        want = apply_penalties(
            x, r, t, c, col("presence_penalty"), col("frequency_penalty"), col("repetition_penalty")
        )
        assert torch.allclose(smp.adjust_logits(x, seqs), want, atol=1e-6)
        for s, tok in zip(seqs, smp(x, seqs).token_ids):
            s.append_token(tok)


def test_all_logprobs_off_skips_rows_that_did_not_ask():
    x = rand_logits(3, 50, 1)
    seqs = [seq(temperature=0), seq(temperature=0, logprobs=1), seq(temperature=0.5, seed=3)]
    on, off = Sampler([0])(x, seqs), Sampler([0], all_logprobs=False)(x, seqs)
    assert off.token_ids == on.token_ids
    assert (
        off.logprobs[0] is None
        and off.logprobs[2] is None
        and off.logprobs[1] == pytest.approx(on.logprobs[1])
    )
    assert off.top_logprobs == on.top_logprobs


# --- seeds ----------------------------------------------------------------------------------------


def run_steps(target: Sequence, mates_for_step, steps=6, V=400, sampler_seed=0):
    """Decode `steps` tokens for `target`, its logits a function of the step only, among batch mates
    given per step."""
    smp = Sampler([0], seed=sampler_seed)
    for step in range(steps):
        mates = mates_for_step(step)
        pos = step % (len(mates) + 1)
        logits = rand_logits(len(mates) + 1, V, 10_000 + step)
        logits[pos] = rand_logits(1, V, step, scale=2.0)[0]
        target.append_token(smp(logits, mates[:pos] + [target] + mates[pos:]).token_ids[pos])
    return target.output_token_ids


@pytest.mark.parametrize(
    "params",
    [dict(), dict(temperature=0.7, top_p=0.9), dict(top_k=30, min_p=0.02, presence_penalty=0.5)],
)
def test_seeded_row_same_alone_and_in_random_batches(params):
    alone = run_steps(seq([5, 6], seed=1234, **params), lambda s: [])
    g = torch.Generator().manual_seed(99)
    kinds = [
        dict(),
        dict(temperature=0),
        dict(temperature=1.3, top_k=5),
        dict(seed=1234),
        dict(seed=7, top_p=0.5),
    ]

    def mates(step):
        n = int(torch.randint(1, 9, (1,), generator=g))
        return [
            seq(
                [1, 2, 3],
                seq_id=100 + j,
                **kinds[int(torch.randint(0, len(kinds), (1,), generator=g))],
            )
            for j in range(n)
        ]

    crowd = run_steps(seq([5, 6], seed=1234, **params), mates, sampler_seed=77)
    assert alone == crowd


def test_seeded_row_survives_preemption_and_a_fresh_sampler():
    """The noise depends on (seed, index, outputs so far) only: recomputing a step with a new
    Sampler gives the same token."""
    x = rand_logits(1, 1000, 4)
    s = seq([1], [7, 8, 9], seed=5)
    assert Sampler([0], seed=1)(x, [s]).token_ids == Sampler([0], seed=2)(x, [s]).token_ids


def test_n_completions_of_one_seeded_request_differ():
    a = run_steps(seq([5], seed=3, index=0), lambda s: [])
    b = run_steps(seq([5], seed=3, index=1), lambda s: [])
    assert a != b
    assert a == run_steps(seq([5], seed=3, index=0), lambda s: [])


def test_unseeded_rows_reproducible_from_the_engine_seed():
    x = rand_logits(8, 300, 0)
    seqs = [seq(seq_id=i) for i in range(8)]
    assert Sampler([0], seed=11)(x, seqs).token_ids == Sampler([0], seed=11)(x, seqs).token_ids
    smp = Sampler([0], seed=11)
    assert smp(x, seqs).token_ids != smp(x, seqs).token_ids  # the shared generator moves on


def test_row_seed_spreads():
    seeds = {row_seed(s, i, t) for s in range(20) for i in range(3) for t in range(20)}
    assert len(seeds) == 20 * 3 * 20 and all(0 <= s < 2**63 for s in seeds)


# --- min_tokens, eos, stop ids -------------------------------------------------------------------


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_min_tokens_blocks_eos_and_stop_ids(temperature):
    V, eos, stop = 50, 3, 7
    x = torch.zeros(1, V)
    x[0, eos] = 30.0
    x[0, stop] = 29.0  # eos and the stop id dominate
    smp = Sampler([eos])
    s = seq([1], min_tokens=4, stop_token_ids=[stop], temperature=temperature)
    for _ in range(4):
        t = smp(x, [s]).token_ids[0]
        assert t not in (eos, stop)
        s.append_token(t)
    assert smp(x, [s]).token_ids[0] in (
        (eos,) if temperature == 0 else (eos, stop)
    )  # min_tokens reached: free to stop
    assert smp(x, [seq([1], [2, 2, 2, 2], min_tokens=4, temperature=0)]).token_ids == [eos]


def test_ignore_eos_leaves_eos_free_but_still_blocks_stop_ids():
    x = torch.zeros(2, 20)
    x[:, 3] = 30.0
    x[:, 7] = 29.0
    smp = Sampler([3])
    out = smp(
        x,
        [
            seq([1], min_tokens=2, ignore_eos=True, temperature=0),
            seq([1], min_tokens=2, ignore_eos=True, stop_token_ids=[3, 7], temperature=0),
        ],
    )
    assert out.token_ids[0] == 3  # eos is an ordinary token
    assert out.token_ids[1] not in (3, 7)


# --- logprobs ------------------------------------------------------------------------------------


@SETTINGS
@given(
    n=st.integers(1, 6),
    v=st.integers(2, 120),
    k=st.integers(0, 20),
    seed=st.integers(0, 10_000),
    temperature=st.sampled_from([0.0, 0.5, 1.0]),
    rep=st.sampled_from([1.0, 1.5]),
)
def test_logprobs_are_raw_and_ranked(n, v, k, seed, temperature, rep):
    """Logprobs come from log_softmax of the raw logits, whatever penalties and temperature did to
    the sampling."""
    x = rand_logits(n, v, seed)
    seqs = [
        seq(
            [0, 1],
            [1],
            seq_id=i,
            logprobs=(k if i % 2 == 0 else None),
            temperature=temperature,
            repetition_penalty=rep,
            seed=seed + i,
        )
        for i in range(n)
    ]
    out = Sampler([0])(x, seqs)
    raw, kk = x.log_softmax(-1), min(k, v)
    for i, (t, lp, top) in enumerate(zip(out.token_ids, out.logprobs, out.top_logprobs)):
        assert math.isclose(lp, float(raw[i, t]), abs_tol=1e-4)
        if i % 2:
            assert top is None
            continue
        assert t in top and math.isclose(
            top[t].logprob, lp, abs_tol=1e-4
        )  # the chosen token is always there
        assert top[t].rank == int((raw[i] > raw[i, t]).sum()) + 1  # its rank among all tokens
        best = raw[i].topk(kk)
        in_top = set(best.indices.tolist())
        assert set(top) == in_top | {t}
        ranked = sorted((l.rank, l.logprob) for tok, l in top.items() if tok in in_top)
        assert [r for r, _ in ranked] == list(range(1, kk + 1))  # ranks 1..k
        assert torch.allclose(
            torch.tensor([l for _, l in ranked]), best.values, atol=1e-4
        )  # sorted, raw values
        assert all(l.decoded_token is None for l in top.values())


def test_logprobs_chosen_token_outside_top_k():
    x = torch.tensor([[5.0, 4.0, 3.0, 2.0, 1.0]])
    lp, tops = token_logprobs(x, torch.tensor([4]), [2])
    raw = x.log_softmax(-1)[0]
    assert list(tops[0]) == [4, 0, 1]
    assert [l.rank for l in tops[0].values()] == [5, 1, 2]
    assert torch.allclose(torch.tensor([l.logprob for l in tops[0].values()]), raw[[4, 0, 1]])
    assert math.isclose(lp[0], float(raw[4]), abs_tol=1e-6)


# --- edges of the sampler, each pinned exactly -------------------------------------------------


def splitmix64_reference(x: int) -> int:
    "SplitMix64 (Steele, Lea & Flood 2014; Vigna's splitmix64.c): one step from state x."
    M = (1 << 64) - 1
    z = (x + 0x9E3779B97F4A7C15) & M
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & M
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & M
    return z ^ (z >> 31)


def test_row_seed_is_splitmix64_so_seeded_outputs_stay_reproducible():
    """A seeded request's tokens depend on row_seed; it must stay the published SplitMix64 hash, on
    any device and version."""
    assert splitmix64_reference(0) == 0xE220A8397B1DCDAF  # the published first output from state 0
    for seed, index, step in [(0, 0, 0), (1234, 0, 7), (2**64 + 5, 3, 0), (-1, 2, 100), (42, 1, 1)]:
        h = splitmix64_reference(
            splitmix64_reference(splitmix64_reference(seed & (2**64 - 1)) ^ index) ^ step
        )
        assert row_seed(seed, index, step) == h >> 1 < 2**63


def test_top_p_drops_a_token_once_the_mass_above_it_reaches_p_exactly():
    x = torch.log(torch.tensor([[0.5, 0.25, 0.25]]))
    out = apply_top_k_top_p(x, torch.tensor([3]), torch.tensor([0.5]))
    assert torch.isfinite(out).tolist() == [[True, False, False]]
    assert torch.isfinite(
        apply_top_k_top_p(x, torch.tensor([3]), torch.tensor([0.75]))
    ).tolist() == [[True, True, False]]


def test_top_p_of_one_keeps_tokens_after_the_mass_saturates():
    """In float32 the first two tokens already hold all the mass; top_p = 1 must still keep the
    third."""
    x = torch.tensor([[0.0, 0.0, -100.0]])
    assert torch.equal(apply_top_k_top_p(x, torch.tensor([3]), torch.tensor([1.0])), x)


def test_top_p_wider_than_the_candidates_falls_back_to_a_full_sort():
    """A flat row of 1000 tokens with top_p 0.9 keeps about 900 tokens, far more than the 256
    candidates looked at first."""
    x = torch.zeros(2, 1000)
    out = apply_top_k_top_p(x, torch.tensor([1000, 1000]), torch.tensor([0.9, 0.1]))
    kept = torch.isfinite(out).sum(-1).tolist()
    assert 899 <= kept[0] <= 901 and 99 <= kept[1] <= 101


def test_top_k_applies_to_a_single_row():
    probs = sampling_probs(
        rand_logits(1, 50, 3),
        torch.tensor([1.0]),
        torch.tensor([5]),
        torch.tensor([1.0]),
        torch.tensor([0.0]),
    )
    assert int((probs > 0).sum()) == 5


def test_sampled_top_k_of_one_is_the_argmax():
    x = rand_logits(6, 40, 11)
    out = Sampler()(x, [seq(temperature=1.5, top_k=1, seed=i) for i in range(6)])
    assert out.token_ids == x.argmax(-1).tolist()


def test_token_logprobs_defaults_to_every_row_and_skips_work_when_asked():
    x = rand_logits(2, 10, 5)
    lps, tops = token_logprobs(x, torch.tensor([1, 2]), [None, None])
    want = x.log_softmax(-1)[[0, 1], [1, 2]].tolist()
    assert lps == pytest.approx(want, abs=1e-5) and tops == [None, None]
    assert token_logprobs(x, torch.tensor([1, 2]), [None, None], only_top=True) == (
        [None, None],
        [None, None],
    )


def test_sampler_takes_a_single_eos_id_and_defaults_to_seed_0():
    s = Sampler(eos_token_ids=2)
    assert s.eos_token_ids == [2]
    out = s(
        torch.zeros(1, 5), [seq(min_tokens=3, temperature=0)]
    )  # eos banned: the argmax skips it
    assert out.token_ids == [0] and Sampler(eos_token_ids=0)(
        torch.zeros(1, 5), [seq(min_tokens=3, temperature=0)]
    ).token_ids == [1]
    x = rand_logits(4, 30, 2)
    params = [seq(temperature=1.0) for _ in range(4)]
    assert (
        Sampler()(x, params).token_ids
        == Sampler(seed=0)(x, params).token_ids
        != Sampler(seed=1)(x, params).token_ids
    )


def test_eos_id_outside_the_vocabulary_is_ignored():
    """An EOS id the model's vocabulary does not have (e.g. a tokenizer's extra token) cannot be
    banned, and is no error."""
    out = Sampler(eos_token_ids=[8, 5])(torch.zeros(1, 8), [seq(min_tokens=2, temperature=0)])
    assert out.token_ids == [0]
    out = Sampler(eos_token_ids=[0])(
        torch.zeros(1, 8), [seq(min_tokens=2, temperature=0, stop_token_ids=[8, 1])]
    )
    assert out.token_ids == [2]


def test_penalty_counts_follow_a_change_of_vocabulary():
    smp = Sampler()
    for V in (20, 30):
        s = seq(prompt=[1, 2, 3], out=[3, V - 1], repetition_penalty=2.0, frequency_penalty=0.5)
        x = rand_logits(1, V, V)
        rows, toks, counts = seen_tokens([s.prompt_token_ids], [s.output_token_ids], V)
        want = apply_penalties(
            x, rows, toks, counts, torch.tensor([0.0]), torch.tensor([0.5]), torch.tensor([2.0])
        )
        assert torch.allclose(smp.adjust_logits(x, [s]), want)


def test_penalty_counts_reuse_rows_again_and_again():
    "Rows freed by finished sequences are reused by new ones several times over; counts stay exact."
    pc = PenaltyCounts(10, rows=2)
    for rnd in range(4):
        seqs = [seq(prompt=[rnd, 1], out=[2, 2, rnd], seq_id=10 * rnd + i) for i in range(2)]
        rows = pc.update(seqs)
        b, t, c = pc.pairs(rows)
        got = sorted(zip(b.tolist(), t.tolist(), c.tolist()))
        r, tk, cn = seen_tokens(
            [s.prompt_token_ids for s in seqs], [s.output_token_ids for s in seqs], 10
        )
        assert got == sorted(zip(r.tolist(), tk.tolist(), cn.tolist()))
        assert len(pc.owner) == 2  # never grew: finished rows came back
        for s in seqs:
            s.status = SequenceStatus.FINISHED_STOPPED


def test_penalty_counts_refuse_a_shrunken_output():
    pc, s = PenaltyCounts(10), seq(prompt=[1], out=[2, 3])
    pc.update([s])
    s.token_ids.pop()
    with pytest.raises(RuntimeError) as e:
        pc.update([s])
    assert str(e.value) == "output shrank"


def test_reclaimed_row_does_not_answer_for_a_new_sequence_at_the_same_id():
    """CPython reuses a dead object's id; a sequence seen after its row was reclaimed (standing in
    for that) gets a fresh, exact row."""
    pc = PenaltyCounts(10, rows=2)
    a, c = seq(prompt=[1, 2], out=[3], seq_id=1), seq(prompt=[7], seq_id=3)
    pc.update([a, c])
    a.status = c.status = SequenceStatus.FINISHED_STOPPED
    pc.update([seq(prompt=[4], out=[5], seq_id=2)])  # reclaims both rows, reuses one
    a.status = SequenceStatus.RUNNING
    rows = pc.update([a])
    got = sorted(zip(*(t.tolist() for t in pc.pairs(rows))))
    assert got == [(0, 1, 0.0), (0, 2, 0.0), (0, 3, 1.0)]


def test_presence_penalty_hits_tokens_in_the_output_once_or_more_and_not_prompt_only_ones():
    V, x = 6, torch.zeros(1, 6)
    rows, toks, counts = seen_tokens([[1]], [[2, 3, 3]], V)  # 1: prompt only; 2: once; 3: twice
    got = apply_penalties(
        x, rows, toks, counts, torch.tensor([0.5]), torch.tensor([0.0]), torch.tensor([1.0])
    )
    assert got.tolist() == [[0.0, 0.0, -0.5, -0.5, 0.0, 0.0]]


def test_min_p_keeps_a_token_exactly_at_the_threshold():
    """min_p keeps tokens with probability >= min_p x the largest (vLLM's rule): 0.25 survives min_p
    0.5 against 0.5."""
    x = torch.log(torch.tensor([[0.5, 0.25, 0.25, 0.0]]))
    probs = sampling_probs(
        x, torch.tensor([1.0]), torch.tensor([4]), torch.tensor([1.0]), torch.tensor([0.5])
    )
    assert (probs > 0).tolist() == [[True, True, True, False]]


def test_min_p_zero_leaves_the_softmax_bit_for_bit():
    x = rand_logits(4, 50, 0)
    probs = sampling_probs(x, torch.ones(4), torch.full((4,), 50), torch.ones(4), torch.zeros(4))
    assert torch.equal(probs, x.softmax(-1))


def test_chosen_token_tied_with_the_top_has_rank_one():
    """Rank counts the tokens strictly more likely, plus one; a tie with the top token is rank 1
    whatever order top-k lists them in."""
    lps, tops = token_logprobs(torch.tensor([[1.0, 1.0, 0.0]]), torch.tensor([1]), [2])
    assert (
        tops[0][1].rank == 1
        and tops[0][0].rank == 1
        and tops[0][1].logprob == pytest.approx(lps[0])
    )


# --- logit_bias -----------------------------------------------------------------


@pytest.mark.parametrize("temperature", [0.0, 0.7, 1.5])
def test_logit_bias_of_plus_100_forces_a_token(temperature):
    x = rand_logits(8, 300, 11)
    low = x.argmin(-1).tolist()  # each row's least likely token
    seqs = [seq(temperature=temperature, seed=i, logit_bias={low[i]: 100.0}) for i in range(8)]
    assert Sampler([0])(x, seqs).token_ids == low


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_logit_bias_of_minus_100_bans_a_token(temperature):
    "A token with almost all the mass is never drawn once biased by -100."
    x = torch.zeros(200, 5)
    x[:, 3] = 20.0  # token 3: probability ~1 - 2e-8
    seqs = [seq(temperature=temperature, seed=i, logit_bias={3: -100.0}) for i in range(200)]
    out = Sampler([0])(x, seqs).token_ids
    assert 3 not in out
    assert set(out) == ({0} if temperature == 0 else {0, 1, 2, 4})


def test_logit_bias_leaves_other_rows_of_a_mixed_batch_alone():
    "Rows without a bias give the same tokens and logprobs with or without biased rows beside them."
    x = rand_logits(6, 400, 5)
    plain = [seq(temperature=0), seq(seed=1), seq(seed=2, top_p=0.8), seq(temperature=0)]
    mixed = plain[:2] + [seq(seed=9, logit_bias={1: 100.0}), seq(logit_bias={2: -50.0})] + plain[2:]
    x_mixed = torch.cat([x[:2], x[4:], x[2:4]])  # rows 2-3 are the biased ones
    a = Sampler([0])(x[:4], plain)
    b = Sampler([0])(x_mixed, mixed)
    assert b.token_ids[:2] + b.token_ids[4:] == a.token_ids
    assert b.logprobs[:2] + b.logprobs[4:] == a.logprobs
    assert b.token_ids[2] == 1


def test_logit_bias_is_added_before_penalties_and_temperature():
    "vLLM order: bias on the raw logits, then repetition penalty, then temperature."
    smp = Sampler([0])
    x = torch.tensor([[2.0, 0.0, 0.0, 0.0]])
    s = seq(prompt=[1], temperature=0, repetition_penalty=2.0, logit_bias={1: 6.0})
    assert smp.adjust_logits(x, [s]).tolist() == [[2.0, 3.0, 0.0, 0.0]]  # (0 + 6) / 2
    assert smp(x, [s]).token_ids == [1]


def test_logit_bias_logprobs_stay_the_raw_model_distribution():
    "Like vLLM V1 (logprobs_mode='raw_logprobs'): a forced token reports the model's own logprob."
    x = rand_logits(3, 50, 2)
    low = x.argmin(-1).tolist()
    seqs = [
        seq(temperature=t, seed=3, logprobs=2, logit_bias={low[i]: 100.0})
        for i, t in enumerate([0.0, 1.0, 0.5])
    ]
    out = Sampler([0])(x, seqs)
    raw = x.log_softmax(-1)
    assert out.token_ids == low
    assert out.logprobs == pytest.approx([raw[i, low[i]].item() for i in range(3)], abs=1e-5)
    for i in range(3):
        top = out.top_logprobs[i]
        assert top[low[i]].rank == 50  # still the least likely under the model
        assert list(top)[1] == x[i].argmax().item()


def test_apply_logit_bias_adds_only_the_named_entries():
    x = rand_logits(4, 30, 8)
    biases = [None, {0: 1.5, 29: -2.0}, {}, {7: 100.0}]
    got = apply_logit_bias(x, biases)
    want = x.clone()
    want[1, 0] += 1.5
    want[1, 29] -= 2.0
    want[3, 7] += 100.0
    assert torch.equal(got, want)
    assert apply_logit_bias(x, [None] * 4) is x  # nothing to add: no copy


def test_apply_logit_bias_refuses_a_token_outside_the_vocabulary():
    x = torch.zeros(2, 10)
    assert apply_logit_bias(x, [{9: 1.0}, None])[0, 9] == 1.0  # the last id is fine
    msg = r"^logit_bias: token id 10 is outside the vocabulary \(size 10\)$"
    with pytest.raises(ValueError, match=msg):
        apply_logit_bias(x, [None, {10: 1.0}])


def test_apply_logit_bias_keeps_the_logits_dtype():
    x = torch.zeros(2, 4, dtype=torch.float64)
    got = apply_logit_bias(x, [{1: 0.1}, None])
    assert got.dtype == torch.float64 and got[0, 1].item() == 0.1


def test_logit_bias_with_min_tokens_keeps_eos_banned():
    "A +100 bias cannot bring back eos while min_tokens holds it: the ban is -inf."
    x = torch.zeros(1, 6)
    s = seq(temperature=0, min_tokens=2, logit_bias={2: 100.0, 4: 5.0})
    assert Sampler([2])(x, [s]).token_ids == [4]


def test_each_row_gets_its_own_number_of_top_logprobs():
    "Rows asking 1 and 3 top logprobs in one batch: the first gets 1 (plus the chosen), not 3."
    x = torch.tensor([[4.0, 3.0, 2.0, 1.0, 0.0]] * 2)
    _, tops = token_logprobs(x, torch.tensor([0, 4]), [1, 3])
    assert list(tops[0]) == [0]  # the chosen token is the top one
    assert list(tops[1]) == [4, 0, 1, 2]  # chosen first, then the top 3


def test_penalty_counts_grow_when_every_row_is_taken():
    "No free row and none to reclaim: the table doubles, and the new rows start unseen."
    pc = PenaltyCounts(6, rows=1)
    a, b = seq([1], [2]), seq([3], [4, 4])
    rows = pc.update([a, b])
    assert len(pc.owner) == 2 and tuple(pc.seen.pair_of.shape) == (2, 6)
    got = sorted(zip(*(t.tolist() for t in pc.pairs(rows))))
    assert got == [(0, 1, 0.0), (0, 2, 1.0), (1, 3, 0.0), (1, 4, 2.0)]


def test_the_sampler_makes_every_tensor_on_the_logits_device():
    """With another default device (meta), sampling cpu logits gives what it gives without one:
    every tensor of every path (greedy and drawn rows, seeded and shared generators, filters,
    penalties, bias, bans, logprobs, a vocabulary of several search blocks) is made on the
    logits' device, as on a GPU it must be."""
    V = 2500
    kinds = [
        dict(temperature=0),
        dict(temperature=0.8, top_k=50, top_p=0.9, min_p=0.01, seed=1, logprobs=3),
        dict(temperature=1.0, repetition_penalty=1.3, presence_penalty=0.5, seed=2),
        dict(temperature=0.7, frequency_penalty=0.4, logit_bias={7: 5.0}, min_tokens=4),
        dict(temperature=1.2, logprobs=0),  # the shared generator
    ]
    seqs = [seq([3, 9, 7], [7, 7], seq_id=i, **kw) for i, kw in enumerate(kinds)]
    logits = torch.randn(len(seqs), V, generator=torch.Generator().manual_seed(0))
    want = Sampler(eos_token_ids=[7])(logits, seqs)
    sampler = Sampler(eos_token_ids=[7])
    with torch.device("meta"):
        got = sampler(logits, seqs)
        greedy = sampler(logits[:1], seqs[:1])
    assert (got.token_ids, got.logprobs, got.top_logprobs) == (
        want.token_ids,
        want.logprobs,
        want.top_logprobs,
    )
    assert greedy.token_ids == want.token_ids[:1]


def test_a_ban_that_would_leave_a_row_nothing_is_lifted_on_that_row_only():
    "eos below min_tokens is banned, unless it is all a row allows (a grammar's last word)."
    logits = torch.tensor([[-math.inf, -math.inf, 3.0, -math.inf], [1.0, -math.inf, 3.0, 2.0]])
    seqs = [seq([1], seq_id=i, temperature=0, min_tokens=5) for i in range(2)]
    out = Sampler(eos_token_ids=[2])(logits, seqs)
    assert out.token_ids == [2, 3] and out.logprobs[0] == 0.0


# `make mutation` over chapter 06's modules: what these tests leave alive. Equivalent (no output
# can tell them apart):
# - a dimension written +1 for -1 (or the reverse) on a 2-D tensor;
# - `inverse_cdf`: another block size, an empty last block (`full <= V`), a clamp that allows past
#   the last block, padding columns of the last block counted as mass or as the last token, and
#   the `last` fallback's variants: a target below the row's sum never reaches any of them (they
#   guard a rounding overshoot and an all-zero row, which is refused after);
# - `_ban` writing -INF for -inf, or testing `.all(+1)` for `.all(-1)`;
# - `topk` where `sort` was (K >= V takes every column in order either way), `dtype=torch.long`
#   left out where the values are Python ints (int64 already);
# - `PenaltyCounts`/`SeenPairs`: another unseen or unsynced marker (-2 for -1, 1 for 0: every test
#   is `< 0` or overwritten before use), growing by 3x or to a larger buffer, skipping the fast
#   lookup (`bool(None)`, `b > 0`: the general path gives the same pairs), fewer free rows
#   (`range(..., -2)`: more growth), the capacity argument left at its default;
# - `seen_tokens`'s `.to(None)` and default-device tensors: it builds on the default device by
#   design and moves its result, which is the reference the fast path is tested against.
