"Core types: hetero-paged-infer's config format, JSON round trips, and every bound of `SamplingParams` and `EngineConfig`."
import json, math
import pytest
from pathlib import Path
from hetero_infer.core import (EngineConfig, ServingConfig, SamplingParams, SequenceStatus, CompletionOutput, RequestOutput,
                               QueueFullError, is_hpi_format)

# The example config.json of hetero-paged-infer, byte for byte as in issue 10.
HPI_EXAMPLE = ('{"block_size":16,"max_num_blocks":1024,"max_batch_size":32,"max_num_seqs":256,"max_model_len":2048,'
               '"max_total_tokens":4096,"memory_threshold":0.9,"max_retry_attempts":2,"tokenizer":{"kind":"simple","path":null},'
               '"serving":{"host":"127.0.0.1","port":3000,"model_name":"hetero-infer","backend":{"kind":"local_engine","command":null}}}')


# --- hetero-paged-infer's config format (issue 10 item 11) ---

def test_hpi_example_loads_unchanged_from_a_file(tmp_path):
    p = tmp_path / "config.json"; p.write_text(HPI_EXAMPLE)
    c = EngineConfig.from_json(p)
    assert c == EngineConfig.from_json(HPI_EXAMPLE) == EngineConfig.from_json(json.loads(HPI_EXAMPLE)) == EngineConfig.from_json(str(p))

@pytest.mark.parametrize("field, value", [
    ("block_size", 16), ("num_blocks", 1024),            # max_num_blocks
    ("max_num_seqs", 32),                                 # max_batch_size: the per-step limit
    ("max_admitted_seqs", 256),                           # its max_num_seqs: running + waiting
    ("max_model_len", 2048), ("max_num_batched_tokens", 4096),   # max_total_tokens
    ("memory_threshold", 0.9), ("max_retry_attempts", 2),
    ("tokenizer", None),                                  # kind simple, path null: the model's own HF tokenizer
])
def test_hpi_example_maps_each_key(field, value):
    assert getattr(EngineConfig.from_json(HPI_EXAMPLE), field) == value

def test_hpi_example_serving():
    s = EngineConfig.from_json(HPI_EXAMPLE).serving
    assert (s.host, s.port, s.model_name) == ("127.0.0.1", 3000, "hetero-infer")

def test_hpi_example_round_trips_through_our_format(tmp_path):
    c = EngineConfig.from_json(HPI_EXAMPLE)
    s = c.to_json(tmp_path / "ours.json")
    assert not is_hpi_format(json.loads(s))               # to_json writes our names
    assert EngineConfig.from_json(s) == c == EngineConfig.from_json(tmp_path / "ours.json")
    assert json.loads(s)["max_num_seqs"] == 32 and json.loads(s)["max_admitted_seqs"] == 256

@pytest.mark.parametrize("d, hpi", [
    ({"max_batch_size": 8}, True), ({"max_total_tokens": 8}, True), ({"max_num_blocks": 8}, True),
    ({"tokenizer": {"kind": "huggingface", "path": None}}, True), ({"serving": {"backend": {"kind": "local_engine"}}}, True),
    ({"max_num_seqs": 8}, False), ({"tokenizer": "/tok", "serving": {"port": 1}}, False), ({}, False),
])
def test_format_rule(d, hpi):
    assert is_hpi_format(d) is hpi

def test_max_num_seqs_means_per_step_in_our_format_and_admitted_in_hpi():
    assert EngineConfig.from_json({"max_num_seqs": 8}).max_num_seqs == 8
    c = EngineConfig.from_json({"max_batch_size": 4, "max_num_seqs": 8})
    assert (c.max_num_seqs, c.max_admitted_seqs) == (4, 8)
    c = EngineConfig.from_json({"max_num_blocks": 64, "max_num_seqs": 8})     # hpi without max_batch_size
    assert (c.num_blocks, c.max_num_seqs, c.max_admitted_seqs) == (64, 256, 8)

@pytest.mark.parametrize("kind, path, want", [("simple", None, None), ("huggingface", None, None),
                                              ("simple", "/models/tok", "/models/tok"), ("huggingface", "/models/tok", "/models/tok")])
def test_tokenizer_kinds_are_hf_tokenizers(kind, path, want):
    assert EngineConfig.from_json({"tokenizer": {"kind": kind, "path": path}}).tokenizer == want

def test_command_bridge_is_refused_saying_why():
    bad = HPI_EXAMPLE.replace('"kind":"local_engine","command":null', '"kind":"command_bridge","command":"llama-cli -p {prompt}"')
    with pytest.raises(ValueError, match=r"serving\.backend\.kind 'command_bridge' is not supported.*shell command per prompt.*in-process"):
        EngineConfig.from_json(bad)

