"""Quantization (hetero_infer.quant.quantize, hetero_infer.quant.kernels): round-trip error bounds,
the CPU int8 paths and the Triton kernel (interpreter on CPU) against a dequantized reference,
W8A8's recorded fallback, fp8 KV helpers, and refusals naming the field."""

import copy
import re
import pytest
import torch
from conftest import SaysCuda
import torch.nn as nn
from hetero_infer.quant.int8_matmul import quantize_activations
from hetero_infer.quant.quantize import (
    FP8_DTYPE,
    FP8_MAX,
    GRANULARITIES,
    QUANTIZATION_MODES,
    QuantizedEmbedding,
    QuantizedLinear,
    check_quantization,
    dequantize_fp8,
    dequantize_int8,
    kv_blocks_at_equal_memory,
    module_bytes,
    quantize_fp8,
    quantize_int8,
    quantize_model,
    resolve_kv_cache_dtype,
)
from hetero_infer.quant.int8_matmul import fbgemm_available, int8_weight_matmul, w8a8_matmul

torch.set_num_threads(1)  # pinned: 2 shared cores


def _ref(x, q, s):
    "The dequantized reference x @ (q * s).T in float32."
    return x.float() @ dequantize_int8(q, s).T


def _rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


@pytest.mark.parametrize("gran", GRANULARITIES)
@pytest.mark.parametrize("shape", [(1, 32), (7, 64), (33, 256)])
def test_int8_round_trip_bound(gran, shape):
    torch.manual_seed(0)
    w = torch.randn(shape) * torch.rand(shape[0], 1) * 3
    q, s = quantize_int8(w, gran, group_size=32)
    assert q.dtype == torch.int8 and q.abs().max() <= 127
    step = s if s.shape[1] == 1 else s.repeat_interleave(32, dim=1)
    assert ((dequantize_int8(q, s) - w).abs() <= step / 2 + 1e-6).all()


def test_finer_scales_are_not_worse():
    torch.manual_seed(0)
    w = torch.randn(64, 256) * torch.exp(torch.randn(64, 1))
    errs = [(dequantize_int8(*quantize_int8(w, g, 64)) - w).norm() for g in GRANULARITIES]
    assert errs[0] >= errs[1] >= errs[2]


def test_zero_weight_has_finite_scale():
    q, s = quantize_int8(torch.zeros(4, 16))
    assert torch.isfinite(s).all() and (dequantize_int8(q, s) == 0).all()


def test_bad_granularity_and_group_size():
    with pytest.raises(ValueError, match="granularity"):
        quantize_int8(torch.randn(4, 16), "row")
    with pytest.raises(ValueError, match="group_size"):
        quantize_int8(torch.randn(4, 16), "group", group_size=5)


def test_fp8_relative_error_and_clipping():
    x = torch.logspace(-2, 1, 500) * torch.randn(500).sign()
    q, s = quantize_fp8(x)
    assert q.dtype == FP8_DTYPE and s.shape == ()
    assert ((dequantize_fp8(q, s) - x).abs() / x.abs()).max() <= 2**-4
    q, s = quantize_fp8(torch.tensor([1.0, 1000.0]), scale=1.0)  # past the range: clipped
    assert dequantize_fp8(q, s)[1] == FP8_MAX


def test_activation_quantization_per_token():
    x = torch.randn(5, 40) * torch.tensor([[1.0], [10.0], [0.1], [1.0], [100.0]])
    q, s = quantize_activations(x)
    assert q.dtype == torch.int8 and s.shape == (5, 1)
    assert ((q.float() * s - x).abs() <= s / 2 + 1e-6).all()
    assert (q.abs().amax(1) == 127).all()


@pytest.mark.parametrize("M", [1, 2, 3, 16, 17])
@pytest.mark.parametrize("K", [16, 40, 100, 128])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_int8_weight_matmul(M, K, dtype):
    torch.manual_seed(M * K)
    q, s = quantize_int8(torch.randn(37, K))
    x = torch.randn(M, K, dtype=dtype)
    y = int8_weight_matmul(x, q, s[:, 0])
    assert y.dtype == dtype and y.shape == (M, 37)
    tol = 1e-4 if dtype == torch.float32 else 1e-2  # two int8 digits: ~15 bits
    assert _rel(y, _ref(x, q, s)) < tol


@pytest.mark.parametrize("M", [1, 5, 17])
def test_w8a8_matmul_close(M):
    torch.manual_seed(M)
    q, s = quantize_int8(torch.randn(50, 96))
    x = torch.randn(M, 96)
    assert _rel(w8a8_matmul(x, q, s[:, 0]), _ref(x, q, s)) < 0.02


