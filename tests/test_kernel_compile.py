"""Ahead-of-time compilation of the attention kernels for the GPUs readers have (sm_75 T4 ...
sm_90 H100), without a GPU.

Every specialization the engine can launch (`launch_specs`, hetero_infer.attention.triton) must
compile for its target, fit that GPU's shared memory per block and spill no registers. Compiles run
in worker processes without TRITON_INTERPRET; Triton's own content-addressed cache makes a rerun
with unchanged kernels fast."""

import importlib
import os
import re
import textwrap
import pytest
import torch
from conftest import SaysCuda
import hetero_infer.quant.kernels as quant_kernels
from hetero_infer.attention.triton.decode import triton_paged_decode_attention, triton_write_kv
from hetero_infer.attention.triton.prefill import triton_paged_prefill_attention
from hetero_infer.attention.triton.targets import (
    ARCHS,
    ATTENTION_KERNELS,
    KERNEL_MODULES,
    KERNELS,
    KernelSpec,
    kernel_specs,
    launch_specs,
)
from hetero_infer.attention.triton.resources import compile_report, report_problems
from hetero_infer.moe.model import fused_moe_specs  # registers the fused-MoE binaries
from hetero_infer.quant.plugin import int8_matmul_specs  # registers the int8 GEMM's


def test_every_specialization_compiles_fits_and_does_not_spill():
    specs = launch_specs()
    per_target = len(fused_moe_specs("sm_80", "float16")) + len(
        int8_matmul_specs("sm_80", "float16")
    )
    assert sum(s.kernel in ("fused_moe", "int8_matmul") for s in specs) == 12 * per_target
    report = compile_report(specs)
    assert (
        len(report) == len(specs) == 362
    )  # 210 attention, 48 fp8-cache, 72 GEMM, 32 latent-decode binaries
    problems = report_problems(report)
    assert not problems, f"{len(problems)} of {len(report)} specializations fail:\n" + "\n".join(
        problems
    )
    assert {r["arch"] for r in report} == set(ARCHS)
    assert all(r["regs"] <= 255 and r["blocks_per_sm"] >= 1 for r in report)


def test_a_broken_kernel_fails_by_name(tmp_path):
    """A kernel the interpreter runs but a GPU compile rejects (an 8 x 8 tl.dot: its inner
    dimension is under 16) is reported with its name, constexprs and target."""
    (tmp_path / "broken_kernels.py").write_text(
        textwrap.dedent("""
        import triton, triton.language as tl
        @triton.jit
        def _small_dot_kernel(a_ptr, out_ptr, BLOCK: tl.constexpr):
            offs = tl.arange(0, BLOCK)
            a = tl.load(a_ptr + offs[:, None] * BLOCK + offs[None, :])
            tl.store(out_ptr + offs[:, None] * BLOCK + offs[None, :], tl.dot(a, a))
        """)
    )
    spec = KernelSpec(
        "write_kv",
        "float16",
        "sm_90",
        (64,),
        dict(BLOCK=8),
        module="broken_kernels",
        fn="_small_dot_kernel",
    )
    report = compile_report(
        [spec],
        jobs=1,
        env={"PYTHONPATH": str(tmp_path) + os.pathsep + os.environ.get("PYTHONPATH", "")},
    )
    problems = report_problems(report)
    assert (
        len(problems) == 1
        and "_small_dot_kernel[BLOCK=8]" in problems[0]
        and "sm_90" in problems[0]
        and "K >= 16" in problems[0]
    ), problems


class _Recorder:
    "Stands in for a @triton.jit kernel: records each launch's constexprs and options."

    def __init__(self, fn, calls):
        self.fn, self.calls = fn, calls

    def __getitem__(self, grid):
        def launch(*args, **kw):
            self.calls.append((self.fn, kw))

        return launch


def _record_attention_kernels(monkeypatch, calls):
    "Replace each attention kernel, in the module that defines and launches it, by a recorder."
    for k in ATTENTION_KERNELS:
        mod = importlib.import_module(KERNEL_MODULES[k])
        monkeypatch.setattr(mod, KERNELS[k], _Recorder(KERNELS[k], calls))


@pytest.mark.parametrize(
    "D,dtype", [(64, torch.float16), (96, torch.float32), (256, torch.float16)]
)
def test_the_check_compiles_what_the_launchers_launch(monkeypatch, D, dtype):
    "The launchers (on CPU: sm_80 tiles) pass the constexprs and options launch_specs compiles."
    calls = []
    _record_attention_kernels(monkeypatch, calls)
    q, c = torch.zeros(2, 4, D, dtype=dtype), torch.zeros(4, 16, 2, D, dtype=dtype)
    bt, sl = torch.zeros(2, 1, dtype=torch.int32), torch.ones(2, dtype=torch.int32)
    triton_write_kv(c[0, :2], c[0, :2], c, c, torch.zeros(2, dtype=torch.long))
    triton_paged_decode_attention(q, c, c, bt, sl, 1.0, num_splits=1)
    triton_paged_decode_attention(q, c, c, bt, sl, 1.0, num_splits=2)
    triton_paged_prefill_attention(q, c, c, bt, torch.tensor([0, 1, 2], dtype=torch.int32), sl, 1.0)
    want = {
        k: kernel_specs(k, str(dtype)[6:], "sm_80", (D,))
        for k in ("write_kv", "decode", "decode_split", "reduce_splits", "prefill")
    }
    got = dict(zip(["write_kv", "decode", "decode_split", "reduce_splits", "prefill"], calls))
    for k, spec in want.items():
        fn, kw = got[k]
        assert fn == KERNELS[k]
        assert {n: kw[n] for n in spec.constexprs} == spec.constexprs, k
        assert (kw.get("num_warps", 4), kw.get("num_stages", 3)) == (
            spec.num_warps,
            spec.num_stages,
        ), k


