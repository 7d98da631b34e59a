"""The shipped demo model: the checkpoint loads, the tokenizer round-trips, answers are graded
right, and the model is accurate."""

import json
import random
import subprocess
import sys
import pytest
import torch
from hypothesis import given, settings, strategies as st
from hetero_infer.core.config import DEMO_MODEL_DIR
from hetero_infer.demo.task import (
    LETTERS,
    TASKS,
    MIN_LEN,
    MAX_LEN,
    CHAT_TEMPLATE,
    check_answer,
    demo_prompts,
    format_prompt,
    is_held_out,
    make_example,
    question_of,
    run_demo,
    solve,
)

FILES = [
    "config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
    "generation_config.json",
    "special_tokens_map.json",
]


@pytest.fixture(scope="module")
def tok():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(DEMO_MODEL_DIR)


@pytest.fixture(scope="module")
def model():
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(DEMO_MODEL_DIR, dtype=torch.float32).eval()


def test_checkpoint_files_and_size():
    assert all((DEMO_MODEL_DIR / f).is_file() for f in FILES)
    assert sum(f.stat().st_size for f in DEMO_MODEL_DIR.iterdir()) <= 20e6
    assert not list(DEMO_MODEL_DIR.glob("*.bin")) and not list(
        DEMO_MODEL_DIR.glob("*.pt")
    )  # safetensors only
    cfg = json.loads((DEMO_MODEL_DIR / "config.json").read_text())
    assert (
        cfg["architectures"] == ["LlamaForCausalLM"]
        and cfg["num_key_value_heads"] < cfg["num_attention_heads"]
    )
    tc = json.loads((DEMO_MODEL_DIR / "tokenizer_config.json").read_text())
    assert tc["chat_template"] == CHAT_TEMPLATE


def test_model_dir_does_not_depend_on_cwd(tmp_path):
    code = (
        "from hetero_infer.core.config import DEMO_MODEL_DIR as d; "
        "print(d, (d / 'config.json').is_file())"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, check=True
    ).stdout.split()
    assert out == [str(DEMO_MODEL_DIR), "True"]


def test_model_loads(model, tok):
    gen = json.loads((DEMO_MODEL_DIR / "generation_config.json").read_text())
    assert gen["eos_token_id"] == tok.eos_token_id == model.config.eos_token_id
    assert 0.5e6 < sum(p.numel() for p in model.parameters()) < 5e6
    assert model.config.vocab_size == len(tok)


def test_tokenizer_round_trip_and_chat_template(tok):
    assert tok.chat_template == CHAT_TEMPLATE
    assert (tok.bos_token, tok.eos_token, tok.pad_token) == ("<|bos|>", "<|eos|>", "<|pad|>")
    rng = random.Random(0)
    for _ in range(50):
        q, a = make_example(rng)
        p = tok.apply_chat_template(
            [{"role": "user", "content": q}], tokenize=False, add_generation_prompt=True
        )
        assert p == format_prompt(q)
        ids = tok(p + a + tok.eos_token)["input_ids"]
        assert (
            ids[0] == tok.bos_token_id
            and ids[-1] == tok.eos_token_id
            and ids.count(tok.bos_token_id) == 1
        )
        assert tok.decode(ids) == p + a + tok.eos_token
        assert tok.decode(ids, skip_special_tokens=True) == q + a
    # every letter (with or without its leading space) is a single token, so answers are learnable
    # letter by letter
    assert all(len(tok(s)["input_ids"]) == 1 for c in LETTERS for s in (c, " " + c))


letters = st.text(alphabet=LETTERS, min_size=MIN_LEN, max_size=MAX_LEN)


@settings(max_examples=200, deadline=None)
@given(st.sampled_from(TASKS), letters, st.booleans())
def test_check_answer_accepts_right_answers(task, s, chat):
    q = f"{task}: {' '.join(s)}"
    assert check_answer(format_prompt(q) if chat else q, " ".join(solve(task, s)))
    assert check_answer(q, " " + " ".join(solve(task, s)) + "\n")


@settings(max_examples=200, deadline=None)
@given(st.sampled_from(TASKS), letters, st.data())
def test_check_answer_rejects_wrong_answers(task, s, data):
    q, right = f"{task}: {' '.join(s)}", solve(task, s)
    wrong = data.draw(
        st.text(alphabet=LETTERS, min_size=1, max_size=MAX_LEN + 1).filter(lambda w: w != right)
    )
    assert not check_answer(q, " ".join(wrong))
    assert not check_answer(q, right) or len(right) == 1  # no spaces between letters
    assert not check_answer(q, " ".join(right) + " " + right[-1])  # one letter too many


def test_check_answer_needs_a_question():
    with pytest.raises(ValueError, match="no question"):
        check_answer("hello", "hi")


def test_held_out_split():
    rng = random.Random(1)
    assert not any(
        is_held_out(question_of(make_example(rng)[0]).split(": ")[1].replace(" ", ""))
        for _ in range(500)
    )
    ps = demo_prompts(50, seed=3)
    assert ps == demo_prompts(50, seed=3) and len(set(ps)) > 45
    assert all(is_held_out(question_of(p).split(": ")[1].replace(" ", "")) for p in ps)


def test_greedy_accuracy_with_transformers(model, tok):
    prompts = demo_prompts(20, seed=99)
    tok.padding_side = "left"
    enc = tok(prompts, return_tensors="pt", padding=True)
    with torch.no_grad():
        out = model.generate(
            **enc, max_new_tokens=12, do_sample=False, pad_token_id=tok.pad_token_id
        )
    texts = tok.batch_decode(out[:, enc["input_ids"].shape[1] :], skip_special_tokens=True)
    right = sum(check_answer(p, t) for p, t in zip(prompts, texts))
    assert right >= 18, list(zip(prompts, texts))


def test_readme_command_line_example_prints_what_the_readme_shows(capsys):
    """The README's `hetero-infer generate --chat ...` example on the demo model prints exactly the
    lines the README shows."""
    import re
    import shlex
    from pathlib import Path
    from hetero_infer.cli.main import main

    readme = (Path(__file__).resolve().parent.parent / "README.md").read_text()
    m = re.search(r"^(hetero-infer generate --chat .*)\n((?:# .*\n)+)", readme, re.M)
    assert m, "README.md shows no `hetero-infer generate --chat` example with its output"
    assert main(shlex.split(m[1])[1:]) == 0
    shown = [l[2:] for l in m[2].splitlines()]
    assert capsys.readouterr().out.strip().splitlines()[-len(shown) :] == shown


def test_train_log_is_shipped_and_describes_a_falling_loss():
    "08 draws its loss curve from train_log.json beside the weights (CI never retrains)."
    log = json.loads((DEMO_MODEL_DIR / "train_log.json").read_text())
    steps, loss = log["logged_steps"], log["loss"]
    assert len(steps) == len(loss) >= 2 and steps == sorted(steps) and steps[-1] < log["steps"]
    assert all(x > 0 for x in loss) and loss[-1] < loss[0] / 100
    assert (DEMO_MODEL_DIR / "train_log.json").stat().st_mode & 0o444 == 0o444  # package data


@pytest.mark.parametrize("n", [0, -1, 2.5, True, None])
def test_run_demo_refuses_a_count_that_is_not_a_positive_integer(n):
    "No ZeroDivisionError, no 'accuracy 0/-1': refused before loading a model."
    with pytest.raises(ValueError, match=r"n \(prompts to answer\) must be an integer >= 1"):
        run_demo(n=n)