@pytest.mark.parametrize("M,K,N", [(1, 40, 70), (5, 100, 37), (19, 72, 130), (16, 64, 64)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_triton_int8_matmul_interpreter(M, K, N, dtype):
    from hetero_infer.quant.kernels import triton_int8_matmul

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(K)
    q, s = quantize_int8(torch.randn(N, K))
    x = torch.randn(M, K).to(dev, dtype)
    y = triton_int8_matmul(x, q.to(dev), s[:, 0].to(dev))
    assert y.dtype == dtype and y.shape == (M, N)
    assert _rel(y.cpu(), _ref(x.cpu(), q, s)) < (1e-5 if dtype == torch.float32 else 2e-3)


def test_int8_matmul_tiles():
    "16-row tiles up to 16 rows (decode), 64 beyond; a 32-wide K step in fp32 (no spills)."
    from hetero_infer.quant.kernels import int8_matmul_tiles

    assert int8_matmul_tiles(16) == (16, 64, 64) and int8_matmul_tiles(17) == (64, 64, 64)
    assert int8_matmul_tiles(1, torch.float32) == (16, 64, 32)
    assert int8_matmul_tiles(300, torch.bfloat16) == (64, 64, 64)


def test_fbgemm_path_is_exact_and_keeps_one_copy():
    """CPU int8 with VNNI: fbgemm's packed GEMM on two digits equals the reference,
    even where int16 pair sums would saturate; one copy of the weight stays in memory."""
    torch.manual_seed(0)
    ql = QuantizedLinear.from_float(nn.Linear(256, 40, bias=False), "int8")
    q, s = ql.qweight.clone(), ql.scale.clone()
    q[0], q[1] = 127, -127  # u8 254 x s8 127, twice: 64516 > 32767 if summed in int16
    ql.qweight.copy_(q)
    x = torch.randn(16, 256)
    x[0], x[1] = 3.0, -3.0  # every digit at +-127
    assert _rel(ql(x), _ref(x, q, s[:, None])) < 1e-3
    assert (ql(x[:1]) - _ref(x[:1], q, s[:, None])).abs().max() < 1e-3  # the saturating row
    if fbgemm_available():
        assert ql.qweight is None and ql.packed is not None
        assert torch.equal(ql.int8_weight(), q)
        assert module_bytes(ql) == 40 * (256 + 4) + 40 * 4  # packed copy + its offsets + scales
    else:
        assert ql.packed is None and ql.qweight is not None
    x2 = torch.randn(300, 256)  # prefill-sized: the same path
    assert _rel(ql(x2), _ref(x2, q, s[:, None])) < 1e-3
    emb = nn.Embedding(50, 64)  # a tied lm_head packs too, but the lookup keeps its table
    model = nn.Module()
    model.embed_tokens, model.lm_head = emb, nn.Linear(64, 50, bias=False)
    model.lm_head.weight = emb.weight
    quantize_model(model, "int8")
    h = torch.randn(1, 64)
    ref = _ref(h, model.embed_tokens.qweight, model.embed_tokens.scale[:, None])
    assert _rel(model.lm_head(h), ref) < 1e-3
    assert model.lm_head.qweight is model.embed_tokens.qweight


def test_onednn_w8a8_path_equals_int_mm_and_keeps_one_copy():
    """CPU W8A8 with VNNI: after its first-call check the layer runs oneDNN's packed GEMM, equal
    to the unpacked `_int_mm` path (same int8 digits, int32 sums); one copy of the weight stays."""
    torch.manual_seed(0)
    ql = QuantizedLinear.from_float(nn.Linear(256, 40, bias=True), "w8a8")
    q, s, b = ql.qweight.clone(), ql.scale.clone(), ql.bias.clone()
    x = torch.randn(16, 256)
    first = ql(x)  # the check, on the plain copy
    assert ql.rel_error is not None and not ql.fell_back
    assert torch.allclose(first, w8a8_matmul(x, q, s) + b, rtol=1e-5, atol=1e-5)
    for rows in (1, 16, 300):  # decode, a batch, a prefill
        xr = torch.randn(rows, 256)
        assert torch.allclose(ql(xr), w8a8_matmul(xr, q, s) + b, rtol=1e-5, atol=1e-5)
    if fbgemm_available():
        assert ql.qweight is None and isinstance(ql.packed, tuple)
        assert torch.equal(ql.int8_weight(), q)
    else:
        assert ql.packed is None and torch.equal(ql.qweight, q)
    zero_first = QuantizedLinear.from_float(nn.Linear(64, 8), "w8a8")
    zero_first(torch.zeros(1, 64))  # no check on zeros, so no packing yet: the plain copy stays
    assert zero_first.rel_error is None and zero_first.qweight is not None


@pytest.mark.parametrize("mode", QUANTIZATION_MODES)
def test_quantized_linear_matches_float(mode):
    torch.manual_seed(0)
    lin = nn.Linear(64, 48, bias=True)
    ql = QuantizedLinear.from_float(lin, mode)
    x = torch.randn(2, 5, 64)
    with torch.no_grad():
        assert _rel(ql(x), lin(x)) < 0.02
    assert ql.int8_weight().dtype == torch.int8 and ql.scale.shape == (48,)
    assert ql.rel_error is None if mode == "int8" else ql.rel_error < 0.02


def test_w8a8_fallback_recorded():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(96, 96), nn.Linear(96, 32))
    with torch.no_grad():
        model[0].weight[:, 3] = 0  # a massive activation in a feature the layer ignores
    ref_model = copy.deepcopy(model)
    report = quantize_model(model, "w8a8")
    x = torch.randn(4, 96)
    x[:, 3] = 1000.0  # per-token int8 rounds the other 95 features to 0
    with torch.no_grad():
        y = model(x)
        ref = ref_model(x)
    assert list(report.fallbacks) == ["0"] and report.fallbacks["0"] > 0.05
    assert report.layers["0"].fell_back and "fell_back" in repr(report.layers["0"])
    assert _rel(y, ref) < 0.02  # the fallen-back layer is weight-only int8, still close
    assert "fell back" in repr(report)


def test_all_zero_first_call_does_not_decide():
    ql = QuantizedLinear.from_float(nn.Linear(16, 8), "w8a8")
    ql(torch.zeros(3, 16))
    assert ql.rel_error is None and not ql.fell_back
    ql(torch.randn(3, 16))
    assert ql.rel_error is not None


def test_quantize_model_skips_and_bytes():
    model = nn.Sequential(nn.Linear(64, 128, bias=False), nn.Linear(128, 64, bias=False))
    model.lm_head = nn.Linear(64, 10, bias=False)
    model.embed_tokens = nn.Embedding(10, 64)  # untied: both quantized, apart
    report = quantize_model(model, "int8", skip=("1",))
    assert list(report.layers) == ["0", "lm_head"] and report.skipped == ["1"]
    assert list(report.embeddings) == ["embed_tokens"] and report.tied == {}
    assert isinstance(model[0], QuantizedLinear) and type(model[1]) is nn.Linear
    assert isinstance(model.embed_tokens, QuantizedEmbedding)
    assert model.lm_head.qweight is not model.embed_tokens.qweight
    assert report.bytes_after == module_bytes(model) < report.bytes_before


@pytest.mark.parametrize("skip", ["lm_head", "embed_tokens"])
def test_tied_pair_is_kept_together(skip):
    "Skipping either half of a tied embedding/lm_head keeps both in float (one table, no copy)."
    model = nn.Sequential(nn.Linear(64, 64))
    model.embed_tokens = nn.Embedding(10, 64)
    model.lm_head = nn.Linear(64, 10, bias=False)
    model.lm_head.weight = model.embed_tokens.weight
    report = quantize_model(model, "int8", skip=(skip,))
    assert sorted(report.skipped) == ["embed_tokens", "lm_head"] and list(report.layers) == ["0"]
    assert model.lm_head.weight is model.embed_tokens.weight


@pytest.mark.parametrize("mode", QUANTIZATION_MODES)
def test_tied_embedding_is_one_int8_table(mode):
    "A tied lm_head uses the embedding's int8 table and scales: one copy, both uses correct."
    torch.manual_seed(0)
    emb = nn.Embedding(300, 64)
    emb.weight.data *= torch.rand(300, 1) * 3  # rows of different sizes: per-row scales matter
    model = nn.Module()
    model.embed_tokens, model.lm_head = emb, nn.Linear(64, 300, bias=False)
    model.lm_head.weight = emb.weight
    w = emb.weight.detach().clone()
    report = quantize_model(model, mode)
    assert report.tied == {"lm_head": "embed_tokens"} and list(report.layers) == ["lm_head"]
    qe, head = model.embed_tokens, model.lm_head
    assert head.qweight is qe.qweight and head.scale is qe.scale
    assert module_bytes(model) == 300 * 64 + 300 * 4 == report.bytes_after
    ids = torch.tensor([0, 299, 7, 7])
    assert ((qe(ids) - w[ids]).abs() <= qe.scale[ids, None] / 2 + 1e-6).all()
    assert qe(ids).dtype == w.dtype
    h = torch.randn(3, 64)
    with torch.no_grad():
        assert _rel(head(h), h @ w.T) < 0.02


def test_embedding_lookup_any_shape_and_dtype():
    emb = nn.Embedding(50, 16, dtype=torch.bfloat16)
    qe = QuantizedEmbedding.from_float(emb)
    ids = torch.randint(0, 50, (2, 3, 4))
    out = qe(ids)
    assert out.shape == (2, 3, 4, 16) and out.dtype == torch.bfloat16
    assert torch.equal(out, dequantize_int8(qe.qweight, qe.scale[:, None], torch.bfloat16)[ids])
    assert module_bytes(qe) / (50 * 16 * 2) <= 0.625  # 1 byte + 4 / 16 per weight


def test_int8_weight_bytes_ratio():
    ql = QuantizedLinear.from_float(nn.Linear(896, 4864, bias=False, dtype=torch.bfloat16))
    assert module_bytes(ql) / (4864 * 896 * 2) <= 0.55


@pytest.mark.parametrize("bad", ["int4", "fp8", "", "INT8"])
def test_bad_mode_names_quantization(bad):
    with pytest.raises(ValueError, match="quantization"):
        check_quantization(bad)
    with pytest.raises(ValueError, match="quantization"):
        QuantizedLinear.from_float(nn.Linear(4, 4), bad)
    with pytest.raises(ValueError, match="quantization"):
        quantize_model(nn.Sequential(nn.Linear(4, 4)), bad)
    with pytest.raises(ValueError, match="quantization"):
        quantize_model(nn.Sequential(nn.Linear(4, 4)), None)
    assert check_quantization(None) is None


def test_kv_cache_dtype_and_blocks():
    assert resolve_kv_cache_dtype("auto", torch.float16) == torch.float16
    assert resolve_kv_cache_dtype("fp8_e4m3", torch.bfloat16) == FP8_DTYPE
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        resolve_kv_cache_dtype("fp8_e5m2", torch.bfloat16)
    kw = dict(num_layers=24, block_size=16, num_kv_heads=2, head_dim=64)
    b16 = kv_blocks_at_equal_memory(1 << 30, **kw, dtype=torch.bfloat16)
    b8 = kv_blocks_at_equal_memory(1 << 30, **kw, dtype=FP8_DTYPE)
    assert b8 / b16 >= 1.9
    assert kv_blocks_at_equal_memory(10, **kw, dtype=FP8_DTYPE) == 0


# --- in the engine: ModelRunner / LLM with quantization and an fp8 KV cache ---


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from hetero_infer.testing import tiny_hf_checkpoint

    path = tmp_path_factory.mktemp("q") / "qwen3"
    tiny_hf_checkpoint(path, "qwen3", seed=2)
    return str(path)


def _greedy(path, n=4, max_tokens=12, **kw):
    from hetero_infer.core.sampling_params import SamplingParams
    from hetero_infer.engine.llm import LLM

    llm = LLM(path, seed=0, **kw)
    prompts = [[(7 * i + j) % 200 + 3 for j in range(5 + 3 * i)] for i in range(n)]
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=max_tokens), False)
    return llm, [o.outputs[0].token_ids for o in outs]


