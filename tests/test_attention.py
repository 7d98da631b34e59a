"""Sweeps for the torch paged-attention reference (hetero_infer.attention) against an fp64 contiguous reference."""
import math, random
import pytest, torch
import torch.nn.functional as F
from hypothesis import given, settings, strategies as st
from hetero_infer.attention import (AttentionMetadata, TorchAttentionBackend, get_attention_backend, gather_kv,
                                    paged_decode_attention, paged_prefill_attention, write_kv)

TOL = {torch.float32: 1e-4, torch.float16: 2e-3, torch.bfloat16: 8e-3}  # bf16: output rounding alone is up to 2^-8

def rel_err(out, ref): return ((out.double() - ref).abs().max() / ref.abs().max()).item()

def make_case(seq_lens, q_lens, bs, Hkv, g, D, dtype, seed=0, spare=3):
    """A NaN-filled cache with shuffled, non-contiguous block tables; each sequence's prefix (all but its last q_len
    tokens) already written. Returns the cache, the metadata, the step's q/k/v and the full contiguous K/V/Q."""
    gen = torch.Generator().manual_seed(seed)
    nblocks = [math.ceil(L / bs) for L in seq_lens]
    num_blocks = sum(nblocks) + spare
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    tables, i = [], 0
    for n in nblocks: tables.append(perm[i:i + n]); i += n
    kc = torch.full((num_blocks, bs, Hkv, D), float('nan'), dtype=dtype); vc = kc.clone()
    full = [(torch.randn(L, Hkv * g, D, generator=gen).to(dtype), torch.randn(L, Hkv, D, generator=gen).to(dtype),
             torch.randn(L, Hkv, D, generator=gen).to(dtype)) for L in seq_lens]
    for (q, k, v), L, n, bt in zip(full, seq_lens, q_lens, tables):
        pos = torch.arange(L - n)
        write_kv(k[:L - n], v[:L - n], kc, vc, torch.tensor(bt, dtype=torch.long)[pos // bs] * bs + pos % bs)
    meta = AttentionMetadata.build(seq_lens, q_lens, tables, bs)
    q = torch.cat([f[0][L - n:] for f, L, n in zip(full, seq_lens, q_lens)])
    k = torch.cat([f[1][L - n:] for f, L, n in zip(full, seq_lens, q_lens)])
    v = torch.cat([f[2][L - n:] for f, L, n in zip(full, seq_lens, q_lens)])
    return kc, vc, meta, q, k, v, full

def reference(full, seq_lens, q_lens, scale):
    "fp64 causal SDPA over each contiguous sequence, keeping the rows of its last q_len tokens."
    outs = []
    for (q, k, v), L, n in zip(full, seq_lens, q_lens):
        o = F.scaled_dot_product_attention(q.double().transpose(0, 1), k.double().transpose(0, 1), v.double().transpose(0, 1),
                                           is_causal=True, scale=scale, enable_gqa=True).transpose(0, 1)
        outs.append(o[L - n:])
    return torch.cat(outs)

def ragged_lens(bs): return [1, bs, bs + 1, 2 * bs, 3 * bs + 5, bs - 1]

@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("g", [1, 4, 8])
@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("bs", [8, 16, 32])
def test_decode_sweep(bs, D, g, dtype):
    lens = ragged_lens(bs)
    kc, vc, meta, q, k, v, full = make_case(lens, [1] * len(lens), bs, 2, g, D, dtype, seed=bs + D + g)
    write_kv(k, v, kc, vc, meta.slot_mapping)
    out = paged_decode_attention(q, kc, vc, meta.block_tables, meta.seq_lens, D ** -0.5)
    assert out.dtype == dtype and out.shape == q.shape
    assert rel_err(out, reference(full, lens, [1] * len(lens), D ** -0.5)) <= TOL[dtype]

@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("g", [1, 4, 8])
@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("bs", [8, 16, 32])
def test_prefill_chunk_over_cached_prefix(bs, D, g, dtype):
    "Chunks after cached prefixes (chunked prefill / prefix-cache hits) equal those rows of full causal attention."
    lens = ragged_lens(bs)
    qlens = [1, bs, 1, bs - 3, 2 * bs + 1, bs - 1]   # whole prompts, partial chunks, one-token chunks
    kc, vc, meta, q, k, v, full = make_case(lens, qlens, bs, 2, g, D, dtype, seed=bs * D * g)
    write_kv(k, v, kc, vc, meta.slot_mapping)
    out = paged_prefill_attention(q, kc, vc, meta.block_tables, meta.query_start_loc, meta.seq_lens, D ** -0.5)
    assert out.dtype == dtype and out.shape == q.shape
    assert rel_err(out, reference(full, lens, qlens, D ** -0.5)) <= TOL[dtype]

@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_forward_mixed_step(dtype):
    "Decodes first, then prefill chunks, through the backend: it writes the step's K/V and attends."
    bs, D, lens, qlens = 16, 64, [1, 17, 33, 40, 16, 9], [1, 1, 1, 8, 16, 9]
    kc, vc, meta, q, k, v, full = make_case(lens, qlens, bs, 2, 4, D, dtype, seed=7)
    assert meta.num_decodes == 3
    out = TorchAttentionBackend().forward(q, k, v, kc, vc, meta, D ** -0.5)
    assert rel_err(out, reference(full, lens, qlens, D ** -0.5)) <= TOL[dtype]
    flat = kc.view(-1, 2, D)
    assert torch.equal(flat[meta.slot_mapping], k)

@settings(max_examples=30, deadline=None)
@given(st.integers(0, 2 ** 16), st.sampled_from([8, 16]), st.sampled_from([1, 2, 4]),
       st.lists(st.tuples(st.integers(1, 50), st.integers(0, 50)), min_size=1, max_size=5))
def test_forward_random_batches(seed, bs, g, specs):
    "Random ragged batches: any context, any chunk size, decodes sorted first."
    specs = sorted(((L, 1 + c % L) for L, c in specs), key=lambda s: s[1] != 1)
    lens, qlens = [s[0] for s in specs], [s[1] for s in specs]
    kc, vc, meta, q, k, v, full = make_case(lens, qlens, bs, 2, g, 32, torch.float32, seed=seed)
    out = get_attention_backend("torch").forward(q, k, v, kc, vc, meta, 0.3)
    assert rel_err(out, reference(full, lens, qlens, 0.3)) <= 1e-4

def test_nothing_outside_the_context_is_read():
    "NaN or garbage in every unused slot gives bit-identical outputs with no NaN."
    bs, D, lens, qlens = 8, 64, [3, 8, 9, 20], [1, 1, 5, 20]
    kc, vc, meta, q, k, v, full = make_case(lens, qlens, bs, 2, 4, D, torch.float32, seed=3, spare=4)
    be = TorchAttentionBackend()
    out_nan = be.forward(q, k, v, kc, vc, meta, D ** -0.5)
    assert not out_nan.isnan().any()
    kc2, vc2 = kc.nan_to_num(1e4), vc.nan_to_num(-1e4)   # same contexts, garbage instead of NaN elsewhere
    assert torch.equal(be.forward(q, k, v, kc2, vc2, meta, D ** -0.5), out_nan)

def test_write_kv_roundtrip_and_padding():
    bs, kc = 4, torch.zeros(5, 4, 2, 3)
    vc = kc.clone()
    k, slots = torch.randn(6, 2, 3), torch.tensor([19, 0, -1, 7, 8, -1])
    write_kv(k, k * 2, kc, vc, slots)
    for i, s in enumerate(slots.tolist()):
        if s >= 0: assert torch.equal(kc[s // bs, s % bs], k[i]) and torch.equal(vc[s // bs, s % bs], 2 * k[i])
    assert int((kc.abs().sum((-1, -2)) > 0).sum()) == 4

def test_gather_kv_matches_block_tables():
    c = torch.arange(40.).view(10, 4, 1, 1)
    got = gather_kv(c, torch.tensor([[9, 2, 0], [4, 0, 0]], dtype=torch.int32), 9)[:, 0, :, 0]   # (S, L)
    assert got[0].tolist() == [36, 37, 38, 39, 8, 9, 10, 11, 0] and got[1, :4].tolist() == [16, 17, 18, 19]

def test_metadata_build():
    m = AttentionMetadata.build([1, 5, 9], [1, 1, 4], [[3], [2, 7], [0, 4, 1]], 4)
    assert m.slot_mapping.tolist() == [12, 28, 17, 18, 19, 4]  # positions 0 | 4 | 5..8
    assert m.slot_mapping.dtype == torch.int64 and m.seq_lens.dtype == m.query_start_loc.dtype == torch.int32
    assert m.query_start_loc.tolist() == [0, 1, 2, 6] and m.block_tables.tolist() == [[3, 0, 0], [2, 7, 0], [0, 4, 1]]
    assert (m.num_decodes, m.max_query_len, m.max_seq_len) == (2, 4, 9)
    with pytest.raises(ValueError, match="query_lens"): AttentionMetadata.build([3], [4], [[0]], 4)

def test_other_head_dims_and_mqa():
    "The reference has no head_dim restriction; MQA (one KV head) works."
    for D in (32, 80):
        lens, qlens = [5, 13], [1, 6]
        kc, vc, meta, q, k, v, full = make_case(lens, qlens, 8, 1, 6, D, torch.float32, seed=D)
        out = TorchAttentionBackend().forward(q, k, v, kc, vc, meta, D ** -0.5)
        assert rel_err(out, reference(full, lens, qlens, D ** -0.5)) <= 1e-4

def test_backend_selection():
    assert get_attention_backend(device="cpu").name == "torch"
    assert get_attention_backend("torch", device="cuda").name == "torch"
    with pytest.raises(ValueError, match="name must be one of"): get_attention_backend("flash")
    try: import hetero_infer.kernels as K; has_kernels = hasattr(K, "TritonAttentionBackend")
    except ImportError: has_kernels = False
    if has_kernels: assert get_attention_backend("triton", device="cpu").name == "triton"
    else:
        with pytest.raises(RuntimeError, match="'triton' is unavailable"): get_attention_backend("triton", device="cpu")

def test_import_does_not_import_triton():
    import subprocess, sys
    code = "import sys, hetero_infer.attention; assert 'triton' not in sys.modules"
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0
