"""Core types: JSON round trips and every bound of
`SamplingParams` and `EngineConfig`, with the checks later chapters register for their fields."""

import json
import math
import pytest
import hetero_infer
from hetero_infer.core.config import EngineConfig, ServingConfig
from hetero_infer.core.sampling_params import SamplingParams
from hetero_infer.core.sequence import QueueFullError, Sequence, SequenceStatus
from hetero_infer.core.outputs import CompletionOutput, RequestOutput

# --- contracts with the engine and the server ---


def test_error_outputs_and_queue_full():
    assert (
        SequenceStatus.FINISHED_ERROR.finished
        and SequenceStatus.FINISHED_ERROR.finish_reason == "error"
    )
    assert {s.finish_reason for s in SequenceStatus if s.finished} == {
        "stop",
        "length",
        "abort",
        "error",
    }
    o = CompletionOutput(0, "", [], finish_reason="error")
    assert o.finished and o.stop_reason is None
    r = RequestOutput("r", None, [1], [o], finished=True)
    assert r.error is None
    r.error = "step failed"
    assert "step failed" in repr(r)
    assert issubclass(QueueFullError, RuntimeError) and not issubclass(QueueFullError, ValueError)


def test_defaults():
    c = EngineConfig()
    assert (c.max_retry_attempts, c.max_admitted_seqs, c.max_num_seqs) == (2, None, 256)


@pytest.mark.parametrize(
    "given, want",
    [
        ("half", "float16"),
        ("float", "float32"),
        ("float16", "float16"),
        ("bfloat16", "bfloat16"),
        ("auto", "auto"),
    ],
)
def test_dtype_spellings(given, want):
    assert EngineConfig(dtype=given).dtype == want


def test_dtype_torch_objects_and_path_tokenizer(tmp_path):
    torch = pytest.importorskip("torch")
    assert [
        EngineConfig(dtype=d).dtype for d in (torch.float16, torch.bfloat16, torch.float32)
    ] == ["float16", "bfloat16", "float32"]
    with pytest.raises(ValueError, match="dtype"):
        EngineConfig(dtype=torch.int8)
    assert EngineConfig(tokenizer=tmp_path, model=tmp_path).tokenizer == str(tmp_path)


# --- every bound of EngineConfig (one case per bound) ---

ENGINE_BAD = [
    ("block_size", 0),
    ("block_size", 12),
    ("block_size", 512),
    ("block_size", 16.0),
    ("block_size", True),
    ("num_blocks", 0),
    ("num_blocks", -1),
    ("num_blocks", 1.5),
    ("gpu_memory_utilization", 0),
    ("gpu_memory_utilization", 1.01),
    ("gpu_memory_utilization", math.nan),
    ("gpu_memory_utilization", math.inf),
    ("memory_threshold", 0),
    ("memory_threshold", 1.01),
    ("memory_threshold", -0.5),
    ("max_num_seqs", 0),
    ("max_num_seqs", 2.0),
    ("max_admitted_seqs", 0),
    ("max_admitted_seqs", -3),
    ("max_admitted_seqs", 2.5),
    ("max_num_batched_tokens", 0),
    ("max_num_batched_tokens", 1.5),
    ("max_model_len", 0),
    ("max_model_len", 10.0),
    ("max_retry_attempts", -1),
    ("max_retry_attempts", 1.5),
    ("max_retry_attempts", None),
    ("dtype", "fp8"),
    ("dtype", "int8"),
    ("device", "tpu"),
    ("device", "cuda0"),
    ("attention_backend", "flash"),
    ("enable_prefix_caching", "yes"),
    ("enable_prefix_caching", 1),
    ("enable_chunked_prefill", "no"),
    ("seed", 1.5),
    ("seed", "0"),
    ("model", 3),
    ("tokenizer", 3),
]


@pytest.mark.parametrize("field, value", ENGINE_BAD)
def test_engine_config_rejects_out_of_bounds(field, value):
    with pytest.raises(ValueError, match=f"^{field} "):
        EngineConfig(**{field: value})