@pytest.mark.parametrize(
    "kw", [dict(quantization="int8"), dict(quantization="w8a8"), dict(kv_cache_dtype="fp8")]
)
def test_llm_quantized_agrees_with_float(tiny, kw, caplog):
    """The first greedy token of 16 prompts of a tiny random model agrees with unquantized on >= 15
    (a random model's logits are flat: once one token differs, the rest of the text does)."""
    caplog.set_level("INFO", logger="hetero_infer.model.runner")
    _, ref = _greedy(tiny, n=16, max_tokens=2)
    llm, got = _greedy(tiny, n=16, max_tokens=2, **kw)
    agree = sum(r[0] == g[0] for r, g in zip(ref, got))
    assert agree >= 15, (kw, agree)
    runner = llm.engine.runner
    if "quantization" in kw:
        assert runner.quant_report.mode == kw["quantization"]
        n_layers = runner.model.config.num_layers
        assert len(runner.quant_report.layers) == 4 * n_layers + 1  # and the lm_head
        assert list(runner.quant_report.embeddings) == ["embed_tokens"]
        assert f"quantization={kw['quantization']}" in caplog.text
    else:
        assert runner.kv_caches[0][0].dtype == torch.float8_e4m3fn
        assert "KV cache float8_e4m3fn" in caplog.text


def test_fp8_cache_gives_4x_blocks_of_fp32_at_equal_memory(tiny):
    "On CPU the cache budget is in bytes: fp8 holds 4x the blocks of float32 (2x of bf16)."
    from hetero_infer.core.config import EngineConfig
    from hetero_infer.model.runner import CPU_KV_CACHE_BYTES, ModelRunner, kv_block_bytes

    big = dict(model=tiny, max_num_seqs=10**5, max_model_len=64)  # the byte budget binds
    r32 = ModelRunner(EngineConfig(**big))
    r8 = ModelRunner(EngineConfig(kv_cache_dtype="fp8", **big), r32.model)
    rbf = ModelRunner(EngineConfig(dtype="bfloat16", **big))
    assert r8.num_blocks == 4 * r32.num_blocks == 2 * rbf.num_blocks
    assert r8.num_blocks * kv_block_bytes(r8.model.config, 16, FP8_DTYPE) <= CPU_KV_CACHE_BYTES
    r8bf = ModelRunner(EngineConfig(kv_cache_dtype="fp8", **big), rbf.model)
    assert r8bf.num_blocks == 2 * rbf.num_blocks
    assert "2.00x the blocks per MiB of bfloat16" in r8bf.startup_lines()[-1]


def test_quantization_refused_with_tensor_parallelism(tiny):
    from hetero_infer.core.config import EngineConfig
    from hetero_infer.model.runner import ModelRunner

    with pytest.raises(ValueError, match="quantization='w8a8' is not supported with tensor_par"):
        ModelRunner(EngineConfig(model=tiny, quantization="w8a8", tensor_parallel_size=2))
    with pytest.raises(ValueError, match="kv_cache_dtype='fp8' is not supported with tensor_p"):
        ModelRunner(EngineConfig(model=tiny, kv_cache_dtype="fp8", tensor_parallel_size=2))


def test_bad_engine_values_name_the_field(tiny):
    from hetero_infer.engine.llm import LLM

    with pytest.raises(ValueError, match="quantization"):
        LLM(tiny, quantization="int4")
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        LLM(tiny, kv_cache_dtype="fp8_e5m2")


def test_w8a8_fallbacks_logged_after_first_step(tiny, caplog):
    caplog.set_level("INFO", logger="hetero_infer.model.runner")
    llm, _ = _greedy(tiny, n=1, max_tokens=2, quantization="w8a8")
    assert "layers fell back to int8" in caplog.text
    assert all(m.rel_error is not None for m in llm.engine.runner.quant_report.layers.values())


def test_demo_model_under_each_mode():
    "The demo model answers >= 62 of 64 fresh held-out prompts under int8, w8a8 and fp8 KV."
    from hetero_infer.core.sampling_params import SamplingParams
    from hetero_infer.demo.task import check_answer, demo_prompts
    from hetero_infer.engine.llm import LLM

    prompts = demo_prompts(64, seed=4321)
    sp = SamplingParams(temperature=0, max_tokens=16)
    for kw in (dict(quantization="int8"), dict(quantization="w8a8"), dict(kv_cache_dtype="fp8")):
        outs = LLM(None, **kw).generate(prompts, sp, use_tqdm=False)
        right = sum(check_answer(p, o.outputs[0].text) for p, o in zip(prompts, outs))
        assert right >= 62, (kw, right)


# --- pre-quantized checkpoints: compressed-tensors (a dev requirement: imported, never skipped) ---


@pytest.fixture(scope="module")
def ct_source(tmp_path_factory):
    from hetero_infer.testing import tiny_hf_checkpoint

    d = tmp_path_factory.mktemp("ct")
    return d, tiny_hf_checkpoint(d / "float", "llama", seed=3)


def _write_ct(ct_source, scheme, strategy="channel"):
    "A compressed-tensors checkpoint of the tiny llama, written by the package itself."
    import contextlib
    import io
    from hetero_infer.quant.checkpoints import write_compressed_checkpoint

    d, src = ct_source
    path = d / f"{scheme}-{strategy}"
    if not path.exists():
        with contextlib.redirect_stderr(io.StringIO()):  # its progress bars
            write_compressed_checkpoint(copy.deepcopy(src), path, scheme, strategy)
    return path


