"""The Llama-family model against transformers on tiny random-weight checkpoints of every family
(CPU, fp32)."""

import inspect
import json
import os
import random
from types import SimpleNamespace as NS
import pytest
import torch
from hetero_infer.attention.backend import AttentionMetadata, get_attention_backend
from hetero_infer.core.config import DTYPE_ALIASES, EngineConfig
from hetero_infer.core.sequence import Sequence
from hetero_infer.model.runner import ModelRunner
from hetero_infer.model.loading import checkpoint_files, dtype_name, load_model, parse_config
from hetero_infer.model.layers import rope_inv_freq
from hetero_infer.testing import FAMILIES, tiny_hf_checkpoint

import transformers

transformers.utils.logging.disable_progress_bar()

ATOL = 1e-4
LLAMA3 = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 32,
}


@pytest.fixture(scope="module", params=list(FAMILIES))
def ckpt(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    return request.param, path, tiny_hf_checkpoint(path, request.param, seed=1)


def hf_logits(hf, ids):  # (L,) -> (L, vocab)
    with torch.no_grad():
        return hf(torch.as_tensor(ids)[None]).logits[0]


def paged_logits(model, ids, prefill_len, bs=4, num_blocks=24, seed=0):
    """ids[:prefill_len] as one prefill, then one decode step per further token, over a shuffled
    block table."""
    c = model.config
    caches = [
        tuple(torch.zeros(num_blocks, bs, c.num_kv_heads, c.head_dim) for _ in "kv")
        for _ in range(c.num_layers)
    ]
    table = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(seed))[
        : -(-len(ids) // bs)
    ].tolist()
    out = []
    with torch.inference_mode():
        meta = AttentionMetadata.build([prefill_len], [prefill_len], [table], bs)
        out.append(
            model.compute_logits(model(ids[:prefill_len], torch.arange(prefill_len), caches, meta))
        )
        for t in range(prefill_len, len(ids)):
            meta = AttentionMetadata.build([t + 1], [1], [table], bs)
            out.append(model.compute_logits(model(ids[t : t + 1], torch.tensor([t]), caches, meta)))
    return torch.cat(out)


def rand_ids(n, seed=0):
    return torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(seed))


# --- equality with transformers


@pytest.mark.parametrize("prefill_len", [1, 13])
def test_prefill_then_decode_matches_hf(ckpt, prefill_len):
    family, path, hf = ckpt
    ids = rand_ids(17)
    ours = paged_logits(load_model(path), ids, prefill_len, seed=prefill_len)
    torch.testing.assert_close(ours, hf_logits(hf, ids), atol=ATOL, rtol=0)
    assert ours.dtype == torch.float32


@pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1",
    reason="Triton kernels on CPU tensors need the interpreter",
)
def test_triton_backend_under_interpreter(tmp_path):
    hf = tiny_hf_checkpoint(tmp_path, "qwen3")
    r = ModelRunner(
        EngineConfig(model=str(tmp_path), device="cpu", attention_backend="triton", num_blocks=8)
    )
    assert r.model.backend.name == "triton"
    ids = rand_ids(10)
    torch.testing.assert_close(paged_logits(r.model, ids, 7), hf_logits(hf, ids), atol=ATOL, rtol=0)


