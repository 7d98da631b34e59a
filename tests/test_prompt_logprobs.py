"""Prompt logprobs (chapter 07) against transformers: every prompt position of a prompt longer than
one prefill chunk, for every dense and mixture-of-experts family, with and without a prefix-cache
hit, with n > 1 and under preemption. The reference is a log-softmax over transformers' logits."""

import pytest
import torch
from hetero_infer.core.config import EngineConfig
from hetero_infer.core.sampling_params import SamplingParams
from hetero_infer.engine.llm_engine import LLMEngine
from hetero_infer.testing import FAMILIES, MOE_TEST_FAMILIES, tiny_hf_checkpoint

CPU = dict(device="cpu", dtype="float32")
K = 2  # top logprobs asked at each position


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    "family -> (path, transformers model), saved once for the module."
    out = {}
    for family in [*FAMILIES, *MOE_TEST_FAMILIES]:
        path = str(tmp_path_factory.mktemp(family))
        out[family] = (path, tiny_hf_checkpoint(path, family).float().eval())
    return out


def reference(hf, ids: list[int]) -> torch.Tensor:
    "Log-softmax of transformers' logits at each prompt position: (len(ids), vocab)."
    with torch.no_grad():
        return torch.log_softmax(hf(torch.tensor([ids])).logits[0].float(), -1)


def run(eng: LLMEngine, requests: dict) -> dict:
    "request id -> finished RequestOutput; `requests`: id -> (prompt ids, SamplingParams)."
    for rid, (ids, params) in requests.items():
        eng.add_request(rid, ids, params)
    done = {}
    for _ in range(500):
        if not eng.has_unfinished_requests():
            break
        done |= {o.request_id: o for o in eng.step() if o.finished}
    assert not eng.has_unfinished_requests()
    return done


def check(out, ids: list[int], ref: torch.Tensor):
    "The actual token's logprob at every later position, its rank, and the top K."
    plp = out.prompt_logprobs
    assert len(plp) == len(ids) and plp[0] is None
    got = torch.tensor([plp[p][ids[p]].logprob for p in range(1, len(ids))])
    want = ref[torch.arange(len(ids) - 1), torch.tensor(ids[1:])]
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    for p in range(1, len(ids)):
        top = ref[p - 1].topk(K).indices.tolist()
        assert set(top) <= set(plp[p]), (p, top, list(plp[p]))
        assert plp[p][ids[p]].rank == int((ref[p - 1] > ref[p - 1][ids[p]]).sum()) + 1


def prompt(seed: int, n: int = 45) -> list[int]:
    return torch.randint(3, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.mark.parametrize("family", [*FAMILIES, *MOE_TEST_FAMILIES])
def test_every_position_through_chunks_and_a_prefix_hit(checkpoints, family):
    """A 45-token prompt under a 16-token budget (three chunks), then a second prompt sharing its
    first 32 tokens: the second request's cached blocks are computed again for their logits."""
    path, hf = checkpoints[family]
    cfg = EngineConfig(model=path, **CPU, block_size=8, num_blocks=64, max_num_batched_tokens=16)
    eng = LLMEngine(cfg)
    a = prompt(0)
    b = a[:32] + prompt(1, 13)
    params = SamplingParams(max_tokens=1, prompt_logprobs=K)
    check(run(eng, {"a": (a, params)})["a"], a, reference(hf, a))
    hits = eng.stats.get("prefix_cache_hits")
    out = run(eng, {"b": (b, params)})["b"]
    check(out, b, reference(hf, b))
    plain = run(eng, {"c": (b, SamplingParams(max_tokens=1))})["c"]  # no scores: cache served
    assert plain.num_cached_tokens >= 32 and out.num_cached_tokens == 0, (hits, plain, out)


def test_n_above_one_and_preemption(checkpoints):
    """n = 3 samples share one scored prompt; a cache too small for every request preempts some,
    and the scores of a recomputed prompt are the same."""
    path, hf = checkpoints["llama"]
    cfg = EngineConfig(model=path, **CPU, block_size=4, num_blocks=40, max_num_batched_tokens=16)
    eng = LLMEngine(cfg)
    prompts = {f"r{i}": prompt(10 + i, 30) for i in range(4)}
    reqs = {
        rid: (
            ids,
            SamplingParams(
                n=3 if rid == "r0" else 1,
                max_tokens=24,
                ignore_eos=True,
                temperature=0.8,
                seed=1,
                prompt_logprobs=K,
            ),
        )
        for rid, ids in prompts.items()
    }
    done = run(eng, reqs)
    assert eng.stats["preemptions"] > 0, eng.stats
    assert len(done["r0"].outputs) == 3
    for rid, ids in prompts.items():
        check(done[rid], ids, reference(hf, ids))


def test_prompt_logprobs_carry_each_tokens_text_when_the_request_makes_text():
    "With a tokenizer each scored prompt token names its text, as sampled logprobs do."
    from hetero_infer.engine.llm import LLM

    llm = LLM(**CPU, num_blocks=32)
    tok = llm.get_tokenizer()
    (out,) = llm.generate(
        ["reverse: a b"], SamplingParams(max_tokens=1, prompt_logprobs=1), use_tqdm=False
    )
    plp = out.prompt_logprobs
    assert plp[0] is None and len(plp) == len(out.prompt_token_ids) > 3
    decoded = [(t, lp.decoded_token) for step in plp[1:] for t, lp in step.items()]
    assert decoded and all(d == tok.decode([t]) for t, d in decoded)
    assert [plp[p][t].decoded_token for p, t in enumerate(out.prompt_token_ids) if p] == [
        ":",
        " a",
        " b",
    ]


# `make mutation` over `engine.prompt_logprobs`: what these tests leave alive. Equivalent:
# `scores_prompt` with `<=` (at num_computed == num_prompt an entry has one row and no target
# either way). Only a GPU tells apart: the `device=` of the row and token index tensors.