@pytest.mark.parametrize(
    "scheme,strategy",
    [("w8a8", "channel"), ("w8a16", "tensor"), ("fp8", "channel"), ("fp8", "tensor")],
)
def test_compressed_checkpoint_equals_the_packages_decompression(ct_source, scheme, strategy):
    """Every quantized layer, loaded by `load_model`, holds exactly the weights compressed-tensors
    decompresses it to (through transformers); int8 ones as stored int8, fp8 ones dequantized."""
    import contextlib
    import io
    from transformers import AutoModelForCausalLM
    from hetero_infer.model.loading import hf_names, load_model

    path = _write_ct(ct_source, scheme, strategy)
    with contextlib.redirect_stderr(io.StringIO()):
        theirs = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        with torch.no_grad():
            theirs(torch.tensor([[1, 2, 3]]))  # the package decompresses on the first call
    params = {n: p.detach() for n, p in theirs.named_parameters()}
    assert params["model.layers.0.mlp.down_proj.weight"].dtype == torch.float32
    ours = load_model(path)
    checked = 0
    for name, m in ours.named_modules():
        if not name.endswith(("qkv_proj", "o_proj", "gate_up_proj", "down_proj")):
            continue
        ref = torch.cat([params[h] for h in hf_names(f"{name}.weight")])
        if scheme == "fp8":
            assert type(m) is nn.Linear
            w = m.weight.detach()
        else:
            assert isinstance(m, QuantizedLinear), name
            assert m.mode == ("w8a8" if scheme == "w8a8" else "int8")
            assert m.qweight.dtype == torch.int8
            w = dequantize_int8(m.qweight, m.scale[:, None])
        assert torch.equal(w, ref), name
        checked += 1
    assert checked == 4 * ours.config.num_layers
    assert type(ours.lm_head) is nn.Linear  # the checkpoint kept it in float
    assert torch.equal(ours.lm_head.weight.detach(), params["lm_head.weight"])


def test_llm_runs_a_compressed_checkpoint(ct_source):
    """`LLM(path)` runs the stored int8 weights with no argument (greedy first tokens agree with
    the float model's); `quantization="int8"` on top quantizes what the checkpoint left in float."""
    path = _write_ct(ct_source, "w8a16")
    _, ref = _greedy(str(ct_source[0] / "float"), n=16, max_tokens=1)
    llm, got = _greedy(str(path), n=16, max_tokens=1)
    assert sum(r == g for r, g in zip(ref, got)) >= 15
    assert llm.engine.runner.quant_report is None
    qkv = llm.engine.runner.model.layers[0].self_attn.qkv_proj
    assert isinstance(qkv, QuantizedLinear) and qkv.mode == "int8"
    llm8, got8 = _greedy(str(path), n=16, max_tokens=1, quantization="int8")
    rep = llm8.engine.runner.quant_report
    assert list(rep.layers) == ["lm_head"] and list(rep.embeddings) == ["embed_tokens"]
    assert sum(r == g for r, g in zip(ref, got8)) >= 15


@pytest.mark.parametrize(
    "qc,why",
    [
        ({"quant_method": "awq", "bits": 4, "group_size": 128}, "quant_method 'awq'"),
        ({"quant_method": "gptq", "bits": 4, "group_size": 128}, "quant_method 'gptq'"),
        ({"quant_method": "bitsandbytes", "load_in_8bit": True}, "quant_method 'bitsandbytes'"),
        ("pack", "format 'pack-quantized'"),
        ("group", "weight strategy 'group'"),
        ("static", "static activation scales"),  # the FP8 / static W8A8 presets
    ],
)
def test_unloadable_quantization_config_is_refused_by_name(ct_source, tmp_path, qc, why):
    "AWQ, GPTQ, int4 packed and group-scale checkpoints fail at load, naming quantization_config."
    import json
    import shutil
    from hetero_infer.engine.llm import LLM
    from hetero_infer.model.loading import load_model

    shutil.copytree(_write_ct(ct_source, "w8a8"), tmp_path / "ck")
    cfg = json.loads((tmp_path / "ck" / "config.json").read_text())
    if qc == "pack":
        cfg["quantization_config"]["format"] = "pack-quantized"
        cfg["quantization_config"]["config_groups"]["group_0"]["format"] = "pack-quantized"
    elif qc == "group":
        w = cfg["quantization_config"]["config_groups"]["group_0"]["weights"]
        w.update(strategy="group", group_size=32)
    elif qc == "static":
        a = cfg["quantization_config"]["config_groups"]["group_0"]["input_activations"]
        a.update(dynamic=False, strategy="tensor")
    else:
        cfg["quantization_config"] = qc
    (tmp_path / "ck" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=f"unsupported quantization_config: {why}"):
        load_model(tmp_path / "ck")
    with pytest.raises(ValueError, match="quantization_config"):
        LLM(str(tmp_path / "ck"))


@pytest.mark.parametrize(
    "groups,why",
    [
        ([{"weights": {"num_bits": 8}}], "config_groups must be an object, got list"),
        ({"g": ["Linear"]}, "config_groups.g must be an object, got list"),
        ({"g": {"weights": "int8"}}, "config_groups.g.weights must be an object, got str"),
        ({"g": {"weights": {}, "input_activations": 8}}, "config_groups.g.input_activations"),
    ],
)
def test_malformed_compressed_tensors_config_names_the_field(tiny, tmp_path, groups, why):
    "A config_groups of the wrong shape is a ValueError naming it, at load, never AttributeError."
    import json
    import shutil
    from hetero_infer.model.loading import load_model

    shutil.copytree(tiny, tmp_path / "ck")
    cfg = json.loads((tmp_path / "ck" / "config.json").read_text())
    qc = {"quant_method": "compressed-tensors", "format": "int-quantized"}
    cfg["quantization_config"] = {**qc, "config_groups": groups}
    (tmp_path / "ck" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=f"unsupported quantization_config: {why}"):
        load_model(tmp_path / "ck")


def test_compressed_checkpoint_refused_with_tensor_parallelism(ct_source):
    from hetero_infer.core.config import EngineConfig
    from hetero_infer.model.runner import ModelRunner

    path = _write_ct(ct_source, "w8a8")
    with pytest.raises(ValueError, match="quantization_config: a pre-quantized checkpoint is not"):
        ModelRunner(EngineConfig(model=str(path), tensor_parallel_size=2))


# --- `hetero-infer bench offline --quantization / --kv-cache-dtype` (flags in 11's bench_args) ---


def test_bench_quantization_flags_parse_and_refuse():
    import argparse
    from hetero_infer.bench.main import feature_config
    from hetero_infer.bench.args import add_bench_arguments

    ap = argparse.ArgumentParser()
    add_bench_arguments(ap)
    a = ap.parse_args(["offline", "--quantization", "w8a8", "--kv-cache-dtype", "fp8"])
    assert feature_config(a) == {"quantization": "w8a8", "kv_cache_dtype": "fp8"}
    assert feature_config(ap.parse_args(["offline"])) is None
    for bad in (["--quantization", "int4"], ["--kv-cache-dtype", "fp8_e5m2"]):
        with pytest.raises(SystemExit) as e:
            ap.parse_args(["offline", *bad])
        assert e.value.code == 2


def test_bench_offline_times_quantized_against_plain(tiny, tmp_path, capsys):
    "One run: ours with int8 weights and an fp8 cache, and ours without them, in turns."
    import json
    from hetero_infer.bench.main import main

    out = tmp_path / "q.json"
    argv = ["offline", "--model", tiny, "--quantization", "int8", "--kv-cache-dtype", "fp8"]
    argv += ["--peers", "", "--num-requests", "2", "--input-len", "6,6", "--output-len", "3,3"]
    assert main(argv + ["--repeats", "1", "--warmup", "0", "--output", str(out)]) == 0
    res = json.loads(out.read_text())
    assert [r["key"] for r in res["results"]] == ["ours", "ours-plain"]
    assert "quantization=int8" in res["results"][0]["system"]
    assert "without quantization=int8, kv_cache_dtype=fp8" in res["results"][1]["system"]
    assert res["config"]["quantization"] == "int8" and res["config"]["kv_cache_dtype"] == "fp8"
    assert "without quantization=int8" in capsys.readouterr().out  # the printed table