ENGINE_GOOD = [
    ("block_size", 1),
    ("block_size", 256),
    ("num_blocks", None),
    ("num_blocks", 1),
    ("gpu_memory_utilization", 1.0),
    ("memory_threshold", 1.0),
    ("max_num_seqs", 1),
    ("max_admitted_seqs", None),
    ("max_admitted_seqs", 1),
    ("max_num_batched_tokens", 1),
    ("max_model_len", 1),
    ("max_retry_attempts", 0),
    ("device", "cuda:1"),
    ("attention_backend", "triton"),
    ("seed", -5),
]


@pytest.mark.parametrize("field, value", ENGINE_GOOD)
def test_engine_config_accepts_the_bounds(field, value):
    assert getattr(EngineConfig(**{field: value}), field) == value


def test_engine_config_chunked_prefill_off_needs_a_budget_for_max_model_len():
    with pytest.raises(ValueError, match="^max_num_batched_tokens must be >= max_model_len"):
        EngineConfig(enable_chunked_prefill=False, max_model_len=4096, max_num_batched_tokens=2048)
    EngineConfig(enable_chunked_prefill=False, max_model_len=2048, max_num_batched_tokens=2048)


@pytest.mark.parametrize(
    "field, value",
    [
        ("port", -1),
        ("port", 65536),
        ("port", "80"),
        ("host", ""),
        ("model_name", ""),
        ("api_key", 3),
        ("max_queued_requests", 0),
    ],
)
def test_serving_config_rejects(field, value):
    with pytest.raises(ValueError, match=f"^serving.{field} "):
        ServingConfig(**{field: value})


# --- every bound of SamplingParams ---

SAMPLING_BAD = [
    ("n", 0),
    ("n", 1.5),
    ("n", True),
    ("temperature", -0.1),
    ("temperature", math.nan),
    ("temperature", math.inf),
    ("top_p", 0),
    ("top_p", 1.01),
    ("top_p", -1),
    ("top_k", -2),
    ("top_k", 1.5),
    ("min_p", -0.1),
    ("min_p", 1.1),
    ("presence_penalty", -2.1),
    ("presence_penalty", 2.1),
    ("frequency_penalty", -2.1),
    ("frequency_penalty", 2.1),
    ("repetition_penalty", 0),
    ("repetition_penalty", -1),
    ("seed", 1.5),
    ("seed", "1"),
    ("stop", [""]),
    ("stop", [1]),
    ("stop_token_ids", [-1]),
    ("stop_token_ids", ["a"]),
    ("ignore_eos", "no"),
    ("max_tokens", 0),
    ("max_tokens", 1.5),
    ("min_tokens", -1),
    ("logprobs", -1),
    ("logprobs", 21),
    ("skip_special_tokens", 1),
    ("include_stop_str_in_output", "yes"),
]


@pytest.mark.parametrize("field, value", SAMPLING_BAD)
def test_sampling_params_rejects_out_of_bounds(field, value):
    with pytest.raises(ValueError, match=f"^{field} "):
        SamplingParams(**{field: value})


SAMPLING_GOOD = [
    ("n", 1),
    ("temperature", 0.0),
    ("temperature", 2.0),
    ("top_p", 1.0),
    ("top_p", 0.01),
    ("top_k", -1),
    ("top_k", 0),
    ("top_k", 5),
    ("min_p", 0.0),
    ("min_p", 1.0),
    ("presence_penalty", -2.0),
    ("presence_penalty", 2.0),
    ("frequency_penalty", -2.0),
    ("frequency_penalty", 2.0),
    ("repetition_penalty", 0.01),
    ("seed", None),
    ("seed", 0),
    ("max_tokens", None),
    ("max_tokens", 1),
    ("min_tokens", 16),
    ("logprobs", 0),
    ("logprobs", 20),
    ("logprobs", None),
]


@pytest.mark.parametrize("field, value", SAMPLING_GOOD)
def test_sampling_params_accepts_the_bounds(field, value):
    assert getattr(SamplingParams(**{field: value}), field) == value


def test_min_tokens_at_most_max_tokens():
    with pytest.raises(ValueError, match="^min_tokens must be <= max_tokens"):
        SamplingParams(min_tokens=5, max_tokens=4)
    SamplingParams(min_tokens=4, max_tokens=4)