def test_fp8_cache_launches_what_the_check_compiles(monkeypatch):
    "With a float8_e4m3fn cache the launchers pass the constexprs of the fp8 specs (sm_89+)."
    calls = []
    _record_attention_kernels(monkeypatch, calls)
    q = torch.zeros(2, 4, 64, dtype=torch.float16)
    c = torch.zeros(4, 16, 2, 64, dtype=torch.float8_e4m3fn)
    bt, sl = torch.zeros(2, 1, dtype=torch.int32), torch.ones(2, dtype=torch.int32)
    k = torch.zeros(2, 2, 64, dtype=torch.float16)
    triton_write_kv(k, k, c, c, torch.zeros(2, dtype=torch.long))
    triton_paged_decode_attention(q, c, c, bt, sl, 1.0, num_splits=1)
    triton_paged_prefill_attention(q, c, c, bt, torch.tensor([0, 1, 2], dtype=torch.int32), sl, 1.0)
    for (fn, kw), kern in zip(calls, ["write_kv", "decode", "prefill"]):
        spec = kernel_specs(kern, "float16", "sm_90", (64,), "fp8")
        assert spec.kv_cache == "fp8" and fn == KERNELS[kern]
        want = kernel_specs(kern, "float16", "sm_80", (64,), "fp8").constexprs  # CPU: sm_80 tiles
        assert {n: kw[n] for n in want} == want, kern
    assert calls[0][1]["FP8"] is True


@pytest.mark.parametrize("M", [1, 16, 17, 100])
def test_int8_gemm_launches_what_the_check_compiles(monkeypatch, M):
    calls = []
    specs = int8_matmul_specs("sm_80", "float32")
    name = specs[0].fn
    monkeypatch.setattr(quant_kernels, name, _Recorder(name, calls))
    x, w = torch.zeros(M, 64), torch.zeros(32, 64, dtype=torch.int8)
    quant_kernels.triton_int8_matmul(x, w, torch.ones(32))
    assert any({n: calls[0][1][n] for n in s.constexprs} == s.constexprs for s in specs), calls


@pytest.mark.parametrize("pairs", [4, 40])  # decode-sized: 16-row tiles; beyond 16 per expert
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_fused_moe_launches_what_the_check_compiles(monkeypatch, pairs, dtype):
    "Both launches (gated, plain) pass the constexprs and warps of one of `fused_moe_specs`."
    import hetero_infer.moe.kernels as moe_kernels

    calls = []
    specs = fused_moe_specs("sm_80", str(dtype)[6:])
    monkeypatch.setattr(moe_kernels, "_fused_moe_kernel", _Recorder("_fused_moe_kernel", calls))
    T, k = pairs // 2, 2
    x, ids = torch.zeros(T, 64, dtype=dtype), torch.randint(0, 2, (T, k))
    gate_up, down = torch.zeros(2, 64, 64, dtype=dtype), torch.zeros(2, 64, 32, dtype=dtype)
    moe_kernels.fused_moe(x, gate_up, down, torch.ones(T, k), ids)
    assert [kw["GATED"] for _, kw in calls] == [True, False]
    for _, kw in calls:
        assert any(
            {n: kw[n] for n in s.constexprs} == s.constexprs and kw["num_warps"] == s.num_warps
            for s in specs
        ), kw
    assert calls[0][1]["BLOCK_M"] == (16 if pairs <= 16 * 2 else 64)


def test_fused_moe_refuses_gpus_before_sm80(monkeypatch):
    import hetero_infer.moe.kernels as moe_kernels

    calls = []
    monkeypatch.setattr(moe_kernels, "_fused_moe_kernel", _Recorder("_fused_moe_kernel", calls))
    x = torch.zeros(2, 64).as_subclass(SaysCuda)
    args = (
        torch.zeros(2, 64, 64),
        torch.zeros(2, 64, 32),
        torch.ones(2, 1),
        torch.zeros(2, 1, dtype=torch.long),
    )
    caps = {}
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda d: caps[d.type])
    caps["cpu"] = (7, 5)
    msg = (
        "the fused MoE kernel needs compute capability 8.0 or newer (it spills registers on older "
        "GPUs), this GPU has 7.5; use method='grouped'"
    )
    with pytest.raises(ValueError, match=f"^{re.escape(msg)}$"):
        moe_kernels.fused_moe(x, *args)
    assert calls == []
    caps["cpu"] = (8, 0)
    moe_kernels.fused_moe(x, *args)
    assert len(calls) == 2


def test_fused_moe_tiles_and_block_layout():
    from hetero_infer.moe.kernels import align_block_size, fused_moe_tiles

    assert fused_moe_tiles(16 * 8, 8) == (16, 64, 64) and fused_moe_tiles(16 * 8 + 1, 8) == (
        64,
        64,
        64,
    )
    assert fused_moe_tiles(4, 8, torch.float32) == (16, 64, 32)
    sorted_ids, block_expert = align_block_size(torch.tensor([[1, 0], [1, 3]]), 2, 2)
    assert sorted_ids.dtype == block_expert.dtype == torch.int32
    assert sorted_ids.tolist() == [1, 4, 0, 2] and block_expert.tolist() == [0, 1]
