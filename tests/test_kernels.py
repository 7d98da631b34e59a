"""Sweeps for the Triton paged-attention kernels (hetero_infer.attention.triton) against an fp64
reference and the torch backend.

On a machine without a GPU the kernels run in Triton's interpreter (conftest sets
TRITON_INTERPRET=1), which costs ~0.1-0.5 s a call, so the dtype x head_dim x GQA x block-size
sweeps use a pairwise-covering subset of the grid (every pair of values of any two axes appears at
least once: 9 of 36 cases per kernel). On a GPU they run the full product, bf16 included."""

import itertools
import math
import os
import subprocess
import sys
import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings, strategies as st
from hetero_infer.attention.backend import (
    AttentionMetadata,
    TorchAttentionBackend,
    get_attention_backend,
)
from hetero_infer.attention.torch_ref import write_kv
from hetero_infer.attention.triton.backend import TritonAttentionBackend, decode_bytes
from hetero_infer.attention.triton.decode import (
    num_decode_splits,
    triton_paged_decode_attention,
    triton_write_kv,
)
from hetero_infer.attention.triton.prefill import triton_paged_prefill_attention

DEV = "cuda" if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1" else "cpu"
TOL = {torch.float32: 1e-4, torch.float16: 2e-3, torch.bfloat16: 1e-2}
BLOCK_SIZES, HEAD_DIMS, GROUPS = [8, 16, 32], [64, 128], [1, 4, 8]
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if DEV == "cuda" else [])


def pairwise(shift=0):
    """9 (bs, D, g, dtype) cases covering every pair of values of any two axes (an L9 orthogonal
    array, columns folded)."""
    return [
        (
            BLOCK_SIZES[a],
            HEAD_DIMS[((a + b + shift) % 3) % 2],
            GROUPS[b],
            DTYPES[((a + 2 * b + shift) % 3) % 2],
        )
        for a in range(3)
        for b in range(3)
    ]


GRID = list(itertools.product(BLOCK_SIZES, HEAD_DIMS, GROUPS, DTYPES)) if DEV == "cuda" else None


def rel_err(out, ref):
    return ((out.double() - ref.double()).abs().max() / ref.double().abs().max()).item()