# --- exact messages and normalizations

# (what is built, its arguments, the exception, its message): every message names the field, the
# rule and the value.
BAD = [
    ("E", {"model": 5}, "ValueError", "model must be a path or None, got 5"),
    ("E", {"tokenizer": 5}, "ValueError", "tokenizer must be a path or None, got 5"),
    (
        "E",
        {"dtype": "float8"},
        "ValueError",
        "dtype must be one of ('auto', 'float32', 'float16', 'bfloat16') (or float, fp32, half, "
        "fp16, bf16, or a torch dtype), got 'float8'",
    ),
    (
        "E",
        {"dtype": None},
        "ValueError",
        "dtype must be one of ('auto', 'float32', 'float16', 'bfloat16') (or float, fp32, half, "
        "fp16, bf16, or a torch dtype), got None",
    ),
    (
        "E",
        {"dtype": ["float16"]},
        "ValueError",
        "dtype must be one of ('auto', 'float32', 'float16', 'bfloat16') (or float, fp32, half, "
        "fp16, bf16, or a torch dtype), got ['float16']",
    ),
    (
        "E",
        {"device": "tpu"},
        "ValueError",
        "device must be one of ('auto', 'cpu', 'cuda') or 'cuda:N', got 'tpu'",
    ),
    (
        "E",
        {"attention_backend": "x"},
        "ValueError",
        "attention_backend must be one of ('auto', 'torch', 'triton', 'cpp'), got 'x'",
    ),
    ("E", {"block_size": 3}, "ValueError", "block_size must be a power of two in [1, 256], got 3"),
    (
        "E",
        {"block_size": 512},
        "ValueError",
        "block_size must be a power of two in [1, 256], got 512",
    ),
    ("E", {"num_blocks": 0}, "ValueError", "num_blocks must be an integer >= 1 or None, got 0"),
    (
        "E",
        {"gpu_memory_utilization": 0},
        "ValueError",
        "gpu_memory_utilization must be in (0, 1], got 0",
    ),
    ("E", {"memory_threshold": 0}, "ValueError", "memory_threshold must be in (0, 1], got 0"),
    ("E", {"max_num_seqs": 0}, "ValueError", "max_num_seqs must be an integer >= 1, got 0"),
    (
        "E",
        {"max_admitted_seqs": 0},
        "ValueError",
        "max_admitted_seqs must be an integer >= 1 or None, got 0",
    ),
    (
        "E",
        {"max_retry_attempts": -1},
        "ValueError",
        "max_retry_attempts must be an integer >= 0, got -1",
    ),
    (
        "E",
        {"max_num_batched_tokens": 0},
        "ValueError",
        "max_num_batched_tokens must be an integer >= 1, got 0",
    ),
    (
        "E",
        {"max_model_len": 0},
        "ValueError",
        "max_model_len must be an integer >= 1 or None, got 0",
    ),
    (
        "E",
        {"enable_prefix_caching": 1},
        "ValueError",
        "enable_prefix_caching must be a bool, got 1",
    ),
    ("E", {"seed": 1.5}, "ValueError", "seed must be an integer, got 1.5"),
    ("S", {"host": ""}, "ValueError", "serving.host must be a non-empty string, got ''"),
    ("S", {"port": -1}, "ValueError", "serving.port must be an integer in [0, 65535], got -1"),
    (
        "S",
        {"port": 65536},
        "ValueError",
        "serving.port must be an integer in [0, 65535], got 65536",
    ),
    (
        "S",
        {"model_name": ""},
        "ValueError",
        "serving.model_name must be a non-empty string or None, got ''",
    ),
    ("S", {"api_key": 5}, "ValueError", "serving.api_key must be a string or None, got 5"),
    (
        "S",
        {"max_queued_requests": 0},
        "ValueError",
        "serving.max_queued_requests must be an integer >= 1, got 0",
    ),
    ("P", {"n": 0}, "ValueError", "n must be an integer >= 1, got 0"),
    ("P", {"temperature": -1}, "ValueError", "temperature must be >= 0, got -1"),
    ("P", {"top_p": 0}, "ValueError", "top_p must be in (0, 1], got 0"),
    (
        "P",
        {"top_k": -2},
        "ValueError",
        "top_k must be -1, 0 (disabled) or a positive integer, got -2",
    ),
    ("P", {"min_p": 2}, "ValueError", "min_p must be in [0, 1], got 2"),
    ("P", {"presence_penalty": 3}, "ValueError", "presence_penalty must be in [-2, 2], got 3"),
    ("J", [1], "ValueError", "config must be a JSON object, got list"),
    (
        "J",
        {"serving": {"x": 1}},
        "ValueError",
        "unknown config key(s) serving.x; known: api_key, host, max_queued_requests, model_name, "
        "port",
    ),
    (
        "J",
        {"bogus": 1},
        "ValueError",
        "unknown config key(s) bogus; known: attention_backend, block_size, device, dtype, "
        "enable_chunked_prefill, enable_expert_parallel, enable_prefix_caching, "
        "gpu_memory_utilization, kv_address, kv_cache_dtype, kv_offloading_size, kv_role, "
        "kv_transfer_timeout, max_admitted_seqs, "
        "max_model_len, max_num_batched_tokens, max_num_seqs, max_retry_attempts, "
        "memory_threshold, model, num_blocks, num_speculative_tokens, preemption_mode, "
        "prompt_lookup_max, prompt_lookup_min, quantization, quantize_lm_head, seed, serving, "
        "speculative_method, speculative_model, swap_space, tensor_parallel_size, tokenizer",
    ),
    (
        "J",
        {"tokenizer": {"kind": "huggingface", "path": "/t", "x": 1, "y": 2}},
        "ValueError",
        "unknown config key(s) tokenizer.x, tokenizer.y; known: kind, path",
    ),
    (
        "J",
        {"tokenizer": {"kind": "bpe"}},
        "ValueError",
        "tokenizer.kind must be one of ('simple', 'huggingface') (both load a Hugging Face "
        "tokenizer), got 'bpe'",
    ),
    (
        "J",
        {"tokenizer": {"path": ""}},
        "ValueError",
        "tokenizer.path must be a directory path or null (the model's own tokenizer), got ''",
    ),
    ("J", {"serving": {"backend": 5}}, "ValueError", "serving.backend must be an object, got 5"),
    (
        "J",
        {"serving": {"backend": {"kind": "local_engine", "x": 1, "y": 2}}},
        "ValueError",
        "unknown config key(s) serving.backend.x, serving.backend.y; known: kind, command",
    ),
    (
        "J",
        {"serving": {"backend": {"kind": "command_bridge"}}},
        "ValueError",
        "serving.backend.kind 'command_bridge' is not supported: it runs a shell command per "
        "prompt, while this engine runs the model in-process and batches requests itself; use "
        "'local_engine'",
    ),
    (
        "J",
        {"serving": {"backend": {"kind": "remote"}}},
        "ValueError",
        "serving.backend.kind must be 'local_engine' (the model runs in this process), got "
        "'remote'",
    ),
    (
        "J",
        {"serving": {"backend": {"command": "echo"}}},
        "ValueError",
        "serving.backend.command must be null: only 'command_bridge' uses a command, got 'echo'",
    ),
    (
        "F",
        "/no/such/config.json",
        "ValueError",
        "config file '/no/such/config.json' cannot be read: No such file or directory",
    ),
    ("Q", {"num_prompt_tokens": 0}, "ValueError", "num_prompt_tokens must be in [1, 3], got 0"),
    ("Q", {"num_prompt_tokens": 4}, "ValueError", "num_prompt_tokens must be in [1, 3], got 4"),
    ("P", {"repetition_penalty": 0}, "ValueError", "repetition_penalty must be > 0, got 0"),
    ("P", {"seed": 1.5}, "ValueError", "seed must be an integer or None, got 1.5"),
    ("P", {"stop": [""]}, "ValueError", "stop must be non-empty strings, got ['']"),
    (
        "P",
        {"stop_token_ids": [-1]},
        "ValueError",
        "stop_token_ids must be non-negative integers, got [-1]",
    ),
    ("P", {"ignore_eos": 1}, "ValueError", "ignore_eos must be a bool, got 1"),
    ("P", {"max_tokens": 0}, "ValueError", "max_tokens must be an integer >= 1 or None, got 0"),
    ("P", {"min_tokens": -1}, "ValueError", "min_tokens must be an integer >= 0, got -1"),
    ("P", {"logprobs": 21}, "ValueError", "logprobs must be an integer in [0, 20] or None, got 21"),
    ("P", {"skip_special_tokens": 1}, "ValueError", "skip_special_tokens must be a bool, got 1"),
    (
        "P",
        {"include_stop_str_in_output": 1},
        "ValueError",
        "include_stop_str_in_output must be a bool, got 1",
    ),
    ("P", {"detokenize": 1}, "ValueError", "detokenize must be a bool, got 1"),
    (
        "P",
        {"stop": ["x"], "detokenize": False},
        "ValueError",
        "stop strings need the text: set detokenize=True, or use stop_token_ids",
    ),
    ("E", {"block_size": 0}, "ValueError", "block_size must be a power of two in [1, 256], got 0"),
]


