"""Multi-head latent attention's pieces (18_multi_head_latent_attention): the absorbed decode kernel
(Triton, in the interpreter on CPU) equals the torch reference on a NaN-filled latent cache across
block sizes, context lengths, batch shapes, head counts and awkward latent widths, with and without
split-K; absorbed attention equals decompress-then-attend on mixed steps; DeepSeek's router equals
transformers' on random logits; the kernel's binaries compile for sm_80 and sm_90 without spills."""

import pytest
import torch
import torch.nn.functional as F
from hetero_infer.attention.backend import AttentionMetadata
from hetero_infer.attention.torch_ref import bucket_keys
from hetero_infer.mla.attention import (
    absorbed_query,
    decompress_cheaper,
    decompressed_attention,
    latent_attention,
    unabsorb,
)
from hetero_infer.mla.cache import write_latent
from hetero_infer.mla.config import MLAConfig
from hetero_infer.mla.kernels import triton_mla_decode
from hetero_infer.mla.moe import DeepseekMoEConfig, deepseek_route
from hetero_infer.mla.tiles import mla_decode_specs


def _cache(seq_lens, bs, D, q_lens=None, seed=0, dtype=torch.float32):
    "A NaN-filled latent cache holding each sequence's context at shuffled blocks, and its meta."
    g = torch.Generator().manual_seed(seed)
    need = [-(-n // bs) for n in seq_lens]
    ids = torch.randperm(sum(need) + 3, generator=g).tolist()
    tables = [[ids.pop() for _ in range(k)] for k in need]
    latent = torch.full((sum(need) + 3, bs, 1, D), float("nan"), dtype=dtype)
    full = AttentionMetadata.build(seq_lens, seq_lens, tables, bs)
    c = torch.randn(sum(seq_lens), D, generator=g)
    write_latent(c, c[:, :0], latent, full.slot_mapping)
    q_lens = q_lens or [1] * len(seq_lens)
    return latent, AttentionMetadata.build(seq_lens, q_lens, tables, bs)


LENS = [(1,), (7, 33), (100, 1, 17, 64, 9)]  # context lengths: the batch shapes
SHAPES = [(1, 40, 8), (5, 32, 16), (20, 72, 24)]  # heads, latent r, rope dr: none a power of two
CASES = [  # every block size, length set and shape at least twice, in 8 combinations
    (1, LENS[0], SHAPES[0]), (1, LENS[2], SHAPES[1]), (2, LENS[1], SHAPES[2]),
    (2, LENS[2], SHAPES[0]), (8, LENS[0], SHAPES[1]), (8, LENS[1], SHAPES[0]),
    (16, LENS[2], SHAPES[2]), (16, LENS[1], SHAPES[1]),
]  # fmt: skip


@pytest.mark.parametrize("bs, lens, shape", CASES)
def test_the_kernel_equals_the_reference_on_a_nan_cache(bs, lens, shape):
    H, r, dr = shape
    latent, meta = _cache(list(lens), bs, r + dr, seed=bs + len(lens))
    q = torch.randn(len(lens), H, r + dr)
    ref = latent_attention(q, latent, meta.attention_plan(bs, None, 256), 0.2, r)
    assert not ref.isnan().any()
    for splits in (1, 3):
        out = triton_mla_decode(q, latent, meta.block_tables, meta.seq_lens, 0.2, r, splits)
        torch.testing.assert_close(out, ref, atol=2e-5, rtol=1e-4)


def test_the_kernel_in_half_precision():
    latent, meta = _cache([50, 3], 8, 48, dtype=torch.float16)
    q = torch.randn(2, 6, 48).half()
    ref = latent_attention(q.float(), latent.float(), meta.attention_plan(8, None, 256), 0.3, 32)
    out = triton_mla_decode(q, latent, meta.block_tables, meta.seq_lens, 0.3, 32)
    assert out.dtype == torch.float16
    torch.testing.assert_close(out.float(), ref, atol=2e-3, rtol=2e-3)


def test_the_heuristic_split_and_a_non_power_of_two_block_is_refused():
    latent, meta = _cache([300], 16, 48)
    q = torch.randn(1, 4, 48)
    ref = latent_attention(q, latent, meta.attention_plan(16, None, 256), 0.2, 32)
    out = triton_mla_decode(q, latent, meta.block_tables, meta.seq_lens, 0.2, 32)
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=1e-4)
    bad = torch.zeros(4, 6, 1, 48)
    with pytest.raises(ValueError, match="block_size must be a power of two"):
        triton_mla_decode(q, bad, meta.block_tables, meta.seq_lens, 0.2, 32)


@pytest.mark.parametrize("q_lens", [[1, 1, 1], [1, 5, 12], [30, 2, 7]])
def test_absorbed_equals_decompressed_on_mixed_steps(q_lens):
    "Decodes and chunks in one step: the two ways of attending over latents agree."
    H, r, dr, dn, dv, bs = 3, 24, 8, 12, 20, 4
    lens = [40, 13, 30]
    latent, meta = _cache(lens, bs, r + dr, q_lens=q_lens)
    w = torch.randn(H * (dn + dv), r) / r**0.5
    q = torch.randn(sum(q_lens), H, dn + dr)
    plan = meta.attention_plan(bs, None, bucket_keys(latent))
    want = decompressed_attention(q, latent, plan, 0.25, w, dv)
    wv = w.view(H, dn + dv, r)
    qa = torch.cat([absorbed_query(q[..., :dn], wv[:, :dn]), q[..., dn:]], -1)
    got = unabsorb(latent_attention(qa, latent, plan, 0.25, r), wv[:, dn:])
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)