@pytest.mark.parametrize("d, field", [
    ({"tokenizer": {"kind": "sentencepiece", "path": None}}, "tokenizer.kind"),
    ({"tokenizer": {"kind": "simple", "path": 3}}, "tokenizer.path"),
    ({"tokenizer": {"kind": "simple", "vocab": "x"}}, "tokenizer.vocab"),
    ({"serving": {"backend": {"kind": "grpc"}}}, "serving.backend.kind"),
    ({"serving": {"backend": {"kind": "local_engine", "command": "run.sh"}}}, "serving.backend.command"),
    ({"serving": {"backend": {"kind": "local_engine", "cmd": None}}}, "serving.backend.cmd"),
    ({"serving": {"backend": "local"}}, "serving.backend"),
    ({"max_batch_size": 0}, "max_num_seqs"),
    ({"max_batch_size": 8, "max_num_seqs": 0}, "max_admitted_seqs"),
    ({"max_num_blocks": 0}, "num_blocks"),
    ({"max_total_tokens": -1}, "max_num_batched_tokens"),
    ({"max_retry_attempts": -1}, "max_retry_attempts"),
    ({"max_num_blocks": 8, "num_blocks": 16}, "max_num_blocks"),
    ({"max_batch_size": 8, "max_num_seqs": 16, "max_admitted_seqs": 32}, "max_admitted_seqs"),
    ({"max_total_tokens": 8, "max_num_batched_tokens": 16}, "max_total_tokens"),
    ({"blok_size": 16}, "blok_size"),
    ({"serving": {"prot": 1}}, "serving.prot"),
    ({"serving": {"port": 70000}}, "serving.port"),
])
def test_bad_config_names_the_key(d, field):
    with pytest.raises(ValueError, match=field.replace(".", r"\.")): EngineConfig.from_json(d)

def test_agreeing_spellings_are_accepted():
    c = EngineConfig.from_json({"max_num_blocks": 8, "num_blocks": 8, "max_batch_size": 4, "max_num_seqs": 16, "max_admitted_seqs": 16})
    assert (c.num_blocks, c.max_num_seqs, c.max_admitted_seqs) == (8, 4, 16)

def test_not_json_or_not_an_object():
    with pytest.raises(ValueError, match="not valid JSON"): EngineConfig.from_json('{"block_size": ')
    with pytest.raises(ValueError, match="JSON object"): EngineConfig.from_json(json.loads("[1]"))
    with pytest.raises(ValueError, match="config file '/no/such.json' cannot be read"): EngineConfig.from_json("/no/such.json")


# --- contracts with the engine and the server ---

def test_error_outputs_and_queue_full():
    assert SequenceStatus.FINISHED_ERROR.finished and SequenceStatus.FINISHED_ERROR.finish_reason == "error"
    assert {s.finish_reason for s in SequenceStatus if s.finished} == {"stop", "length", "abort", "error"}
    o = CompletionOutput(0, "", [], finish_reason="error")
    assert o.finished and o.stop_reason is None
    r = RequestOutput("r", None, [1], [o], finished=True)
    assert r.error is None
    r.error = "step failed"; assert "step failed" in repr(r)
    assert issubclass(QueueFullError, RuntimeError) and not issubclass(QueueFullError, ValueError)

def test_defaults():
    c = EngineConfig()
    assert (c.max_retry_attempts, c.max_admitted_seqs, c.max_num_seqs) == (2, None, 256)

@pytest.mark.parametrize("given, want", [("half", "float16"), ("float", "float32"), ("float16", "float16"), ("bfloat16", "bfloat16"), ("auto", "auto")])
def test_dtype_spellings(given, want):
    assert EngineConfig(dtype=given).dtype == want

def test_dtype_torch_objects_and_path_tokenizer():
    torch = pytest.importorskip("torch")
    assert [EngineConfig(dtype=d).dtype for d in (torch.float16, torch.bfloat16, torch.float32)] == ["float16", "bfloat16", "float32"]
    with pytest.raises(ValueError, match="dtype"): EngineConfig(dtype=torch.int8)
    assert EngineConfig(tokenizer=Path("/t"), model=Path("/m")).tokenizer == "/t"


# --- every bound of EngineConfig (issue 18: checked in tests/, one case per bound) ---

ENGINE_BAD = [
    ("block_size", 0), ("block_size", 12), ("block_size", 512), ("block_size", 16.0), ("block_size", True),
    ("num_blocks", 0), ("num_blocks", -1), ("num_blocks", 1.5),
    ("gpu_memory_utilization", 0), ("gpu_memory_utilization", 1.01), ("gpu_memory_utilization", math.nan), ("gpu_memory_utilization", math.inf),
    ("memory_threshold", 0), ("memory_threshold", 1.01), ("memory_threshold", -0.5),
    ("max_num_seqs", 0), ("max_num_seqs", 2.0),
    ("max_admitted_seqs", 0), ("max_admitted_seqs", -3), ("max_admitted_seqs", 2.5),
    ("max_num_batched_tokens", 0), ("max_num_batched_tokens", 1.5),
    ("max_model_len", 0), ("max_model_len", 10.0),
    ("max_retry_attempts", -1), ("max_retry_attempts", 1.5), ("max_retry_attempts", None),
    ("dtype", "fp8"), ("dtype", "int8"), ("device", "tpu"), ("device", "cuda0"), ("attention_backend", "flash"),
    ("enable_prefix_caching", "yes"), ("enable_prefix_caching", 1), ("enable_chunked_prefill", "no"),
    ("seed", 1.5), ("seed", "0"), ("model", 3), ("tokenizer", 3),
]