def _build_case(kind, kw):
    if kind == "E":
        return EngineConfig(**kw)
    if kind == "S":
        return ServingConfig(**kw)
    if kind == "P":
        return SamplingParams(**kw)
    if kind in "JF":
        return EngineConfig.from_json(kw)
    if kind == "Q":
        return Sequence(0, "r", [1, 2, 3], kw["num_prompt_tokens"])


@pytest.mark.parametrize("kind,kw,exc,msg", BAD, ids=[f"{c[0]}-{i}" for i, c in enumerate(BAD)])
def test_every_refusal_has_its_exact_message(kind, kw, exc, msg):
    with pytest.raises(ValueError) as e:
        _build_case(kind, kw)
    assert type(e.value).__name__ == exc and str(e.value) == msg


def test_accepted_edges_and_normalizations(tmp_path):
    assert (
        ServingConfig(port=0).port == 0
        and ServingConfig(port=65535).port == 65535
        and ServingConfig(max_queued_requests=1).max_queued_requests == 1
    )
    c = EngineConfig(model=tmp_path, block_size=256)
    assert (c.model, c.block_size) == (str(tmp_path), 256)
    assert SamplingParams(stop="x").stop == ["x"]
    g = SamplingParams(
        temperature=0, top_p=0.5, top_k=3, min_p=0.2
    )  # greedy: the filters are moot and reset
    assert (g.top_p, g.top_k, g.min_p) == (1.0, 0, 0.0)
    assert (
        EngineConfig.from_json('  {"seed": 3}').seed == 3
    )  # leading whitespace is still JSON text
    assert EngineConfig.from_json({"tokenizer": {"path": str(tmp_path)}}).tokenizer == str(
        tmp_path
    )  # kind defaults to huggingface
    assert (
        EngineConfig.from_json({"serving": {"backend": {"command": None}, "port": 1}}).serving.port
        == 1
    )  # kind defaults to local_engine
    assert (
        EngineConfig.from_json({"serving": {"port": 2}, "max_batch_size": 3}).serving.port == 2
    )  # no backend object at all
    s = EngineConfig(seed=3).to_json()
    assert s == json.dumps(EngineConfig(seed=3).to_dict(), indent=2) and '\n  "seed": 3' in s


