"""Engine behaviours through its public API, with a tiny random model and token-id prompts:
completion indices and seeds of n > 1 requests, and when an aborted request stops counting as
unfinished."""

import pytest
from hetero_infer.core.sampling_params import SamplingParams
from hetero_infer.engine.llm import LLM
from hetero_infer.testing import tiny_hf_checkpoint


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_llama")
    tiny_hf_checkpoint(path, "llama", bos_token_id=None, eos_token_id=None, pad_token_id=None)
    return LLM(
        str(path), device="cpu", dtype="float32", block_size=4, num_blocks=96, max_model_len=64
    )


PROMPT = [3, 14, 15, 92, 65, 35]


def completions(llm, **params):
    p = SamplingParams(max_tokens=params.pop("max_tokens", 8), ignore_eos=True, **params)
    out = llm.generate([PROMPT], p, use_tqdm=False)[0]
    assert out.finished
    return out.outputs


def test_n_completions_have_indices_0_to_n_minus_1_once_each(llm):
    outs = completions(llm, n=4, temperature=1.0, seed=5)
    assert [c.index for c in outs] == [0, 1, 2, 3]
    assert all(len(c.token_ids) == 8 and c.finish_reason == "length" for c in outs)


def test_streamed_outputs_of_n_completions_keep_their_indices(llm):
    """Every step's output of an n = 3 request lists each index once, in order; each completion only
    grows."""
    eng = llm.engine
    eng.add_request(
        "stream-n",
        PROMPT,
        SamplingParams(n=3, temperature=1.0, seed=2, max_tokens=5, ignore_eos=True),
    )
    last = {}
    while eng.has_unfinished_requests():
        for o in eng.step():
            assert [c.index for c in o.outputs] == list(range(len(o.outputs)))
            for c in o.outputs:
                assert c.token_ids[: len(last.get(c.index, []))] == last.get(c.index, [])
                last[c.index] = c.token_ids
    assert sorted(last) == [0, 1, 2] and all(len(t) == 5 for t in last.values())


def test_seeded_n_completions_differ_and_repeat(llm):
    """A seeded n = 4 request: the 4 completions differ from each other, and the same seed gives the
    same 4 again."""
    first = [c.token_ids for c in completions(llm, n=4, temperature=1.0, seed=1234)]
    assert len({tuple(t) for t in first}) == 4
    again = [c.token_ids for c in completions(llm, n=4, temperature=1.0, seed=1234)]
    assert again == first
    other = [c.token_ids for c in completions(llm, n=4, temperature=1.0, seed=4321)]
    assert other != first


def test_seeded_completion_does_not_depend_on_n(llm):
    "Completion 0 of a seeded request is the same whether 1 or 3 completions are asked for."
    one = completions(llm, n=1, temperature=1.0, seed=77)[0].token_ids
    three = completions(llm, n=3, temperature=1.0, seed=77)
    assert three[0].token_ids == one and three[1].token_ids != one


def test_greedy_n_completions_are_equal(llm):
    outs = completions(llm, n=3, temperature=0.0)
    assert outs[0].token_ids == outs[1].token_ids == outs[2].token_ids


def test_aborted_request_is_unfinished_until_its_abort_output_is_returned(llm):
    eng = llm.engine
    assert not eng.has_unfinished_requests()
    eng.add_request(
        "doomed",
        PROMPT,
        SamplingParams(n=2, temperature=1.0, seed=3, max_tokens=20, ignore_eos=True),
    )
    eng.step()
    eng.step()
    eng.abort_request("doomed")
    assert eng.has_unfinished_requests()  # its final output has not been handed out yet
    outs = eng.step()
    final = [o for o in outs if o.request_id == "doomed"]
    assert len(final) == 1 and final[0].finished
    assert [c.finish_reason for c in final[0].outputs] == ["abort", "abort"]
    assert [c.index for c in final[0].outputs] == [0, 1]
    assert not eng.has_unfinished_requests()
    assert all(o.request_id != "doomed" for o in eng.step())  # handed out once
    assert eng.block_manager.usage() == 0


def test_abort_while_waiting_and_loop_drains(llm):
    """A request aborted before it ever ran still yields exactly one final 'abort' output from
    step()."""
    eng = llm.engine
    eng.add_request("never", PROMPT, SamplingParams(max_tokens=4))
    eng.abort_request("never")
    assert eng.has_unfinished_requests()
    seen = []
    while eng.has_unfinished_requests():
        seen += eng.step()
    assert [(o.request_id, o.finished, o.outputs[0].finish_reason) for o in seen] == [
        ("never", True, "abort")
    ]
