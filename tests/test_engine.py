"""Greedy output of the engine equals transformers' `generate`, token for token, for every supported
family, also under preemption, chunked prefill, prefix caching, n = 2, and the Triton backend
(interpreter on CPU)."""

import os
import pytest
import torch
from hetero_infer.core.sampling_params import SamplingParams
from hetero_infer.engine.llm import LLM
from hetero_infer.testing import FAMILIES, tiny_hf_checkpoint

# Larger random weights than HF's default (0.02) give well-separated logits, so greedy ties cannot
# hide a bug
# (and cannot cause a false alarm); Llama gets Llama-3 rope scaling, Qwen2 tied embeddings.
EXTRA = {
    "llama": dict(
        rope_parameters={
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        }
    ),
    "qwen2": dict(tie_word_embeddings=True),
    "qwen3": {},
    "mistral": {},
}


def save_tiny_model(path, family):
    return tiny_hf_checkpoint(
        path,
        family,
        initializer_range=0.2,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
        **EXTRA[family],
    )


N_NEW = 32
PROMPT_LENS = (3, 17, 32, 45, 9)  # includes an exact multiple of block_size 16


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
        # an explicit mask: with only pad_token_id, generate would mask real 0 tokens in the prompt
        # as padding
        out = model.generate(
            torch.tensor([prompt]),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            max_new_tokens=n_new,
            do_sample=False,
            output_scores=True,
            return_dict_in_generate=True,
            pad_token_id=0,
            eos_token_id=None,
        )
    toks = out.sequences[0, len(prompt) :].tolist()
    return toks, [torch.log_softmax(s[0].float(), -1) for s in out.scores]


def check_equal(model, ps, outs, n_new=N_NEW):
    for p, o in zip(ps, outs):
        ref, ref_lp = hf_greedy(model, p, n_new)
        for c in o.outputs:
            ours = c.token_ids
            if ours != ref:
                i = next(k for k, (a, b) in enumerate(zip(ours, ref)) if a != b)
                top5 = ref_lp[i].topk(5).indices.tolist()
                ours_top5 = (
                    sorted(c.logprobs[i], key=lambda t: c.logprobs[i][t].rank)[:5]
                    if c.logprobs
                    else []
                )
                pytest.fail(
                    f"prompt len {len(p)}: first mismatch at step {i}: ours {ours[i]} (in HF top5: "
                    f"{ours[i] in top5}), "
                    f"HF {ref[i]} (in our top5: {ref[i] in ours_top5})"
                )
            if c.logprobs:  # the chosen token's logprob matches HF's at every step
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
    """Repeated prompts hit the prefix cache, including a 32-token prompt (2 full blocks) that is
    entirely cached."""
    family, path, model = checkpoint
    base = prompts()
    ps = [
        base[2],
        base[2],
        base[3][:20] + base[1],
        base[3],
    ]  # same 32-token prompt twice; a shared 16-token prefix
    llm = LLM(str(path), num_blocks=64, enable_prefix_caching=True, **CPU)
    first = llm.generate(ps, GREEDY, use_tqdm=False)
    again = llm.generate(ps, GREEDY, use_tqdm=False)
    assert all(o.num_cached_tokens > 0 for o in again)
    assert (
        again[0].num_cached_tokens >= 16
    )  # fully cached prompt: at least its first full block reused, last token recomputed
    assert again[0].num_cached_tokens < len(ps[0])
    check_equal(model, ps, first)
    check_equal(model, ps, again)


def test_equal_with_n2(checkpoint):
    """n = 2 forks after the prefill and shares the prompt blocks copy-on-write; greedy copies both
    equal HF."""
    family, path, model = checkpoint
    ps = prompts()[:3]
    llm = LLM(str(path), num_blocks=64, **CPU)
    outs = llm.generate(
        ps,
        SamplingParams(n=2, temperature=0, max_tokens=N_NEW, ignore_eos=True, logprobs=5),
        use_tqdm=False,
    )
    assert all(len(o.outputs) == 2 for o in outs)
    check_equal(model, ps, outs)


@pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available(),
    reason="needs CUDA or TRITON_INTERPRET=1",
)
def test_equal_through_triton_backend(tmp_path):
    "One small case through the Triton kernels (the interpreter on CPU)."
    model = save_tiny_model(tmp_path, "llama")
    ps = prompts(lens=(5, 19))
    llm = LLM(str(tmp_path), num_blocks=16, attention_backend="triton", **CPU)
    check_equal(
        model,
        ps,
        llm.generate(
            ps,
            SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=5),
            use_tqdm=False,
        ),
        n_new=6,
    )


def test_prompt_longer_than_max_model_len(tmp_path):
    save_tiny_model(tmp_path, "llama")
    llm = LLM(str(tmp_path), num_blocks=16, max_model_len=32, **CPU)
    with pytest.raises(ValueError, match="max_model_len"):
        llm.generate([list(range(40))], use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()


# --- a step that raises (issue 10, item 1): retried, then an error output; nothing half-done
# survives it

from collections import Counter  # noqa: E402
from hetero_infer.engine.llm import EngineStepError  # noqa: E402
from hetero_infer.engine.llm_engine import LLMEngine  # noqa: E402
from hetero_infer.core.config import EngineConfig  # noqa: E402


def fail_on(model, calls, exc=None):
    """Make the real model's forward raise on the given 1-based call numbers (before any layer
    writes KV)."""
    n = Counter()

    def hook(module, args):
        n["calls"] += 1
        if n["calls"] in calls:
            raise exc or RuntimeError("CUDA out of memory (injected)")

    return model.register_forward_pre_hook(hook), n


G16 = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    path = tmp_path_factory.mktemp("llama_fail")
    save_tiny_model(path, "llama")
    fresh = LLM(str(path), num_blocks=64, **CPU)
    ps = prompts(
        lens=(33, 20, 7)
    )  # 33 tokens: two full blocks of 16 that a poisoned cache would serve
    return path, ps, [o.outputs[0].token_ids for o in fresh.generate(ps, G16, use_tqdm=False)]


def test_failed_steps_are_retried(llama):
    """The forward pass raises on calls 2 and 3 (a decode and its retry); the requests still end
    equal to a fresh engine's output."""
    path, ps, want = llama
    eng = LLMEngine(
        EngineConfig(
            model=str(path), num_blocks=64, enable_prefix_caching=True, max_retry_attempts=2, **CPU
        )
    )
    hook, n = fail_on(eng.runner.model, {2, 3})
    for i, p in enumerate(ps):
        eng.add_request(str(i), p, G16)
    outs = {}
    while eng.has_unfinished_requests():
        for o in eng.step():
            outs[o.request_id] = o
    hook.remove()
    assert [outs[str(i)].outputs[0].token_ids for i in range(3)] == want
    assert all(o.error is None and o.outputs[0].finish_reason == "length" for o in outs.values())
    assert (eng.counters["failed_steps"], eng.counters["retries"]) == (2, 2 * 3)
    assert isinstance(eng.last_error, RuntimeError) and eng.block_manager.usage() == 0


@pytest.mark.parametrize("retries", [0, 2])
def test_failing_prefill_ends_with_error_and_poisons_nothing(llama, retries):
    """A prefill that always raises: after max_retry_attempts retries the request ends with
    finish_reason 'error', its blocks are free, generate raises (chained to the cause), and the
    same prompt afterwards equals a fresh engine's greedy output (prefix caching on)."""
    path, ps, want = llama
    llm = LLM(
        str(path), num_blocks=64, enable_prefix_caching=True, max_retry_attempts=retries, **CPU
    )
    hook, n = fail_on(llm.engine.runner.model, set(range(1, 1000)))
    with pytest.raises(EngineStepError, match="failed") as e:
        llm.generate(ps[0], G16, use_tqdm=False)
    hook.remove()
    assert n["calls"] == retries + 1 and isinstance(e.value.__cause__, RuntimeError)
    (out,) = e.value.outputs
    assert (
        out.finished and out.outputs[0].finish_reason == "error" and out.outputs[0].token_ids == []
    )
    assert (
        f"max_retry_attempts={retries}" in out.error
        and "CUDA out of memory (injected)" in out.error
    )
    assert llm.engine.block_manager.usage() == 0 and not llm.engine.has_unfinished_requests()
    assert llm.engine.block_manager.num_free_blocks() == 64
    again = llm.generate(ps, G16, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in again] == want


def test_keyboard_interrupt_in_generate_leaves_nothing_behind(llama):
    """Ctrl-C inside a forward pass: generate aborts its own requests; the next generate returns
    only its outputs, equal to a fresh engine's."""
    path, ps, want = llama
    llm = LLM(str(path), num_blocks=64, enable_prefix_caching=True, **CPU)
    hook, n = fail_on(llm.engine.runner.model, {1}, KeyboardInterrupt())
    with pytest.raises(KeyboardInterrupt):
        llm.generate(ps, G16, use_tqdm=False)
    hook.remove()
    assert not llm.engine.has_unfinished_requests() and llm.engine.block_manager.usage() == 0
    outs = llm.generate([ps[2], ps[0]], G16, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [want[2], want[0]]


def test_sampler_failure_with_n2_is_retried(llama):
    """The sampler raises once at the step that would fork n = 2: nothing is forked twice, both
    completions equal the greedy output."""
    path, ps, want = llama
    llm = LLM(str(path), num_blocks=64, **CPU)
    real, calls = llm.engine.sampler.__class__.__call__, Counter()

    class Flaky(llm.engine.sampler.__class__):
        def __call__(self, logits, seqs):
            calls["n"] += 1
            if calls["n"] == 1:
                raise RuntimeError("sampler failed (injected)")
            return real(self, logits, seqs)

    llm.engine.sampler.__class__ = Flaky
    (out,) = llm.generate(
        ps[1], SamplingParams(n=2, temperature=0, max_tokens=16, ignore_eos=True), use_tqdm=False
    )
    assert [c.token_ids for c in out.outputs] == [want[1], want[1]] and [
        c.index for c in out.outputs
    ] == [0, 1]
    assert llm.engine.counters["retries"] == 1 and llm.engine.block_manager.usage() == 0


# --- prompt forms (item 5) and LLM arguments (item 8)


def test_prompt_forms_as_vllm(llama):
    path, ps, want = llama
    llm = LLM(str(path), num_blocks=64, **CPU)
    one = llm.generate({"prompt_token_ids": ps[0]}, G16, use_tqdm=False)
    assert (
        len(one) == 1
        and one[0].outputs[0].token_ids == want[0]
        and one[0].prompt_token_ids == ps[0]
    )
    mixed = llm.generate([ps[0], {"prompt_token_ids": ps[1]}, tuple(ps[2])], G16, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in mixed] == want
    with pytest.raises(ValueError, match="'prompt' or 'prompt_token_ids'"):
        llm.generate({"prompt_ids": ps[0]}, use_tqdm=False)
    with pytest.raises(ValueError, match="no tokenizer"):
        llm.generate({"prompt": "text"}, use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()


def test_llm_arguments_as_vllm(llama, tmp_path):
    from pathlib import Path

    path, ps, want = llama
    with pytest.raises(ValueError, match="tokenizer"):
        LLM(str(path), tokenizer="/no/such/dir", device="cpu")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="device='cuda'"):
            LLM(str(path), device="cuda")
    for dt, want_dt in [
        ("half", torch.float16),
        (torch.float16, torch.float16),
        ("float", torch.float32),
        (torch.bfloat16, torch.bfloat16),
    ]:
        assert LLM(Path(path), device="cpu", dtype=dt, num_blocks=8).engine.runner.dtype == want_dt
    demo = Path(__file__).resolve().parent.parent / "hetero_infer" / "demo_model"
    llm = LLM(Path(path), tokenizer=demo, seed=None, **CPU, num_blocks=8)
    assert llm.get_tokenizer() is not None and isinstance(llm.engine.config.seed, int)


# --- EOS (item 3) and include_stop_str_in_output (item 4), on the demo model


def _demo_copy(tmp_path, eos):
    import json
    import shutil
    from hetero_infer.core.config import DEMO_MODEL_DIR

    d = tmp_path / "demo"
    shutil.copytree(DEMO_MODEL_DIR, d)
    for name in ("config.json", "generation_config.json"):
        c = json.loads((d / name).read_text())
        c["eos_token_id"] = eos
        (d / name).write_text(json.dumps(c))
    return d


CHAT = [{"role": "user", "content": "reverse: a b c d"}]


def test_eos_is_the_union_with_the_tokenizers(tmp_path):
    """config/generation_config name another EOS id (3); the tokenizer's <|eos|> (2) still stops
    generation."""
    llm = LLM(_demo_copy(tmp_path, 3), device="cpu")
    assert llm.engine.eos_token_ids == {2, 3}
    c = llm.chat(CHAT, SamplingParams(temperature=0, max_tokens=30), use_tqdm=False)[0].outputs[0]
    assert (c.text, c.finish_reason, c.token_ids[-1]) == ("d c b a", "stop", 2)


def test_include_stop_str_in_output_keeps_stop_token_text():
    llm = LLM(device="cpu")
    tok = llm.get_tokenizer()
    b = tok.encode(" b", add_special_tokens=False)[0]

    def run(**kw):
        return llm.chat(CHAT, SamplingParams(temperature=0, max_tokens=30, **kw), use_tqdm=False)[
            0
        ].outputs[0]

    assert run(stop_token_ids=[b]).text == "d c"
    kept = run(stop_token_ids=[b], include_stop_str_in_output=True)
    assert (kept.text, kept.finish_reason, kept.stop_reason) == ("d c b", "stop", b)
    assert run(include_stop_str_in_output=True).text == "d c b a"  # EOS is special: skipped
    assert run(include_stop_str_in_output=True, skip_special_tokens=False).text == "d c b a<|eos|>"
    assert run(skip_special_tokens=False).text == "d c b a"


# --- sliding windows (issue 14 item 4, model side): prompt + output longer than the window, equal
# to transformers


def _takes_window(name):
    import inspect
    from hetero_infer.attention.backend import get_attention_backend

    try:
        b = get_attention_backend(name, torch.device("cpu"))
    except Exception:
        return False
    return all(
        "window" in inspect.signature(getattr(b, m)).parameters
        for m in ("forward", "decode", "prefill")
    )


SLIDING = {
    "mistral": dict(sliding_window=6),
    "qwen2": dict(use_sliding_window=True, sliding_window=6, max_window_layers=1),
}


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("family", list(SLIDING))
def test_sliding_window_equals_transformers(tmp_path, family, backend):
    if (
        backend == "triton"
        and os.environ.get("TRITON_INTERPRET") != "1"
        and not torch.cuda.is_available()
    ):
        pytest.skip("needs CUDA or TRITON_INTERPRET=1")
    if not _takes_window(backend):
        pytest.skip(f"the {backend} attention backend takes no window= yet (H2/H4)")
    model = tiny_hf_checkpoint(
        tmp_path,
        family,
        initializer_range=0.2,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
        **SLIDING[family],
    )
    ps = prompts(lens=(9, 21, 4))  # 9 and 21 > window 6; all grow past it
    llm = LLM(str(tmp_path), num_blocks=64, attention_backend=backend, **{**CPU, "block_size": 4})
    assert llm.engine.runner.max_model_len == 512  # not capped at the window
    n_new = 12 if backend == "triton" else 20
    outs = llm.generate(
        ps,
        SamplingParams(temperature=0, max_tokens=n_new, ignore_eos=True, logprobs=5),
        use_tqdm=False,
    )
    check_equal(model, ps, outs, n_new=n_new)