# --- quantize_lm_head: the embedding and lm_head in int8 (default) or kept in float ---


def test_quantize_lm_head_option(tmp_path):
    """`quantize_lm_head=False` keeps a tied embedding/lm_head in float (one table, not two);
    the default quantizes it as one int8 table; a non-bool is refused naming the field."""
    from hetero_infer.core.config import EngineConfig
    from hetero_infer.testing import tiny_hf_checkpoint

    path = tmp_path / "tied"
    tiny_hf_checkpoint(path, "qwen2", seed=1, tie_word_embeddings=True)
    llm, ref = _greedy(str(path), n=16, max_tokens=1)
    on, got_on = _greedy(str(path), n=16, max_tokens=1, quantization="int8")
    off, got_off = _greedy(
        str(path), n=16, max_tokens=1, quantization="int8", quantize_lm_head=False
    )
    rep_on, rep_off = on.engine.runner.quant_report, off.engine.runner.quant_report
    assert rep_on.tied == {"lm_head": "embed_tokens"} and rep_on.skipped == []
    assert sorted(rep_off.skipped) == ["embed_tokens", "lm_head"] and rep_off.embeddings == {}
    m = off.engine.runner.model
    assert m.lm_head.weight is m.embed_tokens.weight  # still one float table
    assert rep_on.bytes_after < rep_off.bytes_after < rep_off.bytes_before
    for got in (got_on, got_off):
        assert sum(r == g for r, g in zip(ref, got)) >= 15
    with pytest.raises(ValueError, match="quantize_lm_head"):
        EngineConfig(quantize_lm_head="no")


def test_cli_quantize_lm_head_flag():
    from hetero_infer.cli.config import engine_config
    from hetero_infer.cli.flags import build_parser

    p = build_parser()
    a = p.parse_args(["generate", "--quantization", "int8", "--no-quantize-lm-head", "x"])
    assert engine_config(a).quantize_lm_head is False and engine_config(a).quantization == "int8"
    assert engine_config(p.parse_args(["serve"])).quantize_lm_head is True  # the default


@pytest.fixture(scope="module")
def ct_qwen2(tmp_path_factory):
    "A tiny random Qwen2 (q/k/v with biases) and its compressed-tensors w8a16 checkpoint."
    import contextlib
    import io
    from hetero_infer.quant.checkpoints import write_compressed_checkpoint
    from hetero_infer.testing import tiny_hf_checkpoint

    d = tmp_path_factory.mktemp("ct-qwen2")
    src = tiny_hf_checkpoint(d / "float", "qwen2", seed=4)
    assert src.model.layers[0].self_attn.q_proj.bias is not None
    with contextlib.redirect_stderr(io.StringIO()):  # its progress bars
        return write_compressed_checkpoint(copy.deepcopy(src), d / "w8a16", "w8a16")


def test_compressed_checkpoint_with_qkv_biases_loads_them(ct_qwen2):
    """A pre-quantized Qwen2 keeps its q/k/v biases in the int8 layers, and greedy decoding
    follows the model transformers decompresses the checkpoint to, token for token."""
    import contextlib
    import io
    from transformers import AutoModelForCausalLM
    from hetero_infer.model.loading import load_model

    with contextlib.redirect_stderr(io.StringIO()):
        theirs = AutoModelForCausalLM.from_pretrained(ct_qwen2, dtype=torch.float32).eval()
    ours = load_model(ct_qwen2)
    for i, layer in enumerate(ours.layers):
        qkv, attn = layer.self_attn.qkv_proj, theirs.model.layers[i].self_attn
        assert isinstance(qkv, QuantizedLinear) and qkv.bias is not None
        ref = torch.cat([attn.q_proj.bias, attn.k_proj.bias, attn.v_proj.bias]).detach()
        assert ref.abs().max() > 0.1  # random biases, far from zero
        assert torch.equal(qkv.bias.detach().float(), ref), i
    _, got = _greedy(str(ct_qwen2), n=4, max_tokens=6, dtype="float32")
    prompts = [[(7 * i + j) % 200 + 3 for j in range(5 + 3 * i)] for i in range(4)]
    for p, g in zip(prompts, got):
        with torch.no_grad():
            ids = theirs.generate(torch.tensor([p]), max_new_tokens=6, do_sample=False)
        assert g == ids[0, len(p) :].tolist(), p


# --- `checkpoint_scheme` on config dicts: what is accepted, and every refusal by name ---

W_INT = {"num_bits": 8, "type": "int", "strategy": "channel", "symmetric": True}
A_INT = {"num_bits": 8, "type": "int", "strategy": "token", "dynamic": True}


def _qc(group=None, **top):
    "A compressed-tensors `config.json` dict with one group (int8 weights, per channel)."
    group = {"weights": W_INT} if group is None else group
    qc = {"quant_method": "compressed-tensors", "format": "int-quantized"}
    return {"quantization_config": {**qc, "config_groups": {"group_0": group}, **top}}


@pytest.mark.parametrize(
    "cfg,weights,acts,mode",
    [
        (_qc(), "int", None, "int8"),
        (_qc({"weights": W_INT, "input_activations": A_INT}), "int", "int", "w8a8"),
        (
            _qc({"weights": {**W_INT, "strategy": "tensor"}, "input_activations": None}),
            "int",
            None,
            "int8",
        ),
        (
            _qc({"weights": {k: v for k, v in W_INT.items() if k != "symmetric"}}),
            "int",
            None,
            "int8",
        ),
        (
            _qc(
                {
                    "weights": {**W_INT, "type": "float"},
                    "input_activations": {**A_INT, "type": "float", "strategy": "tensor"},
                },
                format="float-quantized",
            ),
            "float",
            "float",
            None,
        ),
        (_qc({"weights": W_INT, "format": "naive-quantized"}, format=None), "int", None, "int8"),
        (_qc(kv_cache_scheme=None, sparsity_config={}), "int", None, "int8"),
    ],
)
def test_checkpoint_scheme_accepts(cfg, weights, acts, mode):
    from hetero_infer.quant.checkpoints import CheckpointScheme, checkpoint_scheme

    s = checkpoint_scheme(cfg)
    assert s == CheckpointScheme(weights, acts) and s.mode == mode


@pytest.mark.parametrize(
    "cfg,why",
    [
        ({"quantization_config": "int8"}, "'int8'"),
        (_qc(quant_method="fp8"), "quant_method 'fp8'"),
        (_qc(kv_cache_scheme={"num_bits": 8}), "kv_cache_scheme"),
        (_qc(sparsity_config={"format": "sparse-24"}), "sparsity"),
        (_qc(transform_config={"x": 1}), "sparsity"),
        (
            {"quantization_config": {**_qc()["quantization_config"], "config_groups": {}}},
            "no config_groups",
        ),
        (_qc(format=None), "format None"),
        (_qc({"weights": {**W_INT, "num_bits": 4}}), "4-bit int weights"),
        (_qc({"weights": {**W_INT, "type": "bool"}}), "8-bit bool weights"),
        (_qc({"weights": {**W_INT, "symmetric": False}}), "asymmetric or dynamic weights"),
        (_qc({"weights": {**W_INT, "dynamic": True}}), "asymmetric or dynamic weights"),
        (_qc({"weights": W_INT, "output_activations": A_INT}), "output activations"),
        (_qc({"weights": W_INT, "input_activations": {**A_INT, "dynamic": False}}), "static"),
        (_qc({"weights": W_INT, "input_activations": {**A_INT, "num_bits": 4}}), "static"),
        (_qc({"weights": W_INT, "input_activations": {**A_INT, "type": "float"}}), "static"),
        (_qc({"weights": W_INT, "input_activations": {**A_INT, "strategy": "group"}}), "static"),
    ],
)
def test_checkpoint_scheme_refuses_by_name(cfg, why):
    from hetero_infer.quant.checkpoints import checkpoint_scheme

    with pytest.raises(ValueError, match=f"unsupported quantization_config: {re.escape(why)}"):
        checkpoint_scheme(cfg)


