"""`SamplingParams(detokenize=False)`: token ids only, no detokenizer runs, the same tokens as with
text; stop strings are refused."""

import pytest
from hetero_infer.core.sampling_params import SamplingParams
from hetero_infer.engine.llm import LLM
from hetero_infer.demo.task import format_prompt


def test_detokenize_off_gives_the_same_tokens_and_no_text():
    llm = LLM(device="cpu")
    q = [format_prompt("sort: d c b a"), format_prompt("reverse: x y z")]
    on = llm.generate(q, SamplingParams(temperature=0, max_tokens=12, logprobs=1), use_tqdm=False)
    llm.engine.add_request(
        "off", q[0], SamplingParams(temperature=0, max_tokens=12, logprobs=1, detokenize=False)
    )
    assert llm.engine.requests["off"].detok == {}  # no detokenizer was made for it
    while llm.engine.has_unfinished_requests():
        llm.engine.step()
    off = llm.generate(
        q,
        SamplingParams(temperature=0, max_tokens=12, logprobs=1, detokenize=False),
        use_tqdm=False,
    )
    assert [o.outputs[0].token_ids for o in off] == [o.outputs[0].token_ids for o in on]
    assert all(o.outputs[0].text == "" for o in off) and all(o.outputs[0].text for o in on)
    assert all(
        lp.decoded_token is None for o in off for d in o.outputs[0].logprobs for lp in d.values()
    )
    assert [o.outputs[0].finish_reason for o in off] == [o.outputs[0].finish_reason for o in on]


def test_stop_strings_need_text():
    with pytest.raises(ValueError, match="stop"):
        SamplingParams(stop=["x"], detokenize=False)
    with pytest.raises(ValueError, match="detokenize"):
        SamplingParams(detokenize=1)
