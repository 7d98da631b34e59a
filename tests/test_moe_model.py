"""Mixture-of-experts checkpoints through `LLM(path)`: greedy output token-identical to
transformers' `generate` for tiny random Qwen3-MoE, Mixtral and Qwen2-MoE models (several prompt
lengths, chunked prefill, prefix caching, preemption; both checkpoint layouts; dense and sparse
layers mixed), and bad checkpoints refused with errors naming the cause before any worker starts."""

import json
import pytest
import torch
from safetensors.torch import load_file, save_file
from hetero_infer.core.sampling_params import SamplingParams
from hetero_infer.engine.llm import LLM
from hetero_infer.model.loading import load_model
from hetero_infer.model.runner import activation_bytes
from hetero_infer.moe.layer import is_moe_layer
from hetero_infer.testing import MOE_TEST_FAMILIES, tiny_hf_checkpoint
from test_engine import hf_greedy, prompts

N_NEW = 12
GREEDY = SamplingParams(temperature=0, max_tokens=N_NEW, ignore_eos=True)
CPU = dict(device="cpu", dtype="float32", block_size=16)
NO_SPECIAL = dict(bos_token_id=None, eos_token_id=None, pad_token_id=None)


def _run(path, ps, **kw):
    llm = LLM(str(path), **CPU, **kw)
    try:
        return [o.outputs[0].token_ids for o in llm.generate(ps, GREEDY, use_tqdm=False)]
    finally:
        llm.close()


@pytest.fixture(scope="module", params=list(MOE_TEST_FAMILIES))
def moe_ckpt(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    return path, tiny_hf_checkpoint(path, request.param, **NO_SPECIAL)


def test_greedy_equals_transformers(moe_ckpt):
    path, hf = moe_ckpt
    ps = prompts((3, 17, 40, 9))
    assert _run(path, ps) == [hf_greedy(hf, p, N_NEW)[0] for p in ps]


def test_chunked_prefill_prefix_caching_and_preemption(moe_ckpt):
    path, hf = moe_ckpt
    shared = prompts((32,), seed=3)[0]
    ps = [shared + p for p in prompts((5, 9, 13, 2), seed=4)] + prompts((30,), seed=5)
    kw = dict(max_num_batched_tokens=32, num_blocks=8, max_num_seqs=4, enable_prefix_caching=True)
    llm = LLM(str(path), **CPU, **kw)  # tight: forces chunks and preemption
    long = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    try:
        outs = llm.generate(ps, long, use_tqdm=False)
        stats = llm.engine.stats
    finally:
        llm.close()
    assert [o.outputs[0].token_ids for o in outs] == [hf_greedy(hf, p, 24)[0] for p in ps]
    assert stats["preemptions"] > 0 and stats["prefix_cache"]["cache_hits"] > 0, stats


def test_a_wrong_expert_changes_the_tokens(tmp_path):
    "The test checkpoints can catch routing bugs: swapping two experts' weights changes the output."
    hf = tiny_hf_checkpoint(tmp_path, "qwen3_moe", **NO_SPECIAL)
    ps = prompts((9, 17))
    want = [hf_greedy(hf, p, N_NEW)[0] for p in ps]
    sd = load_file(tmp_path / "model.safetensors")
    for layer in range(2):
        for proj in ("gate_proj", "up_proj", "down_proj"):
            a, b = (f"model.layers.{layer}.mlp.experts.{e}.{proj}.weight" for e in (0, 1))
            sd[a], sd[b] = sd[b], sd[a]
    save_file(sd, tmp_path / "model.safetensors", metadata={"format": "pt"})
    assert _run(tmp_path, ps) != want


def test_the_fused_layout_loads_the_same_model(tmp_path):
    hf = tiny_hf_checkpoint(tmp_path / "fused", "qwen3_moe", fused=True, **NO_SPECIAL)
    tiny_hf_checkpoint(tmp_path / "per_expert", "qwen3_moe", **NO_SPECIAL)  # the same seed
    a, b = load_model(tmp_path / "fused"), load_model(tmp_path / "per_expert")
    for (n, p), (_, q) in zip(a.named_parameters(), b.named_parameters(), strict=True):
        assert torch.equal(p, q), n
    ps = prompts((5, 21))
    assert _run(tmp_path / "fused", ps) == [hf_greedy(hf, p, N_NEW)[0] for p in ps]


@pytest.mark.parametrize(
    "family, kw",
    [
        ("qwen3_moe", dict(num_hidden_layers=4, decoder_sparse_step=2)),  # layers 1 and 3 sparse
        ("qwen2_moe", dict(num_hidden_layers=3, mlp_only_layers=[0, 2])),  # layer 1 sparse
    ],
)
def test_dense_and_sparse_layers_mixed(family, kw, tmp_path):
    hf = tiny_hf_checkpoint(tmp_path, family, **kw, **NO_SPECIAL)
    sparse = [hasattr(layer.mlp, "experts") for layer in hf.model.layers]
    assert any(sparse) and not all(sparse)
    m = load_model(tmp_path)
    assert [is_moe_layer(m.config.hf_config, i) for i in range(m.config.num_layers)] == sparse
    assert [type(layer.mlp).__name__ == "MoEBlock" for layer in m.layers] == sparse
    ps = prompts((7, 25))
    assert _run(tmp_path, ps) == [hf_greedy(hf, p, N_NEW)[0] for p in ps]


def _edit(path, drop=(), add=None, **config):
    "Remove / add checkpoint tensors, change config fields."
    sd = load_file(path / "model.safetensors")
    for n in drop:
        del sd[n]
    sd.update(add or {})
    save_file(sd, path / "model.safetensors", metadata={"format": "pt"})
    d = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**d, **config}))