@pytest.mark.parametrize("field, value", ENGINE_BAD)
def test_engine_config_rejects_out_of_bounds(field, value):
    with pytest.raises(ValueError, match=f"^{field} "): EngineConfig(**{field: value})

ENGINE_GOOD = [("block_size", 1), ("block_size", 256), ("num_blocks", None), ("num_blocks", 1), ("gpu_memory_utilization", 1.0),
               ("memory_threshold", 1.0), ("max_num_seqs", 1), ("max_admitted_seqs", None), ("max_admitted_seqs", 1),
               ("max_num_batched_tokens", 1), ("max_model_len", 1), ("max_retry_attempts", 0), ("device", "cuda:1"),
               ("attention_backend", "triton"), ("seed", -5)]

@pytest.mark.parametrize("field, value", ENGINE_GOOD)
def test_engine_config_accepts_the_bounds(field, value):
    assert getattr(EngineConfig(**{field: value}), field) == value

def test_engine_config_chunked_prefill_off_needs_a_budget_for_max_model_len():
    with pytest.raises(ValueError, match="^max_num_batched_tokens must be >= max_model_len"):
        EngineConfig(enable_chunked_prefill=False, max_model_len=4096, max_num_batched_tokens=2048)
    EngineConfig(enable_chunked_prefill=False, max_model_len=2048, max_num_batched_tokens=2048)

@pytest.mark.parametrize("field, value", [("port", -1), ("port", 65536), ("port", "80"), ("host", ""), ("model_name", ""),
                                          ("api_key", 3), ("max_queued_requests", 0)])
def test_serving_config_rejects(field, value):
    with pytest.raises(ValueError, match=f"^serving.{field} "): ServingConfig(**{field: value})


# --- every bound of SamplingParams ---

SAMPLING_BAD = [
    ("n", 0), ("n", 1.5), ("n", True),
    ("temperature", -0.1), ("temperature", math.nan), ("temperature", math.inf),
    ("top_p", 0), ("top_p", 1.01), ("top_p", -1),
    ("top_k", -2), ("top_k", 1.5),
    ("min_p", -0.1), ("min_p", 1.1),
    ("presence_penalty", -2.1), ("presence_penalty", 2.1), ("frequency_penalty", -2.1), ("frequency_penalty", 2.1),
    ("repetition_penalty", 0), ("repetition_penalty", -1),
    ("seed", 1.5), ("seed", "1"),
    ("stop", [""]), ("stop", [1]), ("stop_token_ids", [-1]), ("stop_token_ids", ["a"]),
    ("ignore_eos", "no"), ("max_tokens", 0), ("max_tokens", 1.5), ("min_tokens", -1),
    ("logprobs", -1), ("logprobs", 21), ("skip_special_tokens", 1), ("include_stop_str_in_output", "yes"),
]

@pytest.mark.parametrize("field, value", SAMPLING_BAD)
def test_sampling_params_rejects_out_of_bounds(field, value):
    with pytest.raises(ValueError, match=f"^{field} "): SamplingParams(**{field: value})

SAMPLING_GOOD = [("n", 1), ("temperature", 0.0), ("temperature", 2.0), ("top_p", 1.0), ("top_p", 0.01), ("top_k", -1), ("top_k", 0),
                 ("top_k", 5), ("min_p", 0.0), ("min_p", 1.0), ("presence_penalty", -2.0), ("presence_penalty", 2.0),
                 ("frequency_penalty", -2.0), ("frequency_penalty", 2.0), ("repetition_penalty", 0.01), ("seed", None), ("seed", 0),
                 ("max_tokens", None), ("max_tokens", 1), ("min_tokens", 16), ("logprobs", 0), ("logprobs", 20), ("logprobs", None)]

@pytest.mark.parametrize("field, value", SAMPLING_GOOD)
def test_sampling_params_accepts_the_bounds(field, value):
    assert getattr(SamplingParams(**{field: value}), field) == value

def test_min_tokens_at_most_max_tokens():
    with pytest.raises(ValueError, match="^min_tokens must be <= max_tokens"): SamplingParams(min_tokens=5, max_tokens=4)
    SamplingParams(min_tokens=4, max_tokens=4)