def test_checkpoint_scheme_of_several_groups():
    "Groups with the same scheme are one scheme; different ones are refused; none is None."
    from hetero_infer.quant.checkpoints import checkpoint_scheme

    cfg = _qc()
    groups = cfg["quantization_config"]["config_groups"]
    groups["group_1"] = {"weights": W_INT}
    assert checkpoint_scheme(cfg).mode == "int8"
    groups["group_1"] = {"weights": W_INT, "input_activations": A_INT}
    with pytest.raises(ValueError, match="several different schemes"):
        checkpoint_scheme(cfg)
    assert checkpoint_scheme({"model_type": "llama"}) is None


def test_report_line_names_layers_bytes_and_what_stayed_float():
    from hetero_infer.quant.plugin import report_line
    from hetero_infer.quant.quantize import QuantizationReport

    r = QuantizationReport(
        "int8",
        layers={"a": None, "b": None},
        skipped=["model.lm_head", "model.inner.embed_tokens"],
        bytes_before=4 * 2**20,
        bytes_after=2**20 + 2**19,
    )
    assert report_line(r, torch.bfloat16) == (
        "quantization=int8: 2 linear layers in int8, weights 4.0 -> 1.5 MiB (0.38x), "
        "kept in bfloat16: lm_head, embed_tokens"
    )
    r = QuantizationReport("w8a8", bytes_after=3)  # nothing before: the ratio divides by 1
    assert report_line(r, torch.float32) == (
        "quantization=w8a8: 0 linear layers in int8, weights 0.0 -> 0.0 MiB (3.00x), "
        "kept in float32: nothing; w8a8 fallbacks: counted on the first step"
    )


def test_check_device_refuses_old_gpus_and_w8a8_sizes_torch_int_mm_cannot_take(monkeypatch):
    "Only CUDA is checked (its capability faked here): sm_80 or newer, W8A8 sizes multiples of 8."
    from hetero_infer.quant.plugin import check_device

    model = nn.Sequential(nn.Linear(16, 8), nn.Linear(8, 12))
    cuda = torch.device("cuda")
    check_device("w8a8", model, torch.device("cpu"))
    caps = {cuda: (7, 5)}  # asked for the layer's device
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device: caps[device])
    old = (
        "quantization='int8' needs compute capability 8.0 or newer on CUDA (the int8 GEMM "
        "kernel spills on older GPUs), this GPU has 7.5"
    )
    with pytest.raises(ValueError, match=f"^{re.escape(old)}$"):
        check_device("int8", model, cuda)
    caps[cuda] = (8, 0)
    check_device("int8", model, cuda)  # weight-only int8: any size
    for m, name, shape in [
        (model, "1", "12 x 8"),
        (nn.Sequential(nn.Linear(12, 8)), "0", "8 x 12"),
    ]:
        msg = (
            "quantization='w8a8' needs layers whose sizes are multiples of 8 on CUDA "
            f"(torch._int_mm); {name} is {shape}"
        )
        with pytest.raises(ValueError, match=f"^{re.escape(msg)}$"):
            check_device("w8a8", m, cuda)
    check_device("w8a8", nn.Sequential(nn.Linear(16, 8)), cuda)


def test_w8a8_fallbacks_are_logged_once_after_the_first_forward(caplog):
    import logging
    from types import SimpleNamespace
    from hetero_infer.quant.plugin import log_fallbacks_once
    from hetero_infer.quant.quantize import QuantizationReport

    def logged(layers):
        model = nn.Linear(2, 2)
        log_fallbacks_once(model, QuantizationReport("w8a8", layers=layers))
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="hetero_infer.model.runner"):
            model(torch.zeros(1, 2))
            model(torch.zeros(1, 2))
        return [r.getMessage() for r in caplog.records if r.name == "hetero_infer.model.runner"]

    fell = SimpleNamespace(fell_back=True, rel_error=0.123)
    kept = SimpleNamespace(fell_back=False, rel_error=0.001)
    assert logged({"l.0": fell, "l.1": kept, "l.2": fell}) == [
        "quantization=w8a8: 2 of 3 layers fell back to int8: l.0 (12.3%), l.2 (12.3%)"
    ]
    assert logged({"l.1": kept}) == ["quantization=w8a8: 0 of 1 layers fell back to int8: none"]


def test_two_digits_keep_a_scale_per_row_and_the_remainder_to_1_in_508():
    from hetero_infer.quant.int8_matmul import _int_mm_two_digit, two_digits

    g = torch.Generator().manual_seed(0)
    x = torch.randn(4, 32, generator=g)
    x[1] *= 1e-3  # a row below 1: its own, small scale
    x[3] = 0
    digits, sx = two_digits(x)
    assert sx.shape == (4, 1)
    assert torch.equal(sx, x.abs().amax(dim=1, keepdim=True).clamp(min=1e-12) / 127)
    assert digits.shape == (8, 32) and digits.abs().max() <= 127
    q1, q2 = digits[:4], digits[4:]
    assert ((sx * (q1 + q2 / 254) - x).abs() / sx).max() <= 1 / 508 + 1e-6
    q, s = quantize_int8(torch.randn(24, 32, generator=g))
    exact = (sx * (q1 + q2 / 254)).double() @ dequantize_int8(q, s).double().T
    got = _int_mm_two_digit(x, q, s[:, 0]).double()
    assert ((got - exact).abs().max() / exact.abs().max()).item() < 1e-6


@pytest.mark.parametrize(
    "M, dtype, K, packed",
    [
        (1, torch.bfloat16, 32, True),
        (2, torch.float16, 32, True),
        (3, torch.bfloat16, 32, False),  # more rows than INT8PACK_MAX_ROWS
        (2, torch.float32, 32, False),
        (2, torch.bfloat16, 24, False),  # K not a multiple of 16
    ],
)
def test_int8_weight_matmul_takes_int8pack_for_few_half_rows_else_two_digits(M, dtype, K, packed):
    "Which CPU kernel runs, told apart by their results (they round differently)."
    from hetero_infer.quant.int8_matmul import _int_mm_two_digit

    g = torch.Generator().manual_seed(M * K)
    x = torch.randn(M, K, generator=g).to(dtype)
    q, s = quantize_int8(torch.randn(24, K, generator=g))
    s = s[:, 0]
    two = _int_mm_two_digit(x, q, s).to(dtype)
    got = int8_weight_matmul(x, q, s)
    if packed:
        pack = torch.ops.aten._weight_int8pack_mm(x, q, s.to(dtype))
        assert torch.equal(got, pack) and not torch.equal(pack, two)
    else:
        assert torch.equal(got, two)