def test_a_missing_expert_tensor_is_named(tmp_path):
    tiny_hf_checkpoint(tmp_path, "mixtral")
    _edit(tmp_path, drop=["model.layers.1.block_sparse_moe.experts.5.w2.weight"])
    with pytest.raises(ValueError, match=r"lacks MoE tensors .*layers\.1\..*experts\.5\.w2"):
        LLM(str(tmp_path), **CPU)


def test_more_experts_than_the_config_says_is_named(tmp_path):
    tiny_hf_checkpoint(tmp_path, "qwen3_moe")
    _edit(tmp_path, num_experts=7, num_local_experts=7)  # the file holds 8
    with pytest.raises(ValueError, match=r"does not use: .*experts\.7\."):
        LLM(str(tmp_path), **CPU)


def test_a_fused_checkpoint_of_another_shape_is_named(tmp_path):
    tiny_hf_checkpoint(tmp_path, "qwen3_moe", fused=True)
    _edit(tmp_path, num_experts=4, num_local_experts=4)  # the file holds 8 experts
    with pytest.raises(ValueError, match=r"gate\.weight: shape \(8, 64\), the config says \(4"):
        LLM(str(tmp_path), **CPU)
    _edit(tmp_path, num_experts=8, num_local_experts=8, moe_intermediate_size=16)  # file: 32
    with pytest.raises(ValueError, match=r"experts\.gate_up_proj: shape \(8, 64, 64\), the con"):
        LLM(str(tmp_path), **CPU)


@pytest.mark.parametrize(
    "family, config, field",
    [
        ("qwen3_moe", {"num_experts_per_tok": True}, "num_experts_per_tok"),
        ("mixtral", {"num_experts_per_tok": 2.0}, "num_experts_per_tok"),
        ("qwen3_moe", {"decoder_sparse_step": 0}, "decoder_sparse_step"),
        ("qwen2_moe", {"decoder_sparse_step": "2"}, "decoder_sparse_step"),
        ("qwen3_moe", {"mlp_only_layers": [True, "1"]}, "mlp_only_layers"),
        ("qwen2_moe", {"shared_expert_intermediate_size": -1}, "shared_expert_intermediate_size"),
    ],
)
def test_a_moe_config_field_of_the_wrong_type_is_refused_at_load(tmp_path, family, config, field):
    "Refused when the model is built, naming the field: never a TypeError at the first request."
    tiny_hf_checkpoint(tmp_path, family)
    _edit(tmp_path, **config)
    with pytest.raises(ValueError, match=f"^{field} must be"):
        LLM(str(tmp_path), **CPU)


def test_an_expert_count_the_ep_size_does_not_divide_is_refused_before_spawning(tmp_path):
    tiny_hf_checkpoint(tmp_path, "qwen3_moe", num_experts=6)
    with pytest.raises(ValueError, match=r"num_experts \(6\) is not divisible .* \(4 = "):
        LLM(str(tmp_path), **CPU, tensor_parallel_size=4, enable_expert_parallel=True)


def test_expert_parallel_is_refused_for_a_dense_model(tmp_path):
    tiny_hf_checkpoint(tmp_path, "llama")
    for tp in (1, 2):
        with pytest.raises(ValueError, match="no mixture-of-experts layers"):
            LLM(str(tmp_path), **CPU, tensor_parallel_size=tp, enable_expert_parallel=True)


def test_quantization_is_refused_for_moe_models(tmp_path):
    "quantize_model would turn the routers to int8 and leave the experts in float: not yet."
    tiny_hf_checkpoint(tmp_path, "qwen3_moe")
    with pytest.raises(ValueError, match="quantization='int8' is not supported for mixture-of"):
        LLM(str(tmp_path), **CPU, quantization="int8")


def test_the_profile_counts_the_experts_working_memory(tmp_path):
    tiny_hf_checkpoint(tmp_path, "qwen3_moe", mlp_only_layers=[0])  # layer 0 dense, 1 sparse
    llm = LLM(str(tmp_path), **CPU, max_num_batched_tokens=64)
    try:
        runner = llm.engine.runner
        with_moe = activation_bytes(runner.model, runner.config, torch.float32)
        sparse = runner.model.layers[1].mlp
        runner.model.layers[1].mlp = runner.model.layers[0].mlp  # the dense MLP everywhere
        dense = activation_bytes(runner.model, runner.config, torch.float32)
        runner.model.layers[1].mlp = sparse
    finally:
        llm.close()
    # the widest layer: T * k * (3 I + 2 H) float32 values, not the dense MLP's T * 3 * 128
    assert with_moe - dense == 64 * (2 * (3 * 32 + 2 * 64) - 3 * 128) * 4
