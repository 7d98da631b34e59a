"""Greedy output of the engine equals transformers' `generate`, token for token, for every supported family,
also under preemption, chunked prefill, prefix caching, n = 2, and the Triton backend (interpreter on CPU)."""
import os
import pytest, torch
from hetero_infer.core import SamplingParams
from hetero_infer.engine import LLM
from hetero_infer.model import FAMILIES, tiny_hf_checkpoint

# Larger random weights than HF's default (0.02) give well-separated logits, so greedy ties cannot hide a bug
# (and cannot cause a false alarm); Llama gets Llama-3 rope scaling, Qwen2 tied embeddings.
EXTRA = {"llama": dict(rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                                        "high_freq_factor": 4.0, "original_max_position_embeddings": 64}),
         "qwen2": dict(tie_word_embeddings=True), "qwen3": {}, "mistral": {}}

def save_tiny_model(path, family):
    return tiny_hf_checkpoint(path, family, initializer_range=0.2, bos_token_id=None, eos_token_id=None, pad_token_id=None, **EXTRA[family])

N_NEW = 32
PROMPT_LENS = (3, 17, 32, 45, 9)   # includes an exact multiple of block_size 16

@pytest.fixture(scope="module", params=list(FAMILIES))
def checkpoint(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    model = save_tiny_model(path, request.param)
    return request.param, path, model

def prompts(lens=PROMPT_LENS, seed=1, vocab=256):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lens]

def hf_greedy(model, prompt, n_new=N_NEW):
    "transformers' greedy continuation of one prompt and the log-softmax of each step's logits."
    with torch.no_grad():
        # an explicit mask: with only pad_token_id, generate would mask real 0 tokens in the prompt as padding
        out = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long), max_new_tokens=n_new, do_sample=False, output_scores=True,
                             return_dict_in_generate=True, pad_token_id=0, eos_token_id=None)
    toks = out.sequences[0, len(prompt):].tolist()
    return toks, [torch.log_softmax(s[0].float(), -1) for s in out.scores]

def check_equal(model, ps, outs, n_new=N_NEW):
    for p, o in zip(ps, outs):
        ref, ref_lp = hf_greedy(model, p, n_new)
        for c in o.outputs:
            ours = c.token_ids
            if ours != ref:
                i = next(k for k, (a, b) in enumerate(zip(ours, ref)) if a != b)
                top5 = ref_lp[i].topk(5).indices.tolist()
                ours_top5 = sorted(c.logprobs[i], key=lambda t: c.logprobs[i][t].rank)[:5] if c.logprobs else []
                pytest.fail(f"prompt len {len(p)}: first mismatch at step {i}: ours {ours[i]} (in HF top5: {ours[i] in top5}), "
                            f"HF {ref[i]} (in our top5: {ref[i] in ours_top5})")
            if c.logprobs:   # the chosen token's logprob matches HF's at every step
                got = torch.tensor([c.logprobs[k][t].logprob for k, t in enumerate(ours)])
                want = torch.stack([ref_lp[k][t] for k, t in enumerate(ref)])
                torch.testing.assert_close(got, want, atol=2e-4, rtol=1e-4)
            assert c.finish_reason == "length"

GREEDY = SamplingParams(temperature=0, max_tokens=N_NEW, ignore_eos=True, logprobs=5)
CPU = dict(device="cpu", dtype="float32", block_size=16)

def test_greedy_equals_transformers(checkpoint):
    family, path, model = checkpoint
    ps = prompts()
    llm = LLM(str(path), num_blocks=64, **CPU)
    check_equal(model, ps, llm.generate(ps, GREEDY, use_tqdm=False))

def test_equal_under_preemption(checkpoint):
    "A cache of 12 blocks x 8 tokens cannot hold the batch: sequences are preempted and recomputed."
    family, path, model = checkpoint
    ps = prompts()
    llm = LLM(str(path), **{**CPU, "block_size": 8}, num_blocks=12, max_model_len=96)
    outs = llm.generate(ps, GREEDY, use_tqdm=False)
    assert llm.engine.stats["preemptions"] > 0
    check_equal(model, ps, outs)

def test_equal_with_chunked_prefill(checkpoint):
    family, path, model = checkpoint
    ps = prompts()
    llm = LLM(str(path), num_blocks=64, max_num_batched_tokens=16, **CPU)
    check_equal(model, ps, llm.generate(ps, GREEDY, use_tqdm=False))

def test_equal_with_prefix_caching(checkpoint):
    "Repeated prompts hit the prefix cache, including a 32-token prompt (2 full blocks) that is entirely cached."
    family, path, model = checkpoint
    base = prompts()
    ps = [base[2], base[2], base[3][:20] + base[1], base[3]]   # same 32-token prompt twice; a shared 16-token prefix
    llm = LLM(str(path), num_blocks=64, enable_prefix_caching=True, **CPU)
    first = llm.generate(ps, GREEDY, use_tqdm=False)
    again = llm.generate(ps, GREEDY, use_tqdm=False)
    assert all(o.num_cached_tokens > 0 for o in again)
    assert again[0].num_cached_tokens >= 16   # fully cached prompt: at least its first full block reused, last token recomputed
    assert again[0].num_cached_tokens < len(ps[0])
    check_equal(model, ps, first); check_equal(model, ps, again)

def test_equal_with_n2(checkpoint):
    "n = 2 forks after the prefill and shares the prompt blocks copy-on-write; greedy copies both equal HF."
    family, path, model = checkpoint
    ps = prompts()[:3]
    llm = LLM(str(path), num_blocks=64, **CPU)
    outs = llm.generate(ps, SamplingParams(n=2, temperature=0, max_tokens=N_NEW, ignore_eos=True, logprobs=5), use_tqdm=False)
    assert all(len(o.outputs) == 2 for o in outs)
    check_equal(model, ps, outs)

@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available(), reason="needs CUDA or TRITON_INTERPRET=1")
def test_equal_through_triton_backend(tmp_path):
    "One small case through the Triton kernels (the interpreter on CPU)."
    model = save_tiny_model(tmp_path, "llama")
    ps = prompts(lens=(5, 19))
    llm = LLM(str(tmp_path), num_blocks=16, attention_backend="triton", **CPU)
    check_equal(model, ps, llm.generate(ps, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=5), use_tqdm=False), n_new=6)

def test_prompt_longer_than_max_model_len(tmp_path):
    save_tiny_model(tmp_path, "llama")
    llm = LLM(str(tmp_path), num_blocks=16, max_model_len=32, **CPU)
    with pytest.raises(ValueError, match="max_model_len"): llm.generate([list(range(40))], use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()
