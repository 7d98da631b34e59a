"""hetero-paged-infer's config files (chapter 10's registered config format): every key of its
example file, the format rule, and bad files refused naming the key."""

import json
import pytest
from hetero_infer.core.config import EngineConfig
from hetero_infer.cli.hpi_config import is_hpi_format

# The example config.json of hetero-paged-infer, byte for byte.
HPI_EXAMPLE = (
    '{"block_size":16,"max_num_blocks":1024,"max_batch_size":32,"max_num_seqs":256,"max_model_len":2048,'
    '"max_total_tokens":4096,"memory_threshold":0.9,"max_retry_attempts":2,"tokenizer":{"kind":"simple","path":null},'
    '"serving":{"host":"127.0.0.1","port":3000,"model_name":"hetero-infer","backend":{"kind":"local_engine","command":null}}}'
)


def test_hpi_example_loads_unchanged_from_a_file(tmp_path):
    p = tmp_path / "config.json"
    p.write_text(HPI_EXAMPLE)
    c = EngineConfig.from_json(p)
    assert (
        c
        == EngineConfig.from_json(HPI_EXAMPLE)
        == EngineConfig.from_json(json.loads(HPI_EXAMPLE))
        == EngineConfig.from_json(str(p))
    )


@pytest.mark.parametrize(
    "field, value",
    [
        ("block_size", 16),
        ("num_blocks", 1024),  # max_num_blocks
        ("max_num_seqs", 32),  # max_batch_size: the per-step limit
        ("max_admitted_seqs", 256),  # its max_num_seqs: running + waiting
        ("max_model_len", 2048),
        ("max_num_batched_tokens", 4096),  # max_total_tokens
        ("memory_threshold", 0.9),
        ("max_retry_attempts", 2),
        ("tokenizer", None),  # kind simple, path null: the model's own HF tokenizer
    ],
)
def test_hpi_example_maps_each_key(field, value):
    assert getattr(EngineConfig.from_json(HPI_EXAMPLE), field) == value


def test_hpi_example_serving():
    s = EngineConfig.from_json(HPI_EXAMPLE).serving
    assert (s.host, s.port, s.model_name) == ("127.0.0.1", 3000, "hetero-infer")


def test_hpi_example_round_trips_through_our_format(tmp_path):
    c = EngineConfig.from_json(HPI_EXAMPLE)
    s = c.to_json(tmp_path / "ours.json")
    assert not is_hpi_format(json.loads(s))  # to_json writes our names
    assert EngineConfig.from_json(s) == c == EngineConfig.from_json(tmp_path / "ours.json")
    assert json.loads(s)["max_num_seqs"] == 32 and json.loads(s)["max_admitted_seqs"] == 256


@pytest.mark.parametrize(
    "d, hpi",
    [
        ({"max_batch_size": 8}, True),
        ({"max_total_tokens": 8}, True),
        ({"max_num_blocks": 8}, True),
        ({"tokenizer": {"kind": "huggingface", "path": None}}, True),
        ({"serving": {"backend": {"kind": "local_engine"}}}, True),
        ({"max_num_seqs": 8}, False),
        ({"tokenizer": "/tok", "serving": {"port": 1}}, False),
        ({}, False),
    ],
)
def test_format_rule(d, hpi):
    assert is_hpi_format(d) is hpi


def test_max_num_seqs_means_per_step_in_our_format_and_admitted_in_hpi():
    assert EngineConfig.from_json({"max_num_seqs": 8}).max_num_seqs == 8
    c = EngineConfig.from_json({"max_batch_size": 4, "max_num_seqs": 8})
    assert (c.max_num_seqs, c.max_admitted_seqs) == (4, 8)
    c = EngineConfig.from_json(
        {"max_num_blocks": 64, "max_num_seqs": 8}
    )  # hpi without max_batch_size
    assert (c.num_blocks, c.max_num_seqs, c.max_admitted_seqs) == (64, 256, 8)


@pytest.mark.parametrize(
    "kind, path, want",
    [
        ("simple", None, None),
        ("huggingface", None, None),
        ("simple", "tok", "tok"),
        ("huggingface", "tok", "tok"),
    ],
)
def test_tokenizer_kinds_are_hf_tokenizers(kind, path, want, tmp_path):
    if path is not None:
        (tmp_path / path).mkdir()
        path = want = str(tmp_path / path)
    assert EngineConfig.from_json({"tokenizer": {"kind": kind, "path": path}}).tokenizer == want


def test_command_bridge_is_refused_saying_why():
    bad = HPI_EXAMPLE.replace(
        '"kind":"local_engine","command":null',
        '"kind":"command_bridge","command":"llama-cli -p {prompt}"',
    )
    with pytest.raises(
        ValueError,
        match=r"serving\.backend\.kind 'command_bridge' is not supported"
        r".*shell command per prompt.*in-process",
    ):
        EngineConfig.from_json(bad)


@pytest.mark.parametrize(
    "d, field",
    [
        ({"tokenizer": {"kind": "sentencepiece", "path": None}}, "tokenizer.kind"),
        ({"tokenizer": {"kind": "simple", "path": 3}}, "tokenizer.path"),
        ({"tokenizer": {"kind": "simple", "vocab": "x"}}, "tokenizer.vocab"),
        ({"serving": {"backend": {"kind": "grpc"}}}, "serving.backend.kind"),
        (
            {"serving": {"backend": {"kind": "local_engine", "command": "run.sh"}}},
            "serving.backend.command",
        ),
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
    ],
)
def test_bad_config_names_the_key(d, field):
    with pytest.raises(ValueError, match=field.replace(".", r"\.")):
        EngineConfig.from_json(d)


def test_agreeing_spellings_are_accepted():
    c = EngineConfig.from_json(
        {
            "max_num_blocks": 8,
            "num_blocks": 8,
            "max_batch_size": 4,
            "max_num_seqs": 16,
            "max_admitted_seqs": 16,
        }
    )
    assert (c.num_blocks, c.max_num_seqs, c.max_admitted_seqs) == (8, 4, 16)


def test_not_json_or_not_an_object():
    with pytest.raises(ValueError, match="not valid JSON"):
        EngineConfig.from_json('{"block_size": ')
    with pytest.raises(ValueError, match="JSON object"):
        EngineConfig.from_json(json.loads("[1]"))
    with pytest.raises(ValueError, match="config file '/no/such.json' cannot be read"):
        EngineConfig.from_json("/no/such.json")