@pytest.mark.skipif(
    not {"fbgemm", "onednn"} <= set(torch.backends.quantized.supported_engines),
    reason="a torch build without fbgemm and oneDNN (not x86)",
)
@pytest.mark.parametrize("M", [1, 5])
def test_packed_cpu_paths_equal_the_plain_ones_where_no_pair_sum_saturates(M):
    """fbgemm's and oneDNN's packed GEMMs against `_int_mm`, on any x86 CPU: weights within +-64
    keep every u8 x s8 pair sum within int16 (254 * 64 * 2 < 32767), so even without VNNI the
    packed paths are exact; packing round-trips the weight."""
    from hetero_infer.quant.int8_matmul import (
        _int_mm_two_digit,
        fbgemm_int8_matmul,
        fbgemm_pack,
        fbgemm_unpack,
        onednn_pack,
        onednn_unpack,
        onednn_w8a8_matmul,
    )

    g = torch.Generator().manual_seed(M)
    q = torch.randint(-64, 65, (24, 64), generator=g, dtype=torch.int8)
    s = torch.rand(24, generator=g) / 100 + 1e-3
    x = torch.randn(M, 64, generator=g)
    x[0, :3] = torch.tensor([-2.0, 2.0, 0.5])  # digits at both ends
    fb, dnn = fbgemm_pack(q, s), onednn_pack(q, s)
    assert torch.equal(fbgemm_unpack(fb), q) and torch.equal(onednn_unpack(dnn), q)
    assert torch.allclose(fbgemm_int8_matmul(x, fb), _int_mm_two_digit(x, q, s), atol=1e-5)
    assert torch.allclose(onednn_w8a8_matmul(x, dnn), w8a8_matmul(x, q, s), atol=1e-5)
    pos = x.abs() + 0.1  # no digit reaches -127: the pinned row alone fixes fbgemm's range
    assert torch.allclose(fbgemm_int8_matmul(pos, fb), _int_mm_two_digit(pos, q, s), atol=1e-5)
    for dtype in (torch.bfloat16, torch.float16):
        xh = x.to(dtype)
        assert fbgemm_int8_matmul(xh, fb).dtype == onednn_w8a8_matmul(xh, dnn).dtype == dtype
        assert w8a8_matmul(xh, q, s).dtype == dtype


def test_int8_matmul_specs_name_the_binaries_the_gemm_launches():
    "Two tiles per dtype (decode batches, beyond) from sm_80 on; none on a T4, where it spills."
    from hetero_infer.quant.plugin import int8_matmul_specs

    assert int8_matmul_specs("sm_75", "float16") == []
    for arch, dtype, bk in [("sm_80", "float16", 64), ("sm_90", "float32", 32)]:
        got = [
            (s.kernel, s.dtype, s.arch, s.head_dims, s.constexprs, s.module, s.fn, s.pointers)
            for s in int8_matmul_specs(arch, dtype)
        ]
        assert got == [
            (
                "int8_matmul",
                dtype,
                arch,
                (64,),
                dict(BLOCK_M=bm, BLOCK_N=64, BLOCK_K=bk),
                "hetero_infer.quant.kernels",
                "_int8_weight_matmul_kernel",
                {"qw_ptr": "i8", "wscale_ptr": "fp32"},
            )
            for bm in (16, 64)
        ]


def test_int8_paths_hand_a_gpu_what_its_kernels_need(monkeypatch):
    """On CUDA, weight-only int8 goes to the Triton kernel with its three tensors, and W8A8 pads
    the rows to 17 for `torch._int_mm` (it needs more than 16 there) and returns M rows."""
    import hetero_infer.quant.kernels as quant_kernels

    calls, rows = [], []
    monkeypatch.setattr(quant_kernels, "triton_int8_matmul", lambda *a: calls.append(a) or a[0])
    q, s = quantize_int8(torch.randn(24, 32))
    s = s[:, 0]
    x = torch.randn(3, 32).as_subclass(SaysCuda)
    assert int8_weight_matmul(x, q, s) is x and calls == [(x, q, s)]
    int_mm = torch._int_mm
    monkeypatch.setattr(torch, "_int_mm", lambda a, b: rows.append(a.shape[0]) or int_mm(a, b))
    for M, cuda, padded in [(5, True, 17), (16, True, 17), (17, True, 17), (5, False, 5)]:
        xm = torch.randn(M, 32)
        want = w8a8_matmul(xm, q, s)
        rows.clear()
        got = w8a8_matmul(xm.as_subclass(SaysCuda) if cuda else xm, q, s)
        assert rows == [padded] and got.shape == (M, 24)
        assert torch.equal(got.as_subclass(torch.Tensor), want)


def _small_int8_linear(mode, K=64, N=24, bias=True, seed=0):
    "A quantized layer with weights within +-64 (no u8 x s8 pair sum saturates int16) and `x`."
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(-64, 65, (N, K), generator=g, dtype=torch.int8)
    s = torch.rand(N, generator=g) / 100 + 1e-3
    b = torch.randn(N, generator=g) if bias else None
    return QuantizedLinear.from_quantized(q, s, b, mode, torch.float32), torch.randn(5, K)


@pytest.mark.parametrize("mode", QUANTIZATION_MODES)
def test_layers_pack_on_first_use_where_fbgemm_runs(monkeypatch, mode):
    """Where fbgemm runs exactly (VNNI; faked here, with weights that cannot saturate), a layer
    packs its weight on first use (W8A8 after its check), keeps one copy (a table shared with an
    embedding stays), computes what the plain paths do and counts the packed bytes."""
    import hetero_infer.quant.quantize as quantize

    monkeypatch.setattr(quantize, "fbgemm_available", lambda: False)  # whatever this CPU has
    plain, x = _small_int8_linear(mode)
    want = plain(x)
    assert plain.packed is None and plain.qweight is not None  # the plain path
    monkeypatch.setattr(quantize, "fbgemm_available", lambda: True)
    layer, _ = _small_int8_linear(mode)
    q = layer.qweight.clone()
    before = module_bytes(layer)
    assert torch.allclose(layer(x), want, atol=1e-5) and torch.allclose(layer(x), want, atol=1e-5)
    assert layer.qweight is None and layer.packed is not None
    assert torch.equal(layer.int8_weight(), q)
    assert layer.packed_bytes == 24 * (64 + 4)
    assert module_bytes(layer) == before - 24 * 64 + 24 * (64 + 4)
    emb = QuantizedEmbedding.from_float(nn.Embedding(24, 64))
    head = emb.tied_lm_head(mode)
    head(torch.randn(2, 64))
    assert head.packed is not None and head.qweight is emb.qweight and head.shared
    fell, _ = _small_int8_linear("w8a8")
    fell.max_rel_error = 0.0  # every first-call error passes it: weight-only from then on
    y = fell(x)
    assert fell.fell_back and fell.packed is None and fell.qweight is not None
    assert torch.allclose(y, int8_weight_matmul(x, q, fell.scale) + fell.bias, atol=1e-5)


def test_quantized_layers_load_their_state_dicts_into_empty_layers():
    "The buffers an empty layer is built with have the shapes and dtypes its state dict brings."
    ql, x = _small_int8_linear("w8a8")
    empty = QuantizedLinear(64, 24, bias=True, mode="w8a8", dtype=torch.float32)
    empty.load_state_dict(ql.state_dict())
    assert empty.qweight.dtype == torch.int8 and empty.scale.dtype == torch.float32
    assert torch.equal(empty(x), ql(x))
    emb = QuantizedEmbedding.from_float(nn.Embedding(10, 8))
    empty = QuantizedEmbedding(10, 8, torch.float32)
    empty.load_state_dict(emb.state_dict())
    assert empty.qweight.dtype == torch.int8 and torch.equal(
        empty(torch.arange(10)), emb(torch.arange(10))
    )
    d = QuantizedLinear(8, 4)
    assert (d.mode, d.bias, d.max_rel_error, d.fell_back, d.shared) == (
        "int8",
        None,
        0.05,
        False,
        False,
    )
    assert d.qweight.dtype == torch.int8 and d.qweight.shape == (4, 8) and d.scale.shape == (4,)
    assert (d.bias, d.out_features) == (None, 4) and repr(
        d
    ) == "QuantizedLinear(in=8, out=4, mode=int8)"
    e = QuantizedEmbedding(10, 8)
    assert (e.qweight.shape, e.qweight.dtype, e.scale.shape) == ((10, 8), torch.int8, (10,))