def test_fork_copies_the_state_a_child_continues_from():
    p = Sequence(0, "r", [1, 2, 3, 4], 3, SamplingParams(n=2))
    p.block_table, p.block_hashes, p.num_computed_tokens, p.num_cached_tokens = [7, 8], [11], 3, 2
    c = p.fork(1, index=1)
    assert (c.seq_id, c.index, c.token_ids, c.num_computed_tokens, c.num_cached_tokens) == (
        1,
        1,
        [1, 2, 3, 4],
        3,
        2,
    )
    assert c.block_table == [] and c.block_hashes == [11] and c.block_hashes is not p.block_hashes


def test_request_output_repr():
    outs = [
        CompletionOutput(0, "hi", [1, 2], finish_reason="stop"),
        CompletionOutput(1, "", [], finish_reason="error"),
    ]
    r = RequestOutput("a", "p", [5], outs, True, error="boom")
    assert (
        repr(r)
        == "RequestOutput('a', prompt='p', finished=True, error='boom': [0] 'hi' (2 tok, stop); "
        "[1] '' (0 tok, error))"
    )
    assert (
        repr(RequestOutput("b", None, [5], outs[:1]))
        == "RequestOutput('b', prompt=None, finished=False: [0] 'hi' (2 tok, stop))"
    )