def make_case(seq_lens, q_lens, bs, Hkv, g, D, dtype, seed=0, spare=3):
    """NaN-filled caches with shuffled block tables and each sequence's prefix (all but its last
    q_len tokens) written. Returns caches, metadata, the step's q/k/v and each sequence's full
    contiguous (q, k, v) for the reference."""
    gen = torch.Generator().manual_seed(seed)
    nblocks = [math.ceil(L / bs) for L in seq_lens]
    perm = torch.randperm(sum(nblocks) + spare, generator=gen).tolist()
    tables = [perm[sum(nblocks[:i]) : sum(nblocks[: i + 1])] for i in range(len(nblocks))]
    kc = torch.full((len(perm), bs, Hkv, D), float("nan"), dtype=dtype)
    vc = kc.clone()
    full = [
        tuple(torch.randn(L, H, D, generator=gen).to(dtype) for H in (Hkv * g, Hkv, Hkv))
        for L in seq_lens
    ]
    for (q, k, v), L, n, bt in zip(full, seq_lens, q_lens, tables):
        pos = torch.arange(L - n)
        write_kv(
            k[: L - n],
            v[: L - n],
            kc,
            vc,
            torch.tensor(bt, dtype=torch.long)[pos // bs] * bs + pos % bs,
        )
    meta = AttentionMetadata.build(seq_lens, q_lens, tables, bs, device=DEV)
    step = [
        torch.cat([f[i][L - n :] for f, L, n in zip(full, seq_lens, q_lens)]).to(DEV)
        for i in range(3)
    ]
    return (kc.to(DEV), vc.to(DEV), meta, *step, full)


def reference(full, seq_lens, q_lens, scale):
    "fp64 causal SDPA over each contiguous sequence, keeping the rows of its last q_len tokens."
    outs = []
    for (q, k, v), L, n in zip(full, seq_lens, q_lens):
        t = lambda x: x.double().transpose(0, 1)
        o = F.scaled_dot_product_attention(
            t(q), t(k), t(v), is_causal=True, scale=scale, enable_gqa=True
        ).transpose(0, 1)
        outs.append(o[L - n :])
    return torch.cat(outs).to(DEV)


def ragged(bs):
    return [1, bs, bs + 1, 2 * bs, 3 * bs + 5, bs - 1]


@pytest.mark.parametrize("bs,D,g,dtype", GRID or pairwise(0))
def test_decode_sweep(bs, D, g, dtype):
    lens = ragged(bs)
    kc, vc, meta, q, k, v, full = make_case(
        lens, [1] * len(lens), bs, 2, g, D, dtype, seed=bs + D + g
    )
    triton_write_kv(k, v, kc, vc, meta.slot_mapping)
    ref = reference(full, lens, [1] * len(lens), D**-0.5)
    for n in (None, 1, 3):
        out = triton_paged_decode_attention(
            q, kc, vc, meta.block_tables, meta.seq_lens, D**-0.5, num_splits=n
        )
        assert out.dtype == dtype and out.shape == q.shape and out.isfinite().all()
        assert rel_err(out, ref) <= TOL[dtype], (n, rel_err(out, ref))


@pytest.mark.parametrize("bs,D,g,dtype", GRID or pairwise(1))
def test_prefill_sweep(bs, D, g, dtype):
    """Chunks over cached prefixes: a 1-token context, whole prompts, short chunks, and a 65-token
    chunk (two query tiles)."""
    lens, qlens = [1, bs, bs + 1, 2 * bs, 3 * bs + 5, 70], [1, bs, 3, 2 * bs, bs + 2, 65]
    kc, vc, meta, q, k, v, full = make_case(lens, qlens, bs, 2, g, D, dtype, seed=bs * D * g)
    triton_write_kv(k, v, kc, vc, meta.slot_mapping)
    out = triton_paged_prefill_attention(
        q, kc, vc, meta.block_tables, meta.query_start_loc, meta.seq_lens, D**-0.5
    )
    assert out.dtype == dtype and out.shape == q.shape and out.isfinite().all()
    assert rel_err(out, reference(full, lens, qlens, D**-0.5)) <= TOL[dtype]


def test_split_k_equals_no_split():
    """Pieces that end mid-context, pieces past the end of short contexts, and more pieces than
    tiles all merge exactly."""
    lens = [1, 63, 64, 65, 200, 333]
    kc, vc, meta, q, k, v, full = make_case(
        lens, [1] * len(lens), 16, 2, 4, 64, torch.float32, seed=7
    )
    triton_write_kv(k, v, kc, vc, meta.slot_mapping)
    args = (q, kc, vc, meta.block_tables, meta.seq_lens, 64**-0.5)
    one = triton_paged_decode_attention(*args, num_splits=1)
    assert rel_err(one, reference(full, lens, [1] * len(lens), 64**-0.5)) <= 1e-4
    for n in (2, 3, 16):
        assert rel_err(triton_paged_decode_attention(*args, num_splits=n), one) <= 1e-5, n


def test_mixed_step_matches_torch_backend():
    """forward: decodes then prefill chunks, q/k/v as strided views of one fused projection, against
    both oracles."""
    lens, qlens = [5, 16, 17, 40, 24, 1], [1, 1, 1, 12, 24, 1]
    kc, vc, meta, q, k, v, full = make_case(lens, qlens, 16, 2, 4, 64, torch.float32, seed=11)
    meta.num_decodes = 3  # the last 1-token sequence goes down the prefill path
    qkv = torch.cat([q, k, v], 1)  # (T, Hq + 2 Hkv, D) as a fused projection makes it
    q, k, v = qkv[:, :8], qkv[:, 8:10], qkv[:, 10:]
    kc2, vc2 = kc.clone(), vc.clone()
    tb = get_attention_backend("triton", device=DEV)
    assert isinstance(tb, TritonAttentionBackend) and tb.name == "triton"
    out = tb.forward(q, k, v, kc, vc, meta, 64**-0.5)
    ref = TorchAttentionBackend().forward(q, k, v, kc2, vc2, meta, 64**-0.5)
    assert torch.equal(kc.nan_to_num(0), kc2.nan_to_num(0)) and torch.equal(
        vc.nan_to_num(0), vc2.nan_to_num(0)
    )
    assert rel_err(out, ref) <= 1e-5
    assert rel_err(out, reference(full, lens, qlens, 64**-0.5)) <= 1e-4


@settings(max_examples=10, deadline=None)
@given(
    seed=st.integers(0, 2**16),
    bs=st.sampled_from(BLOCK_SIZES),
    g=st.sampled_from(GROUPS),
    specs=st.lists(st.tuples(st.integers(1, 80), st.integers(1, 80)), min_size=1, max_size=4),
)
def test_forward_random_batches(seed, bs, g, specs):
    """Random steps (decodes first, then chunks) through the Triton backend against the fp64
    reference."""
    specs = sorted(((L, min(n, L)) for L, n in specs), key=lambda s: s[1] != 1)
    lens, qlens = [s[0] for s in specs], [s[1] for s in specs]
    kc, vc, meta, q, k, v, full = make_case(lens, qlens, bs, 1, g, 64, torch.float32, seed=seed)
    out = TritonAttentionBackend().forward(q, k, v, kc, vc, meta, 0.125)
    assert out.isfinite().all() and rel_err(out, reference(full, lens, qlens, 0.125)) <= 1e-4


def test_write_kv_padding_and_untouched_slots():
    kc = torch.full((4, 8, 2, 64), float("nan"))
    vc = kc.clone()
    kc, vc = kc.to(DEV), vc.to(DEV)
    k, v = torch.randn(3, 2, 64, device=DEV), torch.randn(3, 2, 64, device=DEV)
    triton_write_kv(k, v, kc, vc, torch.tensor([13, -1, 0], device=DEV))
    assert torch.equal(kc[1, 5], k[0]) and torch.equal(vc[0, 0], v[2])
    assert (
        kc.isnan().sum() == kc.numel() - 2 * 128 and vc.isnan().sum() == vc.numel() - 2 * 128
    )  # padding skipped
    triton_write_kv(
        k[:0], v[:0], kc, vc, torch.tensor([], dtype=torch.long, device=DEV)
    )  # empty step: no-op


@pytest.mark.parametrize(
    "D,g,bs", [(8, 2, 16), (32, 2, 1), (80, 3, 16), (96, 1, 128), (112, 20, 8), (256, 2, 2)]
)
def test_any_head_dim(D, g, bs):
    """Heads that are not powers of two (padded to the next one with a mask), tiny and wide heads, >
    16 query heads per KV head."""
    lens, qlens = [1, 20, 37], [1, 1, 9]
    kc, vc, meta, q, k, v, full = make_case(lens, qlens, bs, 2, g, D, torch.float32, seed=D)
    out = TritonAttentionBackend().forward(q, k, v, kc, vc, meta, D**-0.5)
    assert out.isfinite().all() and rel_err(out, reference(full, lens, qlens, D**-0.5)) <= 1e-4
    split = triton_paged_decode_attention(
        q[:2], kc, vc, meta.block_tables[:2], meta.seq_lens[:2], D**-0.5, num_splits=2
    )
    assert rel_err(split, out[:2]) <= 1e-5


def reference_window(full, seq_lens, q_lens, scale, window):
    """fp64 SDPA over each contiguous sequence with transformers' sliding-window mask: query p sees
    keys (p - window, p]."""
    outs = []
    for (q, k, v), L, n in zip(full, seq_lens, q_lens):
        t = lambda x: x.double().transpose(0, 1)
        p = torch.arange(L)
        mask = (p[None, :] <= p[:, None]) & (p[None, :] > p[:, None] - window)
        o = F.scaled_dot_product_attention(
            t(q), t(k), t(v), attn_mask=mask, scale=scale, enable_gqa=True
        ).transpose(0, 1)
        outs.append(o[L - n :])
    return torch.cat(outs).to(DEV)


@pytest.mark.parametrize(
    "window,bs,g", [(1, 8, 4), (6, 16, 1), (33, 4, 8), (64, 16, 2), (200, 8, 4)]
)
def test_sliding_window(window, bs, g):
    """Decodes (with and without split-K) and prefill chunks over cached prefixes, windows shorter
    and longer than a tile."""
    lens, qlens = [1, 10, 70, 130, 40, 100], [1, 1, 1, 1, 40, 65]
    kc, vc, meta, q, k, v, full = make_case(lens, qlens, bs, 2, g, 64, torch.float32, seed=window)
    meta.num_decodes = 4
    out = TritonAttentionBackend().forward(q, k, v, kc, vc, meta, 0.125, window=window)
    ref = reference_window(full, lens, qlens, 0.125, window)
    assert out.isfinite().all() and rel_err(out, ref) <= 1e-4
    split = triton_paged_decode_attention(
        q[:4], kc, vc, meta.block_tables[:4], meta.seq_lens[:4], 0.125, num_splits=3, window=window
    )
    assert rel_err(split, ref[:4]) <= 1e-4


@pytest.mark.parametrize("D", [0, 320, 512])
def test_unsupported_head_dims_raise(D):
    q, c = torch.zeros(1, 2, D), torch.zeros(1, 16, 1, D)
    bt, sl, qsl = (
        torch.zeros(1, 1, dtype=torch.int32),
        torch.ones(1, dtype=torch.int32),
        torch.tensor([0, 1], dtype=torch.int32),
    )
    with pytest.raises(ValueError, match=r"head_dim must be in \[1, 256\]"):
        triton_paged_decode_attention(q, c, c, bt, sl, 1.0)
    with pytest.raises(ValueError, match=r"head_dim must be in \[1, 256\]"):
        triton_paged_prefill_attention(q, c, c, bt, qsl, sl, 1.0)


def test_heads_not_a_multiple_raise():
    with pytest.raises(ValueError, match="multiple of num KV heads"):
        triton_paged_decode_attention(
            torch.zeros(1, 3, 64),
            torch.zeros(1, 16, 2, 64),
            torch.zeros(1, 16, 2, 64),
            torch.zeros(1, 1, dtype=torch.int32),
            torch.ones(1, dtype=torch.int32),
            1.0,
        )


@settings(max_examples=200, deadline=None)
@given(
    S=st.integers(1, 512),
    Hkv=st.integers(1, 16),
    ctx=st.integers(1, 1 << 17),
    sms=st.integers(1, 200),
)
def test_num_decode_splits_bounds(S, Hkv, ctx, sms):
    n = num_decode_splits(S, Hkv, ctx, sms)
    assert 1 <= n <= 32
    if S * Hkv >= sms:
        assert n == 1  # the batch already fills the GPU
    if n > 1:
        assert (
            ctx // n >= 256 and S * Hkv * (n - 1) < 2 * sms
        )  # pieces stay long; no more than ~2 programs/SM


def test_decode_bytes():
    assert decode_bytes(64, 4096, 32, 4, 128) == 2 * 64 * 4096 * 4 * 128 * 2 + 2 * 64 * 32 * 128 * 2


def test_import_needs_no_gpu_and_no_interpreter():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    r = subprocess.run(
        [
            sys.executable,
            "-c",
            "import hetero_infer.attention.triton.backend as k; "
            "print(k.TritonAttentionBackend.name)",
        ],
        env=env,
        capture_output=True,
        text=True,
    )
    assert r.returncode == 0 and r.stdout.strip() == "triton", r.stderr


FP8 = torch.float8_e4m3fn


@pytest.mark.parametrize("dtype,D,g", [(torch.float32, 64, 4), (torch.float16, 80, 1)])
def test_fp8_cache_matches_torch_backend(dtype, D, g):
    """An fp8 (e4m3) cache through the Triton backend: the write kernel stores the same bytes as the
    torch write (saturated at ±448, rounded to nearest), decode and prefill read it as the torch
    backend does; both within e4m3's rounding of the float cache's output."""
    lens, qlens = [5, 16, 17, 40, 24], [1, 1, 1, 12, 24]
    kc, vc, meta, q, k, v, full = make_case(lens, qlens, 16, 2, g, D, dtype, seed=5)
    ref = TorchAttentionBackend().forward(q, k, v, kc.clone(), vc.clone(), meta, D**-0.5)
    kc8, vc8 = kc.to(FP8), vc.to(FP8)
    kc8b, vc8b = kc8.clone(), vc8.clone()
    out8 = TritonAttentionBackend().forward(q, k, v, kc8, vc8, meta, D**-0.5)
    ref8 = TorchAttentionBackend().forward(q, k, v, kc8b, vc8b, meta, D**-0.5)
    assert torch.equal(kc8.view(torch.uint8), kc8b.view(torch.uint8))
    assert torch.equal(vc8.view(torch.uint8), vc8b.view(torch.uint8))
    assert rel_err(out8, ref8) <= TOL[dtype]
    assert rel_err(out8, ref) <= 0.08  # e4m3: 3 mantissa bits on K and V


def test_fp8_write_rounds_like_torch_everywhere():
    "Values across e4m3's range (subnormals, ties of random data, past ±448) round as torch does."
    x = torch.cat([torch.randn(4096) * s for s in (1e-3, 1e-2, 1.0, 30.0, 300.0)]).view(-1, 1, 256)
    kc = torch.zeros(x.shape[0], 1, 1, 256, dtype=FP8, device=DEV)  # one 256-wide row per slot
    vc = kc.clone()
    slots = torch.arange(x.shape[0], device=DEV)
    triton_write_kv(x.to(DEV), -x.to(DEV), kc, vc, slots)
    want = x.clamp(-448, 448).to(FP8).view(torch.uint8)
    assert torch.equal(kc.view(-1, 1, 256).cpu().view(torch.uint8), want)
    assert torch.equal(vc.view(-1, 1, 256).cpu().float(), -want.view(FP8).float())


def test_fp8_cache_needs_sm89_on_cuda(monkeypatch):
    import hetero_infer.attention.triton.backend as kernels

    monkeypatch.setattr(kernels, "_capability", lambda device: (8, 0))
    why = kernels.triton_unsupported(64, torch.float16, "cuda", FP8)
    assert "kv_cache_dtype=fp8 needs compute capability 8.9" in why
    monkeypatch.setattr(kernels, "_capability", lambda device: (9, 0))
    assert kernels.triton_unsupported(64, torch.bfloat16, "cuda", FP8) is None
    why = kernels.triton_unsupported(64, torch.float32, "cuda", FP8)  # fp32 + fp8: its tiles spill
    assert "kv_cache_dtype=fp8 with dtype=float32" in why