def test_from_quantized_and_from_float_keep_modes_dtypes_and_thresholds():
    q = torch.randint(-127, 128, (4, 8), dtype=torch.int8)
    m = QuantizedLinear.from_quantized(q, torch.ones(4, dtype=torch.bfloat16), torch.ones(4))
    assert (m.mode, m.max_rel_error) == ("int8", 0.05) and m.scale.dtype == torch.float32
    assert m.bias.dtype == torch.bfloat16 and m.qweight is q
    lin = nn.Linear(8, 4).to(torch.float16)
    m = QuantizedLinear.from_float(lin, max_rel_error=0.3)
    assert (m.mode, m.max_rel_error, m.bias.dtype) == ("int8", 0.3, torch.float16)
    assert torch.equal(m.scale, quantize_int8(lin.weight)[1][:, 0])  # per channel
    head = QuantizedEmbedding.from_float(nn.Embedding(4, 8)).tied_lm_head("w8a8", 0.2)
    assert (head.mode, head.max_rel_error, head.bias) == ("w8a8", 0.2, None)
    m = QuantizedLinear.from_float(nn.Linear(8, 4), "w8a8")
    m.rel_error, m.fell_back = 0.125, True
    assert m.extra_repr() == "in=8, out=4, mode=w8a8, fell_back (error 12.5%)"


def test_w8a8_check_measures_relative_error_even_for_small_activations():
    "The first-call error is relative: activations 1000x smaller give the same error."
    lin = nn.Linear(64, 32)
    x = torch.randn(4, 64)
    errors = []
    for k in (1.0, 1e-3):
        m = QuantizedLinear.from_float(lin, "w8a8")
        errors.append(m.check(x * k))
    assert 0 < errors[0] < 0.05 and errors[1] == pytest.approx(errors[0], rel=0.1)
    m = QuantizedLinear.from_float(lin, "w8a8", max_rel_error=errors[0])
    m.check(x)
    assert not m.fell_back  # at the threshold: not past it


def test_int8_scales_default_to_channels_and_groups_of_128():
    w = torch.randn(4, 256)
    assert torch.equal(quantize_int8(w)[1], quantize_int8(w, "channel")[1])
    assert quantize_int8(w, "group")[1].shape == (4, 2)
    assert quantize_int8(w, "group", 1)[1].shape == (4, 256)
    q, s = quantize_int8(w, "group", 64)
    assert (dequantize_int8(q, s) - w).abs().max() <= s.max() / 2 + 1e-6


def test_fp8_given_scales_saturate_and_come_back_in_the_asked_dtype():
    x = torch.tensor([-1000.0, -1.0, 0.5, 1000.0])
    q, s = quantize_fp8(x, torch.tensor(1.0, dtype=torch.float64))
    assert s.dtype == torch.float32 and s.shape == ()
    assert q.float().tolist() == [-FP8_MAX, -1.0, 0.5, FP8_MAX]
    q, s = quantize_fp8(x * 1e-3)
    assert (
        s == pytest.approx(1.0 / FP8_MAX)
        and dequantize_fp8(q, s, torch.bfloat16).dtype == torch.bfloat16
    )


def test_kv_block_bytes_and_blocks_at_equal_memory():
    from hetero_infer.quant.quantize import kv_block_bytes

    assert kv_block_bytes(3, 16, 4, 64, torch.float16) == 2 * 3 * 16 * 4 * 64 * 2
    per = kv_block_bytes(3, 16, 4, 64, FP8_DTYPE)
    assert per == 2 * 3 * 16 * 4 * 64
    assert kv_blocks_at_equal_memory(10 * per + 24, 3, 16, 4, 64, FP8_DTYPE) == 10  # 24: scales
    assert kv_blocks_at_equal_memory(10 * per + 23, 3, 16, 4, 64, FP8_DTYPE) == 9
    assert kv_blocks_at_equal_memory(10 * per - 1, 3, 16, 4, 64, torch.float8_e5m2) == 9
    assert kv_blocks_at_equal_memory(20, 3, 16, 4, 64, FP8_DTYPE) == 0
    assert type(kv_blocks_at_equal_memory(10 * per, 3, 16, 4, 64, torch.float16)) is int


def test_quantize_model_ties_heads_registered_before_their_table_and_skips_by_last_name():
    "Tables are quantized before the heads that share them, whatever the order of the modules."
    from hetero_infer.quant.quantize import QuantizationReport

    model = nn.Module()
    model.a_head = nn.Linear(8, 12, bias=False)  # registered (and named) before its table
    model.z_embed = nn.Embedding(12, 8)
    model.a_head.weight = model.z_embed.weight
    model.inner = nn.Module()
    model.inner.proj = nn.Linear(8, 8)
    model.inner.block = nn.Module()
    model.inner.block.lm_head = nn.Linear(8, 4)
    r = quantize_model(model, "w8a8", skip=("lm_head",), max_rel_error=0.5)
    assert r.tied == {"a_head": "z_embed"} and model.a_head.qweight is model.z_embed.qweight
    assert r.embeddings == {"z_embed": model.z_embed} and isinstance(
        model.z_embed, QuantizedEmbedding
    )
    assert r.skipped == ["inner.block.lm_head"] and type(model.inner.block.lm_head) is nn.Linear
    assert {n: m.max_rel_error for n, m in r.layers.items()} == {"a_head": 0.5, "inner.proj": 0.5}
    assert model.inner.proj is r.layers["inner.proj"] and model.a_head.mode == "w8a8"
    ratio = r.bytes_after / r.bytes_before
    assert repr(r) == (
        f"QuantizationReport(w8a8: 2 layers, 1 embeddings, 1 tied, 1 skipped, 0 fell back; "
        f"bytes {ratio:.3f}x)"
    )
    assert repr(QuantizationReport("int8", bytes_after=2)) == (
        "QuantizationReport(int8: 0 layers, 0 embeddings, 0 tied, 0 skipped, 0 fell back; "
        "bytes 2.000x)"
    )
    with pytest.raises(ValueError, match=r"^quantization must be one of \('int8', 'w8a8'\) to"):
        quantize_model(nn.Linear(2, 2), None)
    with pytest.raises(ValueError, match="quantization must be one of"):
        quantize_model(nn.Linear(2, 2), "int4")


# Mutants of quant/ that `make mutation` leaves alive and no test can kill:
# - int8_matmul: `dim=+1` for `dim=-1` on 2-D activations; `- 128` for `+ 128` before the cast to
#   uint8 (equal mod 256); padding W8A8 at M = 17 (zero rows); an extra zero row beside
#   fbgemm's pinned row; the axis of fbgemm's per-channel weight (its prepack keeps one scale per
#   output row); arguments of the fbgemm and oneDNN calls that equal their defaults.
# - quantize: the fp8 clamp (torch's cast to float8_e4m3fn saturates at +-448 on this build);
#   `_expand` repeating a single scale along the row; `rsplit(".")` and `rsplit(".", 2)` for
#   `rsplit(".", 1)` (the last part either way); `dtype=None` where the value is cast again.
# - plugin: other row counts that give the same two tiles in `int8_matmul_specs`.
