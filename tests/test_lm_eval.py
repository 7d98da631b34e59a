"""What lm-evaluation-harness's `local-completions` backend sends, against `hetero-infer serve` on
the shipped demo model, without the harness installed: the request bodies and the parsing follow
its `LocalCompletionsAPI` (`lm_eval/models/openai_completions.py`). A multiple-choice task
(loglikelihood: context and continuation as token ids with `echo: true, logprobs: 1,
max_tokens: 1`, scored by the continuation's summed `token_logprobs`) and a generate-until task
(token-id prompts, greedy, `stop`), both built from the demo model's task: it knows the task, so
both score at least 0.9."""

import os
import random
import socket
import subprocess
import sys
import tempfile
import time

import httpx
import pytest

from hetero_infer.core.config import DEMO_MODEL_DIR
from hetero_infer.demo.task import TASKS, format_prompt, make_example, solve

MODEL = "demo"  # the served name, what lm-eval's `model=` model_arg sends


@pytest.fixture(scope="module")
def url():
    "`hetero-infer serve` on the demo model, on a free port; killed at the end."
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "hetero_infer", "serve", "--port", str(port)]
    cmd += ["--served-model-name", MODEL, "--log-level", "warning"]
    log = tempfile.TemporaryFile("w+")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, text=True)
    base, end = f"http://127.0.0.1:{port}", time.monotonic() + 180
    try:
        while True:
            assert proc.poll() is None, f"server exited {proc.returncode}"
            try:
                if httpx.get(base + "/readyz", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < end, "server did not become ready"
            time.sleep(0.2)
        yield base
    finally:
        proc.kill()
        proc.wait(10)
        log.seek(0)
        print(log.read()[-3000:])
        log.close()


@pytest.fixture(scope="module")
def tok():
    "The demo tokenizer, as lm-eval's `tokenizer_backend=huggingface` loads it."
    import tokenizers

    return tokenizers.Tokenizer.from_file(str(DEMO_MODEL_DIR / "tokenizer.json"))


def encode(tok, text: str) -> list[int]:
    "lm-eval's `tok_encode`: no special tokens added (the prompt's own are in its text)."
    return tok.encode(text, add_special_tokens=False).ids


def encode_pair(tok, context: str, continuation: str) -> tuple[list[int], list[int]]:
    "lm-eval's `_encode_pair`: the continuation is what encoding both adds to the context."
    whole, ctx = encode(tok, context + continuation), encode(tok, context)
    return ctx, whole[len(ctx) :]


def mc_items(n: int = 24, seed: int = 0) -> list[tuple[str, list[str]]]:
    "`n` held-out questions, each with its answer first and three distinct wrong ones."
    rng, items = random.Random(seed), []
    while len(items) < n:
        question, answer = make_example(rng, held_out=True)
        task, letters = question.split(": ")
        letters = letters.replace(" ", "")
        other = solve(TASKS[1 - TASKS.index(task)], letters)  # the other task's answer
        shuffles = ["".join(rng.sample(letters, len(letters))) for _ in range(20)]
        choices = [answer]
        for guess in [" ".join(g) for g in [other, letters, *shuffles]]:
            if guess not in choices and len(choices) < 4:
                choices.append(guess)
        if len(choices) == 4:  # too few distinct orders of the letters: another question
            items.append((question, choices))
    return items


def loglikelihoods(url, pairs: list[tuple[list[int], list[int]]]) -> list[tuple[float, bool]]:
    """lm-eval's loglikelihood request for a batch of (context, continuation) token ids, and its
    `parse_logprobs`: the continuation's summed logprob, and whether each token was the likeliest
    (the generated token, last, left out)."""
    body = {
        "model": MODEL,
        "prompt": [ctx + cont for ctx, cont in pairs],
        "temperature": 0,
        "max_tokens": 1,
        "logprobs": 1,
        "seed": 1234,
        "echo": True,
    }
    r = httpx.post(url + "/v1/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    out = []
    for choice, (ctx, cont) in zip(sorted(r.json()["choices"], key=lambda c: c["index"]), pairs):
        lp = choice["logprobs"]
        assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
        picked, tops = lp["token_logprobs"][len(ctx) : -1], lp["top_logprobs"][len(ctx) : -1]
        assert len(picked) == len(cont)
        out.append((sum(picked), all(v == max(t.values()) for v, t in zip(picked, tops))))
    return out


def test_multiple_choice_by_loglikelihood(url, tok):
    """A loglikelihood task: the four (context, continuation) pairs of each question in one
    request, the answer picked by summed logprob; accuracy >= 0.9, and the right answer is what
    the model would generate (`is_greedy`) wherever it is picked."""
    items, right = mc_items(), 0
    for question, choices in items:
        pairs = [encode_pair(tok, format_prompt(question), c) for c in choices]
        scored = loglikelihoods(url, pairs)
        best = max(range(len(choices)), key=lambda i: scored[i][0])
        right += best == 0
        assert best != 0 or scored[0][1], (question, choices, scored)
    assert len(items) >= 20 and right / len(items) >= 0.9, (right, len(items))


def test_generate_until(url, tok):
    """A generate-until task: token-id prompts batched, greedy, `until` as `stop` with the EOS
    text lm-eval adds; exact match after stripping, accuracy >= 0.9."""
    rng = random.Random(1)
    examples = [make_example(rng, held_out=True) for _ in range(24)]
    body = {
        "prompt": [encode(tok, format_prompt(q)) for q, _ in examples],
        "model": MODEL,
        "max_tokens": 16,
        "temperature": 0,
        "stop": ["\n\n", "<|eos|>"],
        "seed": 1234,
    }
    r = httpx.post(url + "/v1/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    texts = [None] * len(examples)
    for c in r.json()["choices"]:
        texts[c["index"]] = c["text"]
    right = sum(t.strip() == a for t, (_, a) in zip(texts, examples))
    assert right / len(examples) >= 0.9, (right, texts)


def test_score_only_and_prompt_logprobs(url, tok):
    """`max_tokens: 0` with echo (the score alone, as some harness versions send it) gives the
    logprobs of `max_tokens: 1` without the generated token; vLLM's `prompt_logprobs` agree."""
    ids = encode(tok, format_prompt("sort: d b a c") + "a b c d")
    base = {"model": MODEL, "prompt": [ids], "temperature": 0, "logprobs": 1, "echo": True}
    one = httpx.post(url + "/v1/completions", json={**base, "max_tokens": 1}).json()
    zero = httpx.post(url + "/v1/completions", json={**base, "max_tokens": 0}).json()
    a, b = one["choices"][0]["logprobs"], zero["choices"][0]["logprobs"]
    assert b["token_logprobs"] == a["token_logprobs"][:-1] and b["tokens"] == a["tokens"][:-1]
    assert (
        zero["usage"]["completion_tokens"] == 0 and zero["choices"][0]["finish_reason"] == "length"
    )
    body = {"model": MODEL, "prompt": ids, "max_tokens": 1, "prompt_logprobs": 0}
    v = httpx.post(url + "/v1/completions", json=body).json()["choices"][0]["prompt_logprobs"]
    assert v[0] is None
    for i in range(1, len(ids)):
        assert abs(v[i][str(ids[i])]["logprob"] - a["token_logprobs"][i]) < 1e-4
