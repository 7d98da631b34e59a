"""A tiny DeepSeek-V3 (18_multi_head_latent_attention) with the features of the other chapters:
structured outputs through `LLM`, the CLI's `generate --choice` and the server's `guided_choice`
(with the demo model's tokenizer, sampled at temperature 1 so that only the grammar's mask makes
an output valid), and expert parallelism over two ranks equal to transformers' greedy tokens."""

import json
import re
import shutil
import urllib.request
from pathlib import Path

import pytest

import hetero_infer.mla.model  # registers the DeepSeek family in this process
from hetero_infer.core.config import DEMO_MODEL_DIR, EngineConfig
from hetero_infer.core.sampling_params import SamplingParams
from hetero_infer.engine.llm import LLM
from hetero_infer.engine.llm_engine import LLMEngine
from hetero_infer.mla.testing import tiny_deepseek_checkpoint
from test_engine import hf_greedy, prompts

pytest.importorskip("xgrammar")
from hetero_infer.structured.grammar import StructuredOutputsParams  # noqa: E402

CPU = dict(device="cpu", dtype="float32", block_size=16)
TOKENIZER = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")
CHOICES = ["yes", "no", "maybe"]
REGEX = r"[0-9]{3}-[a-c]{2}"


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    "A tiny V3 with the demo model's byte-level tokenizer (297 ids), so text goes in and out."
    path = tmp_path_factory.mktemp("v3_text")
    hf = tiny_deepseek_checkpoint(
        path, "v3", vocab_size=297, bos_token_id=1, eos_token_id=2, initializer_range=0.2
    )
    for name in TOKENIZER:
        shutil.copy(DEMO_MODEL_DIR / name, path / name)
    return path, hf


def test_structured_outputs_through_llm(model):
    llm = LLM(str(model[0]), **CPU, seed=0)
    try:
        so = [StructuredOutputsParams(choice=CHOICES), StructuredOutputsParams(regex=REGEX)] * 3
        params = [
            SamplingParams(temperature=1.0, seed=i, max_tokens=16, structured_outputs=s)
            for i, s in enumerate(so)
        ]
        outs = llm.generate(["the answer is"] * len(so), params, use_tqdm=False)
    finally:
        llm.close()
    texts = [o.outputs[0].text for o in outs]
    assert all(t in CHOICES for t in texts[0::2]), texts
    assert all(re.fullmatch(REGEX, t) for t in texts[1::2]), texts


def test_the_cli_generates_with_a_choice(model, capsys):
    from hetero_infer.cli.main import main

    argv = ["generate", "--model", str(model[0]), "--device", "cpu", "--dtype", "float32"]
    argv += ["--temperature", "1", "--max-tokens", "8", "--json", "--choice", *CHOICES]  # last:
    # --choice takes every word after it
    assert main(argv + ["--input", "is it?", "--input", "or not?"]) == 0
    lines = [json.loads(l) for l in capsys.readouterr().out.splitlines() if l.startswith("{")]
    assert [l["prompt"] for l in lines] == ["is it?", "or not?"]
    assert all(c in CHOICES for l in lines for c in l["completions"]), lines


def test_the_server_answers_a_guided_choice(model):
    from hetero_infer.server.app import build_app
    from hetero_infer.server.serve import serve_in_thread

    engine = LLMEngine(EngineConfig(model=str(model[0]), **CPU, seed=0))
    srv, url = serve_in_thread(build_app(engine, served_model_name="tiny-deepseek"))
    try:
        body = dict(
            model="tiny-deepseek", prompt="pick one:", max_tokens=8, temperature=1.0, n=3,
            guided_choice=CHOICES,
        )  # fmt: skip
        req = urllib.request.Request(
            url + "/v1/completions", json.dumps(body).encode(),
            {"Content-Type": "application/json"},
        )  # fmt: skip
        with urllib.request.urlopen(req, timeout=120) as r:
            res = json.loads(r.read())
    finally:
        srv.should_exit = True
        srv.thread.join(30)
        engine.close()
    texts = [c["text"] for c in res["choices"]]
    assert len(texts) == 3 and all(t in CHOICES for t in texts), res


def test_expert_parallel_over_two_ranks(model):
    "Each rank holds half of the routed experts (chapter 16) and half of the shared expert's width."
    init = Path(hetero_infer.__file__).read_text()
    assert "hetero_infer.mla.model" in init, (
        "hetero_infer/__init__.py must import hetero_infer.mla.model: the spawned ranks import the "
        "package, and only then know the DeepSeek family"
    )
    path, hf = model
    ps = prompts((3, 17, 60, 9), vocab=297)
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    kw = dict(tensor_parallel_size=2, enable_expert_parallel=True)
    llm = LLM(str(path), **CPU, **kw)
    try:
        got = [o.outputs[0].token_ids for o in llm.generate(ps, greedy, use_tqdm=False)]
    finally:
        llm.close()
    assert got == [hf_greedy(hf, p, 12)[0] for p in ps]
