"""Models whose head size is not a power of two (80, 96: Phi-2, StableLM, GPT-NeoX-style) equal
transformers through both attention backends (the Triton one under the interpreter), and the
backend choice follows what the kernels support. (Sliding-window models through both backends:
tests/test_engine.py::test_sliding_window_equals_transformers.)"""

import os
import warnings
import pytest
import torch
from hetero_infer.core.config import EngineConfig
from hetero_infer.model.layers import ModelConfig
from hetero_infer.model.runner import ModelRunner
from hetero_infer.model.loading import attention_backend_for
from hetero_infer.testing import tiny_hf_checkpoint
from test_model import paged_logits

import transformers

transformers.utils.logging.disable_progress_bar()

INTERP = os.environ.get("TRITON_INTERPRET") == "1"


def logits_paged(model, ids, prefill_len, bs=4, num_blocks=16):
    """ids[:prefill_len] as one prefill, then one decode step per further token, over a shuffled
    block table."""
    return paged_logits(model, ids, prefill_len, bs, num_blocks, seed=1)


@pytest.mark.parametrize("family,head_dim", [("llama", 80), ("qwen2", 96)])
@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_non_power_of_two_head_matches_hf(tmp_path, family, head_dim, backend):
    if backend == "triton" and not INTERP and not torch.cuda.is_available():
        pytest.skip("Triton on CPU needs the interpreter")
    hf = tiny_hf_checkpoint(
        tmp_path,
        family,
        hidden_size=2 * head_dim,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=head_dim,
        num_hidden_layers=1,
    )
    r = ModelRunner(
        EngineConfig(model=str(tmp_path), device="cpu", attention_backend=backend, num_blocks=16)
    )
    assert r.model.config.head_dim == head_dim and r.model.backend.name == backend
    ids = torch.randint(0, 256, (11,), generator=torch.Generator().manual_seed(head_dim))
    with torch.no_grad():
        ref = hf(ids[None]).logits[0]
    torch.testing.assert_close(logits_paged(r.model, ids, 8), ref, atol=1e-4, rtol=0)


def test_backend_choice_follows_the_kernels():
    """auto never picks a backend that fails: it falls back to torch with a warning; an explicit
    triton is refused by name."""
    wide = ModelConfig("LlamaForCausalLM", 256, 1280, 512, 1, 4, 4, 320)
    window = ModelConfig(
        "MistralForCausalLM", 256, 64, 128, 1, 4, 2, 16, sliding_window=8, layer_windows=[8]
    )
    dev = "cpu" if INTERP else "cuda"
    with pytest.raises(ValueError, match="head_dim=320"):
        attention_backend_for("triton", wide, torch.float16, dev)
    assert attention_backend_for("torch", wide, torch.float16, "cpu").name == "torch"
    if INTERP or torch.cuda.is_available():  # sliding windows run on the Triton kernels too
        assert attention_backend_for("triton", window, torch.float16, dev).name == "triton"
    if torch.cuda.is_available():  # on CUDA, auto would choose Triton: it must fall back instead
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            assert attention_backend_for("auto", wide, torch.float16, "cuda").name == "torch"
        assert "head_dim=320" in str(w[0].message)