def test_serving_must_be_an_object():
    "A `serving` that is neither a dict nor a ServingConfig is refused naming the field."
    for bad in (5, "x", [1]):
        with pytest.raises(ValueError, match="serving must be an object"):
            EngineConfig(serving=bad)
    with pytest.raises(ValueError, match="serving must be an object"):
        EngineConfig.from_json('{"serving": "x"}')
    assert EngineConfig(serving={"port": 9}).serving.port == 9


# --- later chapters' checks of their own fields -------------------------------------------------
# EngineConfig and SamplingParams declare every field; the checks of 12-17's fields are registered
# by those chapters (`register_config_check`, `register_params_check`) when the package root
# imports them, and run after this chapter's. `hetero_infer.EngineConfig` is the same class.

FEATURE_BAD = [
    (
        "E",
        {"tensor_parallel_size": 0},
        "ValueError",
        "tensor_parallel_size must be an integer >= 1, got 0",
    ),
    (
        "E",
        {"tensor_parallel_size": 1.0},
        "ValueError",
        "tensor_parallel_size must be an integer >= 1, got 1.0",
    ),
    (
        "E",
        {"speculative_method": "x"},
        "ValueError",
        "speculative_method must be None or one of ('ngram', 'draft'), got 'x'",
    ),
    (
        "E",
        {"num_speculative_tokens": 0},
        "ValueError",
        "num_speculative_tokens must be an integer in [1, 16], got 0",
    ),
    (
        "E",
        {"num_speculative_tokens": 17},
        "ValueError",
        "num_speculative_tokens must be an integer in [1, 16], got 17",
    ),
    (
        "E",
        {"num_speculative_tokens": 2.0},
        "ValueError",
        "num_speculative_tokens must be an integer in [1, 16], got 2.0",
    ),
    (
        "E",
        {"speculative_method": "draft", "speculative_model": 5},
        "ValueError",
        "speculative_model must be a path or None, got 5",
    ),
    (
        "E",
        {"speculative_method": "draft"},
        "ValueError",
        "speculative_model must name the draft checkpoint directory when speculative_method is "
        "'draft'",
    ),
    (
        "E",
        {"speculative_model": "/d"},
        "ValueError",
        "speculative_model is only used with speculative_method='draft', got "
        "speculative_method=None",
    ),
    (
        "E",
        {"speculative_method": "ngram", "speculative_model": "/d"},
        "ValueError",
        "speculative_model is only used with speculative_method='draft', got "
        "speculative_method='ngram'",
    ),
    (
        "E",
        {"prompt_lookup_min": 0},
        "ValueError",
        "prompt_lookup_min must be an integer >= 1, got 0",
    ),
    (
        "E",
        {"prompt_lookup_max": 0},
        "ValueError",
        "prompt_lookup_max must be an integer >= 1, got 0",
    ),
    (
        "E",
        {"prompt_lookup_min": 1.0},
        "ValueError",
        "prompt_lookup_min must be an integer >= 1, got 1.0",
    ),
    (
        "E",
        {"prompt_lookup_min": 3, "prompt_lookup_max": 2},
        "ValueError",
        "prompt_lookup_min must be <= prompt_lookup_max (2), got 3",
    ),
]


@pytest.mark.parametrize("kw, exc, msg", [c[1:] for c in FEATURE_BAD])
def test_later_chapters_refuse_their_fields_by_name(kw, exc, msg):
    with pytest.raises(ValueError) as e:
        hetero_infer.EngineConfig(**kw)
    assert type(e.value).__name__ == exc and str(e.value) == msg