class Hand:
    """Blocks from a shuffled free list and slots from the block tables: enough scheduling to drive
    a ModelRunner."""

    def __init__(self, runner, seed=0):
        self.r, self.free = runner, list(range(runner.num_blocks))
        random.Random(seed).shuffle(self.free)

    def step(self, items, copies=()):  # [(seq, num_tokens)] -> logits of the sequences that sample
        bs, sched = self.r.block_size, []
        for seq, n in items:
            c = seq.num_computed_tokens
            while len(seq.block_table) * bs < c + n:
                seq.block_table.append(self.free.pop())
            slots = [seq.block_table[p // bs] * bs + p % bs for p in range(c, c + n)]
            last = int(c + n == len(seq))  # the scheduler's num_logits: 1 when the chunk ends it
            sched.append(NS(seq=seq, num_tokens=n, slot_mapping=slots, num_logits=last))
        logits = self.r.execute(NS(scheduled=sched, block_copies=list(copies)))
        for seq, n in items:
            seq.num_computed_tokens += n
        return logits


def test_runner_mixed_steps_match_hf(ckpt):
    """Decodes and prefill chunks of several sequences in one flat batch: each sampled row equals
    HF's last-token logits."""
    family, path, hf = ckpt
    r = ModelRunner(EngineConfig(model=str(path), block_size=4, num_blocks=40, device="cpu"))
    prompts = [rand_ids(n, seed=n).tolist() for n in (9, 3, 6, 1)]
    seqs = [Sequence(i, str(i), p, len(p)) for i, p in enumerate(prompts)]
    h = Hand(r)
    plan = [
        [(seqs[0], 5), (seqs[1], 3)],  # seq 0 chunk 1 (no sample), seq 1 whole
        [(seqs[1], 1), (seqs[0], 4), (seqs[2], 2)],  # a decode, seq 0 chunk 2, seq 2 chunk 1
        [
            (seqs[0], 1),
            (seqs[1], 1),
            (seqs[2], 4),
            (seqs[3], 1),
        ],  # decodes, seq 2 chunk 2, a 1-token prompt
        [(s, 1) for s in seqs],
        [(s, 1) for s in seqs],
    ]
    for items in plan:
        samplers = [s for s, n in items if s.num_computed_tokens + n == len(s)]
        logits = h.step(items)
        assert logits.shape == (len(samplers), 256)
        for s, row in zip(samplers, logits):
            torch.testing.assert_close(row, hf_logits(hf, s.token_ids)[-1], atol=ATOL, rtol=0)
            s.append_token(int(row.argmax()))
    for s in seqs:
        want = hf.generate(
            torch.tensor([s.prompt_token_ids]), max_new_tokens=s.num_output_tokens, do_sample=False
        )[0].tolist()
        assert s.token_ids == want


def test_copy_on_write_fork(tmp_path):
    """Two sequences share a partly filled prompt block; the fork copies it before writing its own
    token there."""
    hf = tiny_hf_checkpoint(tmp_path, "qwen3")
    r = ModelRunner(EngineConfig(model=str(tmp_path), block_size=4, num_blocks=16, device="cpu"))
    parent = Sequence(0, "a", rand_ids(6).tolist(), 6)
    h = Hand(r)
    parent.append_token(int(h.step([(parent, 6)])[0].argmax()))
    child = parent.fork(1, 1)
    child.block_table = list(parent.block_table)  # shares both blocks
    child.token_ids[-1] = (child.token_ids[-1] + 1) % 256  # a different sampled token
    new = h.free.pop()
    src = child.block_table[1]
    child.block_table[1] = new  # block 1 (positions 4..7) is partly filled
    logits = h.step([(parent, 1), (child, 1)], copies=[(src, new)])
    for s, row in zip((parent, child), logits):
        torch.testing.assert_close(row, hf_logits(hf, s.token_ids)[-1], atol=ATOL, rtol=0)


def test_runner_nothing_samples_and_empty_step(tmp_path):
    tiny_hf_checkpoint(tmp_path, "llama")
    r = ModelRunner(EngineConfig(model=str(tmp_path), block_size=4, num_blocks=8))
    s = Sequence(0, "a", list(range(10)), 10)
    assert Hand(r).step([(s, 4)]).shape == (0, 256)
    assert r.execute(NS(scheduled=[], block_copies=[])).shape == (0, 256)


def test_sharded_checkpoint_equals_single_file(tmp_path):
    tiny_hf_checkpoint(tmp_path / "one", "mistral", seed=3)
    tiny_hf_checkpoint(tmp_path / "many", "mistral", seed=3, max_shard_size="30KB")
    assert len(checkpoint_files(tmp_path / "many")) > 2
    a, b = load_model(tmp_path / "one"), load_model(tmp_path / "many")
    for (n, p), (m, q) in zip(a.named_parameters(), b.named_parameters()):
        assert n == m and torch.equal(p, q)


@pytest.mark.parametrize("family", ["llama", "qwen2"])
@pytest.mark.parametrize("scaling", [LLAMA3, {"rope_type": "linear", "factor": 4.0}])
def test_rope_scaling_and_tied_embeddings_match_hf(tmp_path, family, scaling):
    hf = tiny_hf_checkpoint(
        tmp_path, family, rope_scaling=scaling, rope_theta=5e5, tie_word_embeddings=True
    )
    m = load_model(tmp_path)
    assert (
        m.config.rope_scaling["rope_type"] == scaling["rope_type"] and m.config.tie_word_embeddings
    )
    assert m.lm_head.weight is m.embed_tokens.weight
    ids = rand_ids(40)  # past original_max_position_embeddings (32)
    ref = hf_logits(hf, ids)
    torch.testing.assert_close(paged_logits(m, ids, 36), ref, atol=ATOL, rtol=0)
    m.inv_freq = rope_inv_freq(m.config.head_dim, 5e5)  # without the scaling the test must fail
    assert (paged_logits(m, ids, 40) - ref).abs().max() > 1e-3


def test_transformers4_config_layout(tmp_path):
    "rope_theta at the top and rope_scaling with `type`, as transformers 4.x wrote them."
    hf = tiny_hf_checkpoint(tmp_path, "llama", rope_scaling=LLAMA3, rope_theta=5e5)
    d = json.loads((tmp_path / "config.json").read_text())
    rp = d.pop("rope_parameters")
    d["rope_theta"] = rp.pop("rope_theta")
    rp["type"] = rp.pop("rope_type")
    d["rope_scaling"] = rp
    (tmp_path / "config.json").write_text(json.dumps(d))
    ids = rand_ids(20)
    torch.testing.assert_close(
        paged_logits(load_model(tmp_path), ids, 20), hf_logits(hf, ids), atol=ATOL, rtol=0
    )


@pytest.mark.parametrize("head_dim,theta", [(16, 1e4), (64, 5e5), (128, 5e5), (128, 1e6)])
@pytest.mark.parametrize(
    "scaling",
    [
        None,
        {"rope_type": "linear", "factor": 2.0},
        {**LLAMA3, "original_max_position_embeddings": 8192},
        {**LLAMA3, "factor": 32.0},
    ],
)
def test_rope_inv_freq_matches_transformers(head_dim, theta, scaling):
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    cfg = LlamaConfig(
        hidden_size=head_dim * 4,
        num_attention_heads=4,
        rope_theta=theta,
        rope_scaling=dict(scaling) if scaling else None,
    )  # HF edits the dict
    fn = ROPE_INIT_FUNCTIONS[scaling["rope_type"]] if scaling else None
    want = fn(cfg)[0] if fn else 1.0 / theta ** (torch.arange(0, head_dim, 2).float() / head_dim)
    torch.testing.assert_close(rope_inv_freq(head_dim, theta, scaling), want, atol=0, rtol=1e-6)


def test_bfloat16_load_close_to_hf_bf16(tmp_path):
    hf = tiny_hf_checkpoint(tmp_path, "qwen2").to(torch.bfloat16)
    m = load_model(tmp_path, "bfloat16")
    assert {p.dtype for p in m.parameters()} == {torch.bfloat16}
    ids = rand_ids(12)
    ours, ref = paged_logits(m, ids, 8).float(), hf_logits(hf, ids).float()
    assert (ours - ref).abs().max() < 0.1 * ref.abs().max()


# --- runner set-up


def test_runner_sizes_and_limits(tmp_path):
    tiny_hf_checkpoint(tmp_path, "mistral")
    r = ModelRunner(
        EngineConfig(
            model=str(tmp_path), block_size=16, max_num_seqs=8, max_model_len=64, device="cpu"
        )
    )  # the CPU budget and backend, on any machine
    assert r.max_model_len == 64
    assert r.num_blocks == 8 * 4 and r.kv_caches[0][0].shape == (32, 16, 2, 16)
    assert r.model.backend.name == "cpp" and r.dtype == torch.float32  # auto on CPU
    with pytest.raises(ValueError, match=r"max_model_len \(1000\) exceeds"):
        ModelRunner(EngineConfig(model=str(tmp_path), max_model_len=1000, device="cpu"))


def _takes_window(backend):
    return all(
        "window" in inspect.signature(getattr(backend, m)).parameters
        for m in ("forward", "decode", "prefill")
    )


def test_sliding_window_does_not_cap_max_model_len(tmp_path):
    """A window of 64 no longer caps max_model_len at 64 (the backend attends over the window); a
    backend without windows is refused."""
    tiny_hf_checkpoint(tmp_path, "mistral", sliding_window=64)
    if not _takes_window(get_attention_backend("torch")):
        with pytest.raises(ValueError, match="does not support sliding windows.*sliding_window=64"):
            ModelRunner(EngineConfig(model=str(tmp_path)))
        pytest.skip("the torch backend takes no window= yet")
    r = ModelRunner(EngineConfig(model=str(tmp_path), block_size=16, max_num_seqs=8, device="cpu"))
    assert r.max_model_len == 512 and r.model.config.layer_windows == [64, 64]
    assert [l.self_attn.window for l in r.model.layers] == [64, 64]


# --- activations and config fields


@pytest.mark.parametrize(
    "family,act",
    [("llama", "gelu"), ("llama", "gelu_new"), ("qwen3", "gelu_pytorch_tanh"), ("mistral", "relu")],
)
def test_activation_matches_hf(tmp_path, family, act):
    """hidden_act is honoured: a GELU/ReLU checkpoint gives transformers' logits (it used to run
    SiLU regardless)."""
    hf = tiny_hf_checkpoint(tmp_path, family, hidden_act=act)
    ids = rand_ids(15, seed=4)
    torch.testing.assert_close(
        paged_logits(load_model(tmp_path), ids, 11), hf_logits(hf, ids), atol=ATOL, rtol=0
    )


@pytest.mark.parametrize(
    "field,value",
    [
        ("hidden_act", "quick_gelu"),
        ("hidden_act", "gelu_fast"),
        ("attn_logit_softcapping", 50.0),
        ("final_logit_softcapping", 30.0),
        ("partial_rotary_factor", 0.5),
    ],
)
def test_unsupported_config_field_is_refused_by_name(tmp_path, field, value):
    tiny_hf_checkpoint(tmp_path, "llama")
    d = json.loads((tmp_path / "config.json").read_text())
    d[field] = value
    (tmp_path / "config.json").write_text(json.dumps(d))
    with pytest.raises(ValueError, match=f"unsupported {field}"):
        load_model(tmp_path)


def test_bias_fields_follow_transformers():
    """attention_bias: all four projections for Llama/Qwen3, ignored by Mistral; Qwen2 always q/k/v
    only; mlp_bias only for Llama."""
    base = dict(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        attention_bias=True,
        mlp_bias=True,
    )
    got = {
        a: (lambda c: (c.qkv_bias, c.o_bias, c.mlp_bias))(
            parse_config({**base, "architectures": [a]})
        )
        for a in ("LlamaForCausalLM", "Qwen3ForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")
    }
    assert got == {
        "LlamaForCausalLM": (True, True, True),
        "Qwen3ForCausalLM": (True, True, False),
        "MistralForCausalLM": (False, False, False),
        "Qwen2ForCausalLM": (True, False, False),
    }


@pytest.mark.parametrize(
    "family,kw",
    [
        ("mistral", dict(sliding_window=7)),
        ("mistral", dict(sliding_window=None)),
        ("qwen2", dict(use_sliding_window=True, sliding_window=7, max_window_layers=1)),
        ("qwen2", dict(use_sliding_window=False, sliding_window=7)),
        (
            "qwen3",
            dict(
                use_sliding_window=True,
                sliding_window=5,
                layer_types=["sliding_attention", "full_attention"],
            ),
        ),
    ],
)
def test_layer_windows_follow_transformers(tmp_path, family, kw):
    "Our per-layer windows equal the sliding_window each transformers attention layer uses."
    hf = tiny_hf_checkpoint(tmp_path, family, **kw)
    c = parse_config(json.loads((tmp_path / "config.json").read_text()))
    want = [
        getattr(l.self_attn, "sliding_window", None)
        if family != "mistral"
        else hf.config.sliding_window
        for l in hf.model.layers
    ]
    assert (c.layer_windows or [None] * c.num_layers) == want


# --- errors


def _copy(src, dst, skip=()):
    dst.mkdir()
    for f in src.iterdir():
        if f.name not in skip:
            (dst / f.name).write_bytes(f.read_bytes())
    return dst


def test_every_dtype_spelling_core_knows(tmp_path):
    "The model reads dtype spellings from core's one table: what EngineConfig accepts, it loads."
    for spelling, name in DTYPE_ALIASES.items():
        assert dtype_name(spelling) == name
        assert EngineConfig(dtype=spelling).dtype == name
    tiny_hf_checkpoint(tmp_path, "llama")
    assert load_model(tmp_path, "bf16").embed_tokens.weight.dtype == torch.bfloat16
    assert load_model(tmp_path, "fp16").embed_tokens.weight.dtype == torch.float16
    with pytest.raises(ValueError, match="dtype must be float32, float16 or bfloat16"):
        dtype_name("fp8")


def test_unsupported_architecture(tmp_path):
    tiny_hf_checkpoint(tmp_path, "llama")
    d = json.loads((tmp_path / "config.json").read_text())
    d["architectures"] = ["GPTNeoXForCausalLM"]
    (tmp_path / "config.json").write_text(json.dumps(d))
    with pytest.raises(
        ValueError,
        match="unsupported architecture 'GPTNeoXForCausalLM'.*supported: LlamaForCausalLM, "
        "MistralForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM",
    ):
        load_model(tmp_path)
    with pytest.raises(ValueError, match="unsupported rope_type 'yarn'"):
        parse_config(
            {
                **d,
                "architectures": ["LlamaForCausalLM"],
                "rope_parameters": {"rope_type": "yarn", "factor": 4.0},
            }
        )


def test_missing_shard_with_and_without_index(tmp_path):
    tiny_hf_checkpoint(tmp_path / "src", "qwen2", max_shard_size="30KB")
    shards = checkpoint_files(tmp_path / "src")
    gone = shards[-1].name
    d = _copy(tmp_path / "src", tmp_path / "a", skip={gone})
    with pytest.raises(FileNotFoundError, match=f"checkpoint shard {gone} is missing"):
        load_model(d)
    d = _copy(tmp_path / "src", tmp_path / "b", skip={gone, "model.safetensors.index.json"})
    with pytest.raises(FileNotFoundError, match=f"checkpoint shard {gone} is missing"):
        load_model(d)


@pytest.mark.parametrize("cut", [5, 3000, -100])
def test_corrupt_shard_names_the_file(tmp_path, cut):
    tiny_hf_checkpoint(tmp_path / "src", "llama", max_shard_size="30KB")
    victim = checkpoint_files(tmp_path / "src")[1]
    d = _copy(tmp_path / "src", tmp_path / "d")
    data = victim.read_bytes()
    (d / victim.name).write_bytes(data[:cut])
    with pytest.raises(ValueError, match=f"checkpoint shard {victim.name} is corrupt"):
        load_model(d)


def test_pickle_only_is_refused(tmp_path):
    hf = tiny_hf_checkpoint(tmp_path / "src", "llama")
    d = tmp_path / "bin"
    d.mkdir()
    (d / "config.json").write_text((tmp_path / "src" / "config.json").read_text())
    torch.save(hf.state_dict(), d / "pytorch_model.bin")
    with pytest.raises(
        ValueError, match=r"only pickle weights \(pytorch_model.bin\).*safetensors only"
    ):
        load_model(d)
    (d / "pytorch_model.bin").unlink()
    with pytest.raises(FileNotFoundError, match="no \\*.safetensors"):
        load_model(d)
    with pytest.raises(FileNotFoundError, match="no config.json"):
        load_model(tmp_path)


def test_missing_and_unexpected_weights(tmp_path):
    from safetensors.torch import load_file, save_file

    tiny_hf_checkpoint(tmp_path / "src", "qwen3")
    sd = load_file(tmp_path / "src" / "model.safetensors")
    d = _copy(tmp_path / "src", tmp_path / "miss")
    save_file(
        {k: v for k, v in sd.items() if k != "model.layers.1.mlp.up_proj.weight"},
        d / "model.safetensors",
    )
    with pytest.raises(ValueError, match="lacks weights: model.layers.1.mlp.up_proj.weight"):
        load_model(d)
    d = _copy(tmp_path / "src", tmp_path / "extra")
    save_file(
        {
            **sd,
            "model.layers.2.mlp.up_proj.weight": sd["model.layers.1.mlp.up_proj.weight"].clone(),
        },
        d / "model.safetensors",
    )
    with pytest.raises(ValueError, match="does not use: model.layers.2.mlp.up_proj.weight"):
        load_model(d)
    d = _copy(tmp_path / "src", tmp_path / "shape")
    save_file({**sd, "model.norm.weight": torch.ones(65)}, d / "model.safetensors")
    with pytest.raises(ValueError, match=r"weight norm.weight has shape \(65,\)"):
        load_model(d)
    with pytest.raises(ValueError, match="dtype must be float32, float16 or bfloat16"):
        load_model(tmp_path / "src", "int8")
    assert load_model(tmp_path / "src", "half").embed_tokens.weight.dtype == torch.float16


def test_with_block_manager_fork_and_prefix_cache(tmp_path):
    """The runner over the real BlockManager: copy-on-write after a fork, then a prefix-cache hit,
    all equal to HF."""
    from hetero_infer.kv_cache.block_manager import BlockManager

    hf = tiny_hf_checkpoint(tmp_path, "llama")
    r = ModelRunner(EngineConfig(model=str(tmp_path), block_size=4, num_blocks=16, device="cpu"))
    bm = BlockManager(16, 4, enable_prefix_caching=True)

    def run(seqs_n):
        items = []
        for s, n in seqs_n:
            slots, copies = bm.append_slots(s, n)
            last = int(s.num_computed_tokens + n == len(s))
            items.append((NS(seq=s, num_tokens=n, slot_mapping=slots, num_logits=last), copies))
        logits = r.execute(
            NS(scheduled=[i for i, _ in items], block_copies=[c for _, cs in items for c in cs])
        )
        for s, n in seqs_n:
            bm.commit(s, n)  # the step completed: advance, publish full blocks
        for s, row in zip([s for s, _ in seqs_n if s.num_computed_tokens == len(s)], logits):
            torch.testing.assert_close(row, hf_logits(hf, s.token_ids)[-1], atol=ATOL, rtol=0)
        return [items, logits]

    prompt = rand_ids(6, seed=5).tolist()
    parent = Sequence(0, "a", prompt, 6)
    bm.allocate(parent)
    _, logits = run([(parent, 6)])
    parent.append_token(int(logits[0].argmax()))
    child = parent.fork(1, 1)
    bm.fork(parent, child)
    child.token_ids[-1] = (child.token_ids[-1] + 7) % 256
    items, _ = run([(parent, 1), (child, 1)])
    assert sum(len(cs) for _, cs in items) == 1  # the shared, partly filled block was copied once
    again = Sequence(2, "b", prompt + [9, 9], 8)
    bm.allocate(again)
    assert again.num_computed_tokens == 4  # the first full block came from the prefix cache
    run([(again, 4)])


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_blocked_cpu_kernel_matches_hf(tmp_path, dtype):
    "Projections big enough for 05a's CPU kernel: fp32 logits and greedy picks as HF's, bf16 close."
    from hetero_infer.model.cpu_gemm import BlockedLinear, cpu_gemm_op
    from hetero_infer.model.layers import pack_linears

    if cpu_gemm_op(torch.float32) is None:
        pytest.skip(f"the kernel cannot run here: {cpu_gemm_op.__module__} says why in its log")
    big = dict(hidden_size=512, intermediate_size=1024, num_attention_heads=8, vocab_size=1024)
    hf = tiny_hf_checkpoint(tmp_path, "qwen2", **big).to(getattr(torch, dtype))
    m = load_model(tmp_path, dtype)
    assert pack_linears(m, make=BlockedLinear) == 4 * 2 + 1  # every projection and the lm_head
    ids = rand_ids(12)
    ours, ref = paged_logits(m, ids, 8).float(), hf_logits(hf, ids).float()
    if dtype == "float32":
        torch.testing.assert_close(ours, ref, atol=1e-4, rtol=1e-4)
        assert torch.equal(ours.argmax(-1), ref.argmax(-1))
    else:
        assert (ours - ref).abs().max() < 0.1 * ref.abs().max()
