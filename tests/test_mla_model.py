"""DeepSeek-V2 and V3 checkpoints through `LLM(path)` (18_multi_head_latent_attention): greedy
output token-identical to transformers' `generate` for tiny random models (V2: no query LoRA,
softmax routing; V3: query LoRA, YaRN, sigmoid routing with a correction bias, group-limited top-k,
a dense first layer, a shared expert), alone, with chunked prefill + prefix caching + preemption
(recompute and swap), with ngram speculation, with n > 1, on the Triton backend (interpreter) and
with tensor_parallel_size=2; the latent cache's size in blocks; bad configs refused by field."""

import json
from pathlib import Path
import pytest
import torch
import hetero_infer
from hetero_infer.core.config import EngineConfig
from hetero_infer.core.sampling_params import SamplingParams
from hetero_infer.engine.llm import LLM
from hetero_infer.model.runner import CPU_KV_CACHE_BYTES
from hetero_infer.mla.model import deepseek_config  # importing it registers the DeepSeek family
from hetero_infer.mla.testing import DEEPSEEK_V2_LITE, tiny_deepseek_checkpoint
from hetero_infer.testing import DUMMY_CONFIGS, dummy_checkpoint, tiny_hf_checkpoint
from test_engine import hf_greedy, prompts
from test_speculative import looping_prompts

N_NEW = 12
GREEDY = SamplingParams(temperature=0, max_tokens=N_NEW, ignore_eos=True)
CPU = dict(device="cpu", dtype="float32", block_size=16)
NO_SPECIAL = dict(bos_token_id=None, eos_token_id=None, pad_token_id=None)
SPREAD = dict(initializer_range=0.2, **NO_SPECIAL)  # distinct logits; greedy output that loops


def _run(path, ps, params=GREEDY, stats=False, **kw):
    llm = LLM(str(path), **CPU, **kw)
    try:
        outs = llm.generate(ps, params, use_tqdm=False)
        return (outs, llm.engine.stats) if stats else [o.outputs[0].token_ids for o in outs]
    finally:
        llm.close()