def test_later_chapters_accept_their_edges(tmp_path):
    c = hetero_infer.EngineConfig(
        model=tmp_path,
        speculative_method="draft",
        speculative_model=tmp_path,
        num_speculative_tokens=16,
        prompt_lookup_min=2,
        prompt_lookup_max=2,
        tensor_parallel_size=1,
    )
    assert (c.speculative_model, c.num_speculative_tokens) == (str(tmp_path), 16)
    c = hetero_infer.EngineConfig(num_speculative_tokens=1, speculative_method="ngram")
    assert c.num_speculative_tokens == 1


def test_quantization_fields_are_checked_by_name():
    "quantization and kv_cache_dtype take 15's modes only; each refusal names its field."
    c = hetero_infer.EngineConfig(quantization="w8a8", kv_cache_dtype="fp8")
    assert c.quantization == "w8a8"
    with pytest.raises(ValueError, match="^quantization must be one of"):
        hetero_infer.EngineConfig(quantization="int4")
    with pytest.raises(ValueError, match="^kv_cache_dtype must be one of"):
        hetero_infer.EngineConfig(kv_cache_dtype="fp16")


def test_structured_outputs_field_is_checked():
    "structured_outputs: StructuredOutputsParams or a dict of its fields; anything else by name."
    p = hetero_infer.SamplingParams(structured_outputs={"regex": "[ab]+"})
    assert p.structured_outputs.regex == "[ab]+"
    with pytest.raises(ValueError, match="^structured_outputs unknown field"):
        hetero_infer.SamplingParams(structured_outputs={"jsn": {}})
    with pytest.raises(ValueError, match="^structured_outputs must be"):
        hetero_infer.SamplingParams(structured_outputs="json")


def test_logit_bias_takes_token_ids_and_numbers_in_range():
    "Keys are ids >= 0 or their decimal strings (JSON keys), values floats in [-100, 100]."
    p = SamplingParams(logit_bias={"5": 1, 0: -100, 7: 100, 3: 2.5})
    assert p.logit_bias == {5: 1.0, 0: -100.0, 7: 100.0, 3: 2.5}
    assert all(type(k) is int and type(v) is float for k, v in p.logit_bias.items())
    assert SamplingParams().logit_bias is None and SamplingParams(logit_bias={}).logit_bias == {}


@pytest.mark.parametrize(
    "bias,msg",
    [
        ([1], "logit_bias must be a dict of token id -> bias, got [1]"),
        ({-1: 0}, "logit_bias keys must be token ids >= 0, got -1"),
        ({"-1": 0}, "logit_bias keys must be token ids >= 0, got '-1'"),
        ({"a": 0}, "logit_bias keys must be token ids >= 0, got 'a'"),
        ({1.0: 0}, "logit_bias keys must be token ids >= 0, got 1.0"),
        ({True: 0}, "logit_bias keys must be token ids >= 0, got True"),
        ({1: 100.5}, "logit_bias values must be in [-100, 100], got 100.5 for token 1"),
        ({"2": -100.5}, "logit_bias values must be in [-100, 100], got -100.5 for token 2"),
        ({3: "1"}, "logit_bias values must be in [-100, 100], got '1' for token 3"),
    ],
)
def test_logit_bias_refusals_name_the_field(bias, msg):
    with pytest.raises(ValueError) as e:
        SamplingParams(logit_bias=bias)
    assert str(e.value) == msg


def test_register_appends_new_names_and_replaces_the_same_name():
    "A registry keeps registration order; a re-run cell's function takes its old place."
    from hetero_infer.core.config import register

    def a(): ...

    def b(): ...

    reg = [a, b]
    ns = {}
    exec("def a(): ...", ns)
    ns["a"].__qualname__ = a.__qualname__  # a cell run again: a new function, the same name
    assert register(reg, ns["a"]) is ns["a"] and reg == [ns["a"], b]

    def c(): ...

    assert register(reg, c) is c and reg == [ns["a"], b, c]


