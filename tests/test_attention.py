"""Sweeps for the torch paged-attention reference (hetero_infer.attention.backend) against an fp64
contiguous reference."""

import math
import os
import shutil
import pytest
import torch
from hypothesis import given, settings, strategies as st
from hetero_infer.attention.backend import (
    AttentionMetadata,
    AttentionBackend,
    TorchAttentionBackend,
    get_attention_backend,
)
from hetero_infer.attention.torch_ref import (
    attention_buckets,
    gather_kv,
    paged_decode_attention,
    paged_prefill_attention,
    plan_attention,
    write_kv,
)

TOL = {
    torch.float32: 1e-4,
    torch.float16: 2e-3,
    torch.bfloat16: 8e-3,
}  # bf16: output rounding alone is up to 2^-8


def rel_err(out, ref):
    return ((out.double() - ref).abs().max() / ref.abs().max()).item()


def make_case(seq_lens, q_lens, bs, Hkv, g, D, dtype, seed=0, spare=3):
    """A NaN-filled cache with shuffled, non-contiguous block tables; each sequence's prefix (all
    but its last q_len tokens) already written. Returns the cache, the metadata, the step's q/k/v
    and the full contiguous K/V/Q."""
    gen = torch.Generator().manual_seed(seed)
    nblocks = [math.ceil(L / bs) for L in seq_lens]
    num_blocks = sum(nblocks) + spare
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    tables, i = [], 0
    for n in nblocks:
        tables.append(perm[i : i + n])
        i += n
    kc = torch.full((num_blocks, bs, Hkv, D), float("nan"), dtype=dtype)
    vc = kc.clone()
    full = [
        (
            torch.randn(L, Hkv * g, D, generator=gen).to(dtype),
            torch.randn(L, Hkv, D, generator=gen).to(dtype),
            torch.randn(L, Hkv, D, generator=gen).to(dtype),
        )
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
    meta = AttentionMetadata.build(seq_lens, q_lens, tables, bs)
    q = torch.cat([f[0][L - n :] for f, L, n in zip(full, seq_lens, q_lens)])
    k = torch.cat([f[1][L - n :] for f, L, n in zip(full, seq_lens, q_lens)])
    v = torch.cat([f[2][L - n :] for f, L, n in zip(full, seq_lens, q_lens)])
    return kc, vc, meta, q, k, v, full


def reference(full, seq_lens, q_lens, scale, window=None):
    """fp64 dense masked softmax over each contiguous sequence (causal, or the last `window`
    positions), keeping its last q_len rows."""
    outs = []
    for (q, k, v), L, n in zip(full, seq_lens, q_lens):
        q, k, v = q.double(), k.double(), v.double()
        k, v = (
            k.repeat_interleave(q.shape[1] // k.shape[1], 1),
            v.repeat_interleave(q.shape[1] // v.shape[1], 1),
        )  # (L, Hq, D)
        s = torch.einsum("qhd,khd->hqk", q, k) * scale  # (Hq, L, L)
        i, j = torch.arange(L)[:, None], torch.arange(L)[None]
        hide = (j > i) | (
            (j <= i - window) if window is not None else torch.zeros(L, L, dtype=torch.bool)
        )
        outs.append(
            torch.einsum("hqk,khd->qhd", s.masked_fill(hide, float("-inf")).softmax(-1), v)[L - n :]
        )
    return torch.cat(outs)


def ragged_lens(bs):
    return [1, bs, bs + 1, 2 * bs, 3 * bs + 5, bs - 1]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("g", [1, 4, 8])
@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("bs", [8, 16, 32])
def test_decode_sweep(bs, D, g, dtype):
    lens = ragged_lens(bs)
    kc, vc, meta, q, k, v, full = make_case(
        lens, [1] * len(lens), bs, 2, g, D, dtype, seed=bs + D + g
    )
    write_kv(k, v, kc, vc, meta.slot_mapping)
    out = paged_decode_attention(q, kc, vc, meta.block_tables, meta.seq_lens, D**-0.5)
    assert out.dtype == dtype and out.shape == q.shape
    assert rel_err(out, reference(full, lens, [1] * len(lens), D**-0.5)) <= TOL[dtype]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("g", [1, 4, 8])
@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("bs", [8, 16, 32])
def test_prefill_chunk_over_cached_prefix(bs, D, g, dtype):
    """Chunks after cached prefixes (chunked prefill / prefix-cache hits) equal those rows of full
    causal attention."""
    lens = ragged_lens(bs)
    qlens = [
        1,
        bs,
        1,
        bs - 3,
        2 * bs + 1,
        bs - 1,
    ]  # whole prompts, partial chunks, one-token chunks
    kc, vc, meta, q, k, v, full = make_case(lens, qlens, bs, 2, g, D, dtype, seed=bs * D * g)
    write_kv(k, v, kc, vc, meta.slot_mapping)
    out = paged_prefill_attention(
        q, kc, vc, meta.block_tables, meta.query_start_loc, meta.seq_lens, D**-0.5
    )
    assert out.dtype == dtype and out.shape == q.shape
    assert rel_err(out, reference(full, lens, qlens, D**-0.5)) <= TOL[dtype]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_forward_mixed_step(dtype):
    "Decodes first, then prefill chunks, through the backend: it writes the step's K/V and attends."
    bs, D, lens, qlens = 16, 64, [1, 17, 33, 40, 16, 9], [1, 1, 1, 8, 16, 9]
    kc, vc, meta, q, k, v, full = make_case(lens, qlens, bs, 2, 4, D, dtype, seed=7)
    assert meta.num_decodes == 3
    out = TorchAttentionBackend().forward(q, k, v, kc, vc, meta, D**-0.5)
    assert rel_err(out, reference(full, lens, qlens, D**-0.5)) <= TOL[dtype]
    flat = kc.view(-1, 2, D)
    assert torch.equal(flat[meta.slot_mapping], k)


@settings(max_examples=30, deadline=None)
@given(
    st.integers(0, 2**16),
    st.sampled_from([8, 16]),
    st.sampled_from([1, 2, 4]),
    st.lists(st.tuples(st.integers(1, 50), st.integers(0, 50)), min_size=1, max_size=5),
)
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
    kc, vc, meta, q, k, v, full = make_case(
        lens, qlens, bs, 2, 4, D, torch.float32, seed=3, spare=4
    )
    be = TorchAttentionBackend()
    out_nan = be.forward(q, k, v, kc, vc, meta, D**-0.5)
    assert not out_nan.isnan().any()
    kc2, vc2 = (
        kc.nan_to_num(1e4),
        vc.nan_to_num(-1e4),
    )  # same contexts, garbage instead of NaN elsewhere
    assert torch.equal(be.forward(q, k, v, kc2, vc2, meta, D**-0.5), out_nan)


def test_write_kv_roundtrip_and_padding():
    bs, kc = 4, torch.zeros(5, 4, 2, 3)
    vc = kc.clone()
    k, slots = torch.randn(6, 2, 3), torch.tensor([19, 0, -1, 7, 8, -1])
    write_kv(k, k * 2, kc, vc, slots)
    for i, s in enumerate(slots.tolist()):
        if s >= 0:
            assert torch.equal(kc[s // bs, s % bs], k[i]) and torch.equal(
                vc[s // bs, s % bs], 2 * k[i]
            )
    assert int((kc.abs().sum((-1, -2)) > 0).sum()) == 4


def test_gather_kv_matches_block_tables():
    c = torch.arange(40.0).view(10, 4, 1, 1)
    got = gather_kv(c, torch.tensor([[9, 2, 0], [4, 0, 0]], dtype=torch.int32), 9)[
        :, 0, :, 0
    ]  # (S, L)
    assert got[0].tolist() == [36, 37, 38, 39, 8, 9, 10, 11, 0] and got[1, :4].tolist() == [
        16,
        17,
        18,
        19,
    ]


def test_metadata_build():
    m = AttentionMetadata.build([1, 5, 9], [1, 1, 4], [[3], [2, 7], [0, 4, 1]], 4)
    assert m.slot_mapping.tolist() == [12, 28, 17, 18, 19, 4]  # positions 0 | 4 | 5..8
    assert (
        m.slot_mapping.dtype == torch.int64
        and m.seq_lens.dtype == m.query_start_loc.dtype == torch.int32
    )
    assert m.query_start_loc.tolist() == [0, 1, 2, 6] and m.block_tables.tolist() == [
        [3, 0, 0],
        [2, 7, 0],
        [0, 4, 1],
    ]
    assert (m.num_decodes, m.max_query_len, m.max_seq_len) == (2, 4, 9)
    with pytest.raises(ValueError, match="query_lens"):
        AttentionMetadata.build([3], [4], [[0]], 4)


def test_other_head_dims_and_mqa():
    "The reference has no head_dim restriction; MQA (one KV head) works."
    for D in (32, 80):
        lens, qlens = [5, 13], [1, 6]
        kc, vc, meta, q, k, v, full = make_case(lens, qlens, 8, 1, 6, D, torch.float32, seed=D)
        out = TorchAttentionBackend().forward(q, k, v, kc, vc, meta, D**-0.5)
        assert rel_err(out, reference(full, lens, qlens, D**-0.5)) <= 1e-4


def test_backend_selection():
    assert get_attention_backend(device="cpu").name == "cpp"  # the torch path where no compiler
    assert get_attention_backend("torch", device="cuda").name == "torch"
    with pytest.raises(ValueError, match="name must be one of"):
        get_attention_backend("flash")
    try:
        import hetero_infer.attention.triton.backend as K

        has_kernels = hasattr(K, "TritonAttentionBackend")
    except ImportError:
        has_kernels = False
    if has_kernels:
        assert get_attention_backend("triton", device="cpu").name == "triton"
    else:
        with pytest.raises(RuntimeError, match="'triton' is unavailable"):
            get_attention_backend("triton", device="cpu")


def test_import_does_not_import_triton():
    import subprocess
    import sys

    code = "import sys, hetero_infer.attention.backend; assert 'triton' not in sys.modules"
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0


# --- sliding windows, any head size, bounded padding -------------------------------------------


@pytest.mark.parametrize("window", [1, 3, 8, 17, 100])
@pytest.mark.parametrize("D", [80, 96, 112])
def test_window_and_head_sizes_against_dense_masked_softmax(window, D):
    """Ragged decodes and chunks over cached prefixes, non-power-of-two head sizes, windows shorter
    and longer than contexts."""
    bs, lens, qlens = 8, [1, 9, 30, 17, 41, 8], [1, 1, 1, 5, 13, 8]
    kc, vc, meta, q, k, v, full = make_case(
        lens, qlens, bs, 2, 3, D, torch.float32, seed=window * D
    )
    out = TorchAttentionBackend().forward(q, k, v, kc, vc, meta, D**-0.5, window=window)
    assert not out.isnan().any()
    assert rel_err(out, reference(full, lens, qlens, D**-0.5, window)) <= 1e-4
    base = AttentionBackend.forward(
        TorchAttentionBackend(), q, k, v, kc, vc, meta, D**-0.5, window=window
    )  # decode/prefill split
    assert rel_err(base, reference(full, lens, qlens, D**-0.5, window)) <= 1e-4


@settings(max_examples=40, deadline=None)
@given(
    st.integers(0, 2**16),
    st.sampled_from([4, 16]),
    st.sampled_from([1, 2, 4]),
    st.sampled_from([None, 1, 2, 5, 16, 64]),
    st.sampled_from([16, 40, 64]),
    st.lists(st.tuples(st.integers(1, 70), st.integers(0, 70)), min_size=1, max_size=7),
)
def test_random_batches_with_windows(seed, bs, g, window, D, specs):
    specs = sorted(((L, 1 + c % L) for L, c in specs), key=lambda s: s[1] != 1)
    lens, qlens = [s[0] for s in specs], [s[1] for s in specs]
    kc, vc, meta, q, k, v, full = make_case(lens, qlens, bs, 2, g, D, torch.float32, seed=seed)
    out = get_attention_backend("torch").forward(q, k, v, kc, vc, meta, 0.3, window=window)
    assert rel_err(out, reference(full, lens, qlens, 0.3, window)) <= 1e-4


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_window_low_precision(dtype):
    bs, D, lens, qlens = 16, 64, [1, 17, 33, 40, 16, 9], [1, 1, 1, 8, 16, 9]
    kc, vc, meta, q, k, v, full = make_case(lens, qlens, bs, 2, 4, D, dtype, seed=11)
    out = TorchAttentionBackend().forward(q, k, v, kc, vc, meta, D**-0.5, window=7)
    assert (
        out.dtype == dtype and rel_err(out, reference(full, lens, qlens, D**-0.5, 7)) <= TOL[dtype]
    )


def test_window_reads_nothing_before_the_window():
    "With a window, keys before it are never gathered: NaN there changes nothing."
    bs, D, lens, qlens = 4, 32, [20, 13], [1, 3]
    kc, vc, meta, q, k, v, full = make_case(lens, qlens, bs, 2, 2, D, torch.float32, seed=5)
    write_kv(k, v, kc, vc, meta.slot_mapping)
    ref = paged_prefill_attention(
        q, kc, vc, meta.block_tables, meta.query_start_loc, meta.seq_lens, D**-0.5, window=4
    )
    bt = meta.block_tables.long()
    kc[bt[0, :3]] = float("nan")
    vc[bt[0, :3]] = float(
        "nan"
    )  # positions 0..11 of the 20-token sequence: before its window 16..19
    kc[bt[1, :1]] = float("nan")
    vc[bt[1, :1]] = float("nan")  # positions 0..3 of the 13-token one: its queries 10..12 see 7..12
    out = paged_prefill_attention(
        q, kc, vc, meta.block_tables, meta.query_start_loc, meta.seq_lens, D**-0.5, window=4
    )
    assert torch.equal(out, ref)


def test_decode_and_prefill_free_functions_take_window():
    bs, D, lens = 8, 32, [3, 12, 25]
    kc, vc, meta, q, k, v, full = make_case(lens, [1, 1, 1], bs, 2, 2, D, torch.float32, seed=2)
    write_kv(k, v, kc, vc, meta.slot_mapping)
    d = paged_decode_attention(q, kc, vc, meta.block_tables, meta.seq_lens, D**-0.5, window=5)
    p = paged_prefill_attention(
        q, kc, vc, meta.block_tables, meta.query_start_loc, meta.seq_lens, D**-0.5, window=5
    )
    assert torch.equal(d, p) and rel_err(d, reference(full, lens, [1, 1, 1], D**-0.5, 5)) <= 1e-4


@pytest.mark.parametrize(
    "q_lens,keys",
    [
        ([1] * 64, [16 + 15 * i for i in range(64)]),
        ([1900] + [8] * 100, [1900] + [8] * 100),
        ([1] * 40 + [37, 512, 3], [100 + 20 * i for i in range(40)] + [37, 900, 50]),
    ],
)
def test_padding_is_bounded(q_lens, keys):
    """Padded query x key work of every bucket stays within 1.25x its own real work: no batch x
    longest blow-up."""
    for g in attention_buckets(q_lens, keys):
        padded = len(g) * max(q_lens[i] for i in g) * max(keys[i] for i in g)
        assert padded <= 1.25 * sum(q_lens[i] * keys[i] for i in g)
    assert sorted(i for g in attention_buckets(q_lens, keys) for i in g) == list(range(len(q_lens)))


def test_mixed_prefill_plan_is_small():
    """One 1,900-token prompt with 100 eight-token prompts: the plan gathers about the real keys and
    masks nothing large."""
    lens = [1900] + [8] * 100
    nb = [-(-n // 16) for n in lens]
    tables, at = [], 0
    for n in nb:
        tables.append(list(range(at, at + n)))
        at += n
    M = max(nb)
    bt = torch.tensor([t + [0] * (M - len(t)) for t in tables], dtype=torch.int32)
    plan = plan_attention(lens, lens, bt, 16)
    assert sum(b.slots.numel() for b in plan) == sum(lens)  # exactly the keys needed
    assert all(b.mask is None for b in plan) and any(
        b.is_causal for b in plan
    )  # fresh prompts: SDPA's own causal mask


def test_plan_built_once_per_step():
    m = AttentionMetadata.build([5, 9], [1, 4], [[0, 1], [2, 3, 4]], 4)
    assert m.attention_plan(4) is m.attention_plan(4) and m.attention_plan(
        4, 2
    ) is not m.attention_plan(4)


def test_fp8_cache_torch_backend():
    """An fp8 (e4m3) cache through the torch backend: written saturated and rounded, read back in
    the queries' dtype; output within e4m3's rounding of the float32 cache's."""
    lens, qlens = [5, 16, 17, 40, 24], [1, 1, 1, 12, 24]
    kc, vc, meta, q, k, v, full = make_case(lens, qlens, 16, 2, 4, 64, torch.float32, seed=3)
    tb = TorchAttentionBackend()
    ref = tb.forward(q, k, v, kc.clone(), vc.clone(), meta, 0.125)
    kc8, vc8 = kc.to(torch.float8_e4m3fn), vc.to(torch.float8_e4m3fn)
    out = tb.forward(q, k, v, kc8, vc8, meta, 0.125)
    assert out.dtype == torch.float32 and out.isfinite().all()
    assert rel_err(out, ref) <= 0.08
    big = torch.full((1, 2, 64), 1e4)
    write_kv(big, -big, kc8, vc8, meta.slot_mapping[:1])
    s = int(meta.slot_mapping[0])
    assert (kc8[s // 16, s % 16].float() == 448).all() and (
        vc8[s // 16, s % 16].float() == -448
    ).all()


# The compiled C++ decode kernel (attention_backend="cpp", auto's choice on CPU). It builds in a
# few seconds with the machine's C++ compiler (then it is cached on disk); without one, the
# kernel's own checks are skipped and the backend's fallback below is what runs.
NEEDS_CXX = pytest.mark.skipif(
    shutil.which(os.environ.get("CXX", "g++")) is None, reason="no C++ compiler on this machine"
)


def test_cpp_backend_is_configurable_and_falls_back():
    import hetero_infer.attention.cpp as ta
    from hetero_infer.attention.cpp import CppAttentionBackend
    from hetero_infer.core.config import EngineConfig

    assert EngineConfig(attention_backend="cpp").attention_backend == "cpp"
    assert get_attention_backend("cpp").name == "cpp"
    lens, qlens = [5, 17, 9], [1, 1, 4]
    kc, vc, meta, q, k, v, full = make_case(lens, qlens, 4, 2, 2, 32, torch.float32)
    saved = dict(ta._cpp)
    ta._cpp.clear()
    ta._cpp["error"] = "no C++ compiler (simulated)"
    try:
        out = CppAttentionBackend().forward(q, k, v, kc, vc, meta, 32**-0.5)
    finally:
        ta._cpp.clear()
        ta._cpp.update(saved)
    assert rel_err(out, reference(full, lens, qlens, 32**-0.5)) <= TOL[torch.float32]
    assert get_attention_backend("auto", "cpu").name == "cpp"  # auto on CPU
    # an fp8 cache is the torch path's (the kernel reads the model's dtype only)
    kc, vc, meta, q, k, v, full = make_case(lens, qlens, 4, 2, 2, 32, torch.float32)
    kc8, vc8 = kc.to(torch.float8_e4m3fn), vc.to(torch.float8_e4m3fn)
    got = CppAttentionBackend().forward(q, k, v, kc8.clone(), vc8.clone(), meta, 32**-0.5)
    want = TorchAttentionBackend().forward(q, k, v, kc8.clone(), vc8.clone(), meta, 32**-0.5)
    assert torch.equal(got, want)


# a function with enough code that a library cut short loses pages the loader maps anyway
_BIG = "".join(f'extern "C" int f{i}(int x) {{ return x * {i} + {i % 7}; }}\n' for i in range(400))
_LOAD = """
import ctypes, sys
from hetero_infer.attention.cpp import build_shared_library
lib = build_shared_library("cut", sys.argv[1], ["-O0"], [])
print(ctypes.CDLL(str(lib)).f399(2))
"""


@NEEDS_CXX
@pytest.mark.parametrize("keep", [0.5, 0.9, 0.0])
def test_a_cached_library_cut_short_is_built_again_never_loaded(tmp_path, keep):
    "A .so in the kernel cache cut short (a crash after the rename, a full disk) is rebuilt."
    import subprocess
    import sys

    env = {**os.environ, "HETERO_INFER_CACHE": str(tmp_path)}
    run = lambda: subprocess.run(  # noqa: E731
        [sys.executable, "-c", _LOAD, _BIG], env=env, capture_output=True, text=True, timeout=300
    )
    first = run()
    assert first.returncode == 0 and first.stdout.strip() == str(2 * 399 + 399 % 7), first.stderr
    (lib,) = tmp_path.glob("cut-*.so")
    data = lib.read_bytes()
    lib.write_bytes(data[: int(len(data) * keep)])
    again = run()  # unchecked, 90% of it dies of SIGBUS, 50% or 0% fail to load; here: rebuilt
    assert again.returncode == 0 and again.stdout.strip() == first.stdout.strip(), again
    from hetero_infer.attention.cpp import cached_library_ok

    assert cached_library_ok(lib)


@NEEDS_CXX
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("D", [32, 64, 128, 24])  # 24: no constant for it, read at run time
@pytest.mark.parametrize("g", [1, 2, 7])
@pytest.mark.parametrize("window", [None, 1, 9])
def test_cpp_decode_kernel_sweep(dtype, D, g, window):
    from hetero_infer.attention.cpp import cpp_decode_op, cpp_paged_decode_attention

    assert cpp_decode_op() is not None
    bs = 16
    lens = ragged_lens(bs)
    kc, vc, meta, q, k, v, full = make_case(lens, [1] * len(lens), bs, 2, g, D, dtype, seed=D + g)
    write_kv(k, v, kc, vc, meta.slot_mapping)  # the rest of the NaN-filled cache is never read
    out = cpp_paged_decode_attention(q, kc, vc, meta.block_tables, meta.seq_lens, D**-0.5, window)
    assert out.dtype == dtype and out.shape == q.shape
    ref = reference(full, lens, [1] * len(lens), D**-0.5, window)
    assert rel_err(out, ref) <= TOL[dtype]


@NEEDS_CXX
@pytest.mark.parametrize("window", [None, 3])
def test_cpp_backend_mixed_step(window):
    from hetero_infer.attention.cpp import CppAttentionBackend

    lens, qlens = [5, 17, 33, 9, 12], [1, 1, 1, 4, 12]  # three decodes, a chunk, a fresh prompt
    kc, vc, meta, q, k, v, full = make_case(lens, qlens, 4, 2, 4, 64, torch.float32)
    out = CppAttentionBackend().forward(q, k, v, kc, vc, meta, 0.125, window=window)
    assert rel_err(out, reference(full, lens, qlens, 0.125, window)) <= TOL[torch.float32]


@NEEDS_CXX
def test_cpp_kernel_keeps_subnormal_floats():
    "Loading the kernel must not switch the process to flush-to-zero (gcc's -ffast-math at link)."
    from hetero_infer.attention.cpp import cpp_decode_op

    assert cpp_decode_op() is not None
    tiny = torch.tensor([1e-40])  # a float32 subnormal
    assert (tiny * 2).item() > 0 and (tiny.double() * 2).item() > 0