@pytest.fixture(scope="module", params=["v2", "v3"])
def ckpt(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    return path, tiny_deepseek_checkpoint(path, request.param, **SPREAD)


@pytest.fixture(scope="module")
def v3(tmp_path_factory):
    path = tmp_path_factory.mktemp("v3_only")
    return path, tiny_deepseek_checkpoint(path, "v3", **SPREAD)


def test_greedy_equals_transformers(ckpt):
    path, hf = ckpt
    ps = prompts((3, 17, 60, 9))  # 60: past the tiny shape's q* = 54, decompressed
    assert _run(path, ps) == [hf_greedy(hf, p, N_NEW)[0] for p in ps]


def _preempting(path, hf, **kw):
    "A shared 32-token prefix, 8 blocks of 16 and 32 tokens a step: chunks, cache hits, preemption."
    shared = prompts((32,), seed=3)[0]
    ps = [shared + p for p in prompts((5, 9, 13, 2), seed=4)] + prompts((30,), seed=5)
    tight = dict(
        max_num_batched_tokens=32, num_blocks=8, max_num_seqs=4, enable_prefix_caching=True
    )
    long = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    outs, stats = _run(path, ps, long, stats=True, **tight, **kw)
    assert [o.outputs[0].token_ids for o in outs] == [hf_greedy(hf, p, 24)[0] for p in ps]
    assert stats["preemptions"] > 0 and stats["prefix_cache"]["cache_hits"] > 0, stats


def test_chunked_prefill_prefix_caching_and_preemption(ckpt):
    _preempting(*ckpt)


def test_swap_preemption(v3):
    "Chapter 17's swap moves each layer's one latent tensor to the host and back."
    _preempting(*v3, preemption_mode="swap", swap_space=0.01)


def test_ngram_speculation(ckpt):
    "Verification rows (k + 1 queries a sequence) are absorbed; the tokens are transformers'."
    path, hf = ckpt
    ps, n = looping_prompts(), 24
    params = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
    kw = dict(speculative_method="ngram", num_speculative_tokens=3, enable_prefix_caching=True)
    outs, stats = _run(path, ps, params, stats=True, **kw)
    assert [o.outputs[0].token_ids for o in outs] == [hf_greedy(hf, p, n)[0] for p in ps]
    assert stats["speculative"]["num_accepted_tokens"] > 0, stats


def test_n_greater_than_one_shares_the_prompt(ckpt):
    path, hf = ckpt
    p = prompts((21,), seed=9)[0]
    params = SamplingParams(n=3, temperature=0, max_tokens=8, ignore_eos=True)
    (out,) = _run(path, [p], params, stats=True)[0]
    want = hf_greedy(hf, p, 8)[0]
    assert [c.token_ids for c in out.outputs] == [want] * 3


def test_the_triton_backend_in_the_interpreter(v3):
    "Decodes through the Triton MLA kernel (TRITON_INTERPRET=1 on CPU), the same tokens."
    path, hf = v3
    ps = prompts((5, 19), seed=11)
    assert _run(path, ps, attention_backend="triton") == [hf_greedy(hf, p, N_NEW)[0] for p in ps]


def test_tensor_parallel_2(v3):
    "Heads split over two gloo ranks, each with the whole latent cache; experts split by 16's rule."
    init = Path(hetero_infer.__file__).read_text()
    assert "hetero_infer.mla.model" in init, (
        "hetero_infer/__init__.py must import hetero_infer.mla.model: the spawned ranks import the "
        "package, and only then know the DeepSeek family"
    )
    path, hf = v3
    ps = prompts((3, 17, 60, 9))
    assert _run(path, ps, tensor_parallel_size=2) == [hf_greedy(hf, p, N_NEW)[0] for p in ps]


def test_v2_lites_yarn_equals_transformers(tmp_path):
    "V2-Lite's rope (YaRN, factor 40, mscale = mscale_all_dim = 0.707) on the tiny V2."
    rope = dict(DEEPSEEK_V2_LITE["rope_scaling"])
    hf = tiny_deepseek_checkpoint(tmp_path, "v2", rope_scaling=rope, **SPREAD)
    assert hf.config.rope_parameters["mscale_all_dim"] == 0.707
    ps = prompts((3, 40), seed=13)
    assert _run(tmp_path, ps) == [hf_greedy(hf, p, N_NEW)[0] for p in ps]


def test_v2_lite_is_a_benchmark_shape(tmp_path):
    "Registered among chapter 04b's dummy configs; its config at a tiny width loads and generates."
    assert DUMMY_CONFIGS["deepseek-v2-lite"] is DEEPSEEK_V2_LITE
    assert deepseek_config(DEEPSEEK_V2_LITE).num_layers == 27
    small = dict(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        kv_lora_rank=32, qk_rope_head_dim=16, qk_nope_head_dim=16, v_head_dim=16,
        n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, vocab_size=256,
    )  # fmt: skip
    path = dummy_checkpoint({**DEEPSEEK_V2_LITE, **small}, tmp_path, dtype="float32")
    (out,) = _run(path, prompts((7,), seed=14))
    assert len(out) == N_NEW


def test_blocks_at_the_latents_size(tmp_path):
    """At the fixed CPU budget the latent cache holds what its 576 values a token allow, against a
    Llama of the same depth with 8 KV heads of 128 (2048 values a token)."""
    mla = tiny_deepseek_checkpoint(
        tmp_path / "mla", "v2", kv_lora_rank=512, qk_rope_head_dim=64, **NO_SPECIAL
    )
    tiny_hf_checkpoint(
        tmp_path / "llama", "llama", num_key_value_heads=8, num_attention_heads=8, head_dim=128,
        num_hidden_layers=mla.config.num_hidden_layers,
    )  # fmt: skip
    kw = dict(max_num_seqs=256, max_model_len=512)  # 256 x 512 tokens: more than the budget holds
    blocks = {}
    for name in ("mla", "llama"):
        llm = LLM(str(tmp_path / name), device="cpu", dtype="float32", block_size=16, **kw)
        blocks[name] = llm.engine.stats["num_blocks"]
        llm.close()
    per_token = {"mla": 576, "llama": 2 * 8 * 128}
    for name, n in blocks.items():
        want = CPU_KV_CACHE_BYTES // (3 * 16 * per_token[name] * 4)
        assert abs(n - want) <= 0.1 * want, (name, n, want)
    assert abs(blocks["mla"] / blocks["llama"] - 2048 / 576) < 0.1 * 2048 / 576, blocks


@pytest.mark.parametrize(
    "field, value, message",
    [
        ("kv_lora_rank", None, "kv_lora_rank: missing"),
        ("qk_rope_head_dim", 15, "qk_rope_head_dim must be even"),
        ("qk_head_dim", 40, "qk_head_dim (40) must equal"),
        ("n_group", 3, "n_group (3) must divide"),
        ("rope_parameters", {"rope_type": "linear", "factor": 2.0}, "rope_scaling: rope_type"),
    ],
)
def test_a_bad_config_is_refused_by_field(v3, tmp_path, field, value, message):
    "The config is read before any weight: a directory with only config.json is enough."
    d = json.loads((v3[0] / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**d, field: value}))
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        LLM(str(tmp_path), **CPU)


def test_what_does_not_compose_yet_is_refused(v3):
    path = str(v3[0])
    with pytest.raises(ValueError, match="quantization='int8' is not supported"):
        EngineConfig(model=path, quantization="int8")
    with pytest.raises(ValueError, match="kv_role='(kv_producer|prefill)' is not supported"):
        EngineConfig(model=path, kv_role="kv_producer")


def test_the_fp8_cache(v3):
    "A float8 latent cache (chapter 15's kv_cache_dtype): the same engine, latents stored in fp8."
    llm = LLM(str(v3[0]), **CPU, kv_cache_dtype="fp8")
    try:
        (out,) = llm.generate(prompts((9,), seed=12), GREEDY, use_tqdm=False)
        caches = llm.engine.runner.kv_caches
    finally:
        llm.close()
    assert len(out.outputs[0].token_ids) == N_NEW
    assert [tuple(t.shape[2:]) for t in caches[0]] == [(1, 48)]
    assert caches[0][0].dtype == torch.float8_e4m3fn


def test_the_model_config(v3):
    "The decoder's view of a DeepSeek config: one latent KV head, o_proj's width per head."
    c = deepseek_config(json.loads((v3[0] / "config.json").read_text()))
    assert (c.num_kv_heads, c.head_dim, c.rope_scaling["rope_type"]) == (1, 24, "yarn")