def test_which_chunks_decompress():
    v3 = MLAConfig(128, 7168, 512, 64, 128, 128)
    assert not decompress_cheaper(v3, 1, 1)  # a decode: absorbed
    assert decompress_cheaper(v3, 2, 2)  # a fresh prompt: decompressed
    assert not decompress_cheaper(v3, 4, 10_000)  # a verification over a long context: absorbed
    assert decompress_cheaper(v3, 200, 10**6) and not decompress_cheaper(v3, 150, 10**6)


@pytest.mark.parametrize(
    "v3, method, groups",
    [(True, None, 4), (True, None, 1), (False, "greedy", 1), (False, "group_limited_greedy", 4)],
)
def test_the_router_equals_transformers(v3, method, groups):
    import transformers
    from transformers.models.deepseek_v2.modeling_deepseek_v2 import DeepseekV2TopkRouter
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

    kw = dict(
        hidden_size=16, num_attention_heads=4, n_routed_experts=16, num_experts_per_tok=3,
        moe_intermediate_size=8, n_group=groups, topk_group=min(2, groups),
        routed_scaling_factor=2.5,
    )  # fmt: skip
    if v3:
        hf, Router = transformers.DeepseekV3Config(norm_topk_prob=True, **kw), DeepseekV3TopkRouter
    else:
        hf, Router = transformers.DeepseekV2Config(topk_method=method, **kw), DeepseekV2TopkRouter
    arch = "DeepseekV3ForCausalLM" if v3 else "DeepseekV2ForCausalLM"
    cfg = DeepseekMoEConfig.from_hf({**hf.to_dict(), "architectures": [arch]})
    router = Router(hf)
    with torch.no_grad():
        router.weight.normal_(0, 0.5)
        bias = getattr(router, "e_score_correction_bias", None)
        if bias is not None:
            bias.normal_(0, 0.5)
        x = torch.randn(64, 16)
        _, rw, rids = router(x)
        w, ids = deepseek_route(F.linear(x, router.weight), cfg, bias)
    o, ro = ids.argsort(-1), rids.argsort(-1)
    assert torch.equal(ids.gather(1, o), rids.gather(1, ro))
    torch.testing.assert_close(w.gather(1, o), rw.gather(1, ro))


def test_the_kernel_compiles_for_sm80_and_sm90():
    """The binaries the engine launches at DeepSeek's shape (r 512, dr 64) compile with no spill
    and within shared memory (Triton's cache makes a rerun fast; a first run takes a minute)."""
    from hetero_infer.attention.triton.resources import compile_report, report_problems

    specs = [s for a in ("sm_80", "sm_90") for s in mla_decode_specs(a, "bfloat16")]
    assert len(specs) == 8
    report = compile_report(specs, jobs=2)
    assert report_problems(report) == []
    assert all(r["regs"] <= 255 and r["blocks_per_sm"] >= 1 for r in report)