def test_later_chapters_register_checks_formats_and_plugins():
    "Each registration hook adds to the registry the engine reads, and is used from then on."
    from hetero_infer.core import config as cfg, sampling_params as spm
    from hetero_infer.engine import plugins

    def refuse_seed_13(c):
        cfg.check_field(c.seed != 13, "seed", "must not be 13")

    def cap_top_k(p):
        p.top_k = min(p.top_k, 5)

    def nested(d):
        return d["ours"] if set(d) == {"ours"} else None

    class NotePlugin(plugins.EnginePlugin):
        name = "note"

    added = [
        (cfg.CONFIG_CHECKS, cfg.register_config_check(refuse_seed_13), refuse_seed_13),
        (spm.PARAMS_CHECKS, spm.register_params_check(cap_top_k), cap_top_k),
        (cfg.CONFIG_FORMATS, cfg.register_config_format(nested), nested),
        (plugins.PLUGINS, plugins.register_plugin(NotePlugin), NotePlugin),
    ]
    try:
        assert all(got is want and reg[-1] is want for reg, got, want in added)
        with pytest.raises(ValueError, match="^seed must not be 13$"):
            EngineConfig(seed=13)
        assert SamplingParams(top_k=9, temperature=1.0).top_k == 5
        assert EngineConfig.from_json({"ours": {"seed": 4}}).seed == 4
    finally:
        for reg, _, want in added:
            reg.remove(want)


def test_model_paths_are_checked_and_explained(tmp_path):
    "A model path: a non-empty path naming a directory; a hub id gets the download hint."
    from hetero_infer.core.config import resolve_model_path

    for bad in ("", 5, None):
        with pytest.raises(ValueError) as e:
            resolve_model_path(bad, "tokenizer")
        assert str(e.value) == f"tokenizer must be a directory path, got {bad!r}"
    with pytest.raises(ValueError) as e:
        resolve_model_path("org/name")
    assert str(e.value).startswith("model: 'org/name' is not a local directory.")
    assert "--local-dir ./name`" in str(e.value) and "pass ./name" in str(e.value)
    for plain in ("./name", "~/name", "org/", "/name", "a/b/c", "name"):
        with pytest.raises(ValueError) as e:
            resolve_model_path(plain, "model")
        assert str(e.value) == f"model: no such directory: {plain}", plain
    assert resolve_model_path(tmp_path) == str(tmp_path)


def test_config_json_round_trip_and_its_refusals(tmp_path):
    "to_json writes the file it returns; from_json names bad JSON, non-objects and unknown keys."
    from hetero_infer.core.config import _build

    path = tmp_path / "c.json"
    s = EngineConfig(seed=7, block_size=8).to_json(path)
    assert path.read_text() == s and EngineConfig.from_json(path).block_size == 8
    with pytest.raises(ValueError) as e:
        EngineConfig.from_json("{bad")
    assert str(e.value).startswith("config is not valid JSON: Expecting property name")
    with pytest.raises(ValueError) as e:
        EngineConfig.from_json({"zz": 1, "aa": 2})
    assert str(e.value).startswith("unknown config key(s) aa, zz; known: attention_backend, ")
    with pytest.raises(ValueError) as e:
        _build(ServingConfig, 5, "serving.")
    assert str(e.value) == "serving must be an object, got 5"
    with pytest.raises(ValueError) as e:
        _build(ServingConfig, [1])
    assert str(e.value) == "ServingConfig must be an object, got [1]"


def test_fork_starts_a_child_with_its_own_tokens_and_no_preemptions():
    p = Sequence(0, "r", [1, 2, 3], 2, SamplingParams(n=2))
    p.num_preemptions = 2
    c = p.fork(1, index=1)
    c.append_token(9)
    assert (p.token_ids, c.token_ids, c.num_preemptions, p.num_preemptions) == (
        [1, 2, 3],
        [1, 2, 3, 9],
        0,
        2,
    )
    assert (p.last_token_id(), c.last_token_id()) == (3, 9)


# `make mutation` over chapter 00's modules: what these tests leave alive. Equivalent (no output
# can tell them apart):
# - `_build` stripping 'XX.XX' instead of '.' from the prefix (no prefix ends in X);
# - `Sequence.fork` without `token_ids=list(...)` (`__post_init__` copies the list anyway).
