"""Schema fuzzing: random JSON schemas over every keyword the engine accepts, drawn from a seeded
RNG, run through the engine (a random-weight Llama with the demo model's 297-token vocabulary,
sampled at temperature 1, so only the mask makes an output valid), every finished output
validated by `jsonschema` (formats asserted too); and every keyword the mask cannot enforce,
planted somewhere in a random schema, refused with a ValueError that names it."""

import json
import random
import re
import shutil

import pytest
import torch

jsonschema = pytest.importorskip("jsonschema")
pytest.importorskip("xgrammar")

from hetero_infer.core.config import DEMO_MODEL_DIR, EngineConfig  # noqa: E402
from hetero_infer.core.sampling_params import SamplingParams  # noqa: E402
from hetero_infer.engine.llm_engine import LLMEngine  # noqa: E402
from hetero_infer.structured.grammar import (  # noqa: E402
    UNSUPPORTED_SCHEMA_KEYWORDS,
    StructuredOutputsParams,
)
from hetero_infer.structured.plugin import StructuredOutputsPlugin  # noqa: E402 (registers it)

torch.set_num_threads(1)
NAMES = ["a", "b", "id", "tag", "x_1"]
VALUES = ["on", "off", 0, 7, -2, True, None, "é", {"k": 1}, [1, "z"]]
PATTERNS = ["^[a-z]{1,5}$", "^[0-9]{2}-[A-Z]$", "^(yes|no)$", "^\\w{2,4}$"]
FORMATS = ["date", "email", "uuid", "ipv4"]


class SchemaGen:
    "Random schemas over the accepted keywords; shared `$defs` collected as they are made."

    def __init__(self, rng: random.Random):
        self.rng, self.defs = rng, {}

    def any(self, depth: int) -> dict:
        kinds = ["string", "integer", "number", "boolean", "null", "enum", "const", "nullable"]
        if depth > 0:
            kinds += ["object", "object", "array", "anyOf", "oneOf", "allOf", "ref"]
        return getattr(self, "gen_" + self.rng.choice(kinds))(depth)

    def maybe(self, p: float = 0.5) -> bool:
        return self.rng.random() < p

    def gen_string(self, depth):
        r, s = self.rng, {"type": "string"}
        pick = r.choice(["lengths", "pattern", "format", "plain"])
        if pick == "lengths":
            lo = r.randint(0, 3)
            s |= {"minLength": lo} if self.maybe() else {}
            s |= {"maxLength": r.randint(max(lo, 1), 8)}
        elif pick == "pattern":
            s["pattern"] = r.choice(PATTERNS)
        elif pick == "format":
            s["format"] = r.choice(FORMATS)
        else:
            s["maxLength"] = 6  # unbounded strings run on under random weights
        return s

    def gen_integer(self, depth):
        r, s = self.rng, {"type": "integer"}
        lo = r.randint(-50, 10)
        s |= {r.choice(["minimum", "exclusiveMinimum"]): lo} if self.maybe(0.8) else {}
        s |= {r.choice(["maximum", "exclusiveMaximum"]): lo + r.randint(12, 300)}
        return s

    def gen_number(self, depth):
        r, s = self.rng, {"type": "number"}
        lo = round(r.uniform(-20, 5), 2)
        s |= {r.choice(["minimum", "exclusiveMinimum"]): lo} if self.maybe(0.7) else {}
        s |= {r.choice(["maximum", "exclusiveMaximum"]): lo + r.choice([1.5, 10, 100])}
        return s

    def gen_boolean(self, depth):
        return {"type": "boolean"}

    def gen_null(self, depth):
        return {"type": "null"}

    def gen_enum(self, depth):
        return {"enum": self.rng.sample(VALUES, self.rng.randint(1, 4))}

    def gen_const(self, depth):
        return {"const": self.rng.choice(VALUES), "description": "a constant"}

    def gen_nullable(self, depth):
        return {"type": ["string", "null"], "maxLength": 4}

    def gen_object(self, depth):
        r = self.rng
        names = r.sample(NAMES, r.randint(0, 3))
        s = {"type": "object", "properties": {n: self.any(depth - 1) for n in names}}
        required = [n for n in names if self.maybe(0.7)]
        extra = r.choice(["absent", "false", "true", "schema"])
        if extra != "false" and self.maybe(0.3):
            required.append("undeclared")  # required, not in properties
        if required:
            s["required"] = required
        if extra == "false":
            s["additionalProperties"] = False
        elif extra == "true":
            s["additionalProperties"] = True
        elif extra == "schema":
            s["additionalProperties"] = {"type": "integer", "minimum": 0, "maximum": 9}
            s |= {"maxProperties": len(names) + 2} if self.maybe(0.3) else {}
        if self.maybe(0.2):
            s["title"] = "an object"
        return s

    def gen_array(self, depth):
        r = self.rng
        if self.maybe(0.25):
            s = {"type": "array", "prefixItems": [self.any(depth - 1) for _ in range(2)]}
            return s | {"items": False}
        lo = r.randint(0, 2)
        s = {"type": "array", "items": self.any(depth - 1), "maxItems": lo + r.randint(0, 2)}
        return s | ({"minItems": lo} if lo else {})

    def gen_anyOf(self, depth):
        return {"anyOf": [self.any(depth - 1) for _ in range(self.rng.randint(1, 3))]}

    def gen_oneOf(self, depth):
        if self.maybe():  # branches of different types
            kinds = self.rng.sample(["string", "integer", "boolean", "null", "array"], 2)
            return {"oneOf": [getattr(self, "gen_" + k)(depth - 1) for k in kinds]}
        branches = []  # a tagged union
        for tag in self.rng.sample(["cat", "dog", "eel"], 2):
            b = self.gen_object(depth - 1)
            b["properties"] = {**b["properties"], "kind": {"const": tag}}
            b["required"] = sorted(set(b.get("required", [])) | {"kind"})
            b.pop("additionalProperties", None)
            branches.append(b)
        return {"oneOf": branches}

    def gen_allOf(self, depth):
        return {"allOf": [self.any(depth - 1)]}

    def gen_ref(self, depth):
        name = f"D{len(self.defs)}"
        self.defs[name] = {}  # reserved: the subschema may add definitions of its own
        self.defs[name] = self.any(depth - 1)
        return {"$ref": f"#/$defs/{name}"}

    def root(self, depth: int = 3) -> dict:
        self.defs = {}
        s = self.gen_object(depth) if self.maybe(0.8) else self.any(depth)
        return {**s, "$defs": dict(self.defs)} if self.defs else s


def random_schemas(n: int, seed: int) -> list[dict]:
    "`n` random schemas from seed `seed` (each must build: the generator stays in the subset)."
    gen = SchemaGen(random.Random(seed))
    return [gen.root() for _ in range(n)]


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    "A random-weight Llama (hidden 64, 2 layers) over the demo model's 297-token vocabulary."
    from hetero_infer.testing import tiny_hf_checkpoint

    path = tmp_path_factory.mktemp("tiny-demo-vocab")
    tiny_hf_checkpoint(path, "llama", vocab_size=297, bos_token_id=1, eos_token_id=2)
    for f in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        shutil.copy(DEMO_MODEL_DIR / f, path / f)
    eng = LLMEngine(EngineConfig(model=str(path), max_num_seqs=64, max_model_len=512, seed=0))
    assert any(isinstance(p, StructuredOutputsPlugin) for p in eng.plugins)
    yield eng
    eng.close()


def test_random_schemas_give_valid_outputs(engine):
    schemas = random_schemas(60, seed=0)
    for i, s in enumerate(schemas):
        p = SamplingParams(temperature=1.0, seed=i, max_tokens=400, structured_outputs={"json": s})
        engine.add_request(f"s{i}", [1, 10 + i % 50], p)
    outs = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.finished:
                outs[o.request_id] = o.outputs[0]
    stopped = 0
    for i, s in enumerate(schemas):
        c = outs[f"s{i}"]
        assert c.finish_reason in ("stop", "length"), (s, c)
        if c.finish_reason == "stop":
            stopped += 1
            value = json.loads(c.text)
            v = jsonschema.Draft202012Validator(
                s, format_checker=jsonschema.Draft202012Validator.FORMAT_CHECKER
            )
            assert not list(v.iter_errors(value)), (json.dumps(s), c.text)
    assert stopped >= 0.75 * len(schemas), stopped  # the rest ran into max_tokens


UNENFORCEABLE = [
    *[({k: {"type": "integer"}}, k) for k in ("not", "if", "then", "else", "contains")],
    *[({k: v}, k) for k, v in [("uniqueItems", True), ("minContains", 1), ("maxContains", 2)]],
    ({"dependentRequired": {"a": ["b"]}}, "dependentRequired"),
    ({"dependentSchemas": {"a": {}}}, "dependentSchemas"),
    ({"unevaluatedProperties": False}, "unevaluatedProperties"),
    ({"unevaluatedItems": False}, "unevaluatedItems"),
    ({"$dynamicRef": "#x"}, "$dynamicRef"),
    ({"$dynamicAnchor": "x"}, "$dynamicAnchor"),
    ({"patternProperties": {"^a": {}}}, "patternProperties"),
    ({"allOf": [{"type": "integer"}, {"minimum": 5}]}, "allOf"),
    ({"type": "integer", "maximum": 90, "multipleOf": 5}, "multipleOf"),
    ({"oneOf": [{"type": "integer"}, {"minimum": 0}]}, "oneOf"),
    ({"type": "string", "pattern": "^a+$", "minLength": 2}, "minLength"),
    ({"type": "object", "required": ["z"], "additionalProperties": False}, "required"),
    ({"$ref": "https://example.com/s.json"}, "$ref"),
]


@pytest.mark.parametrize("bad, keyword", UNENFORCEABLE, ids=[k for _, k in UNENFORCEABLE])
def test_unenforceable_keywords_are_refused_by_name(bad, keyword):
    gen = SchemaGen(random.Random(keyword))
    for _ in range(3):  # planted at the root, or in a property of a random object
        host = gen.gen_object(2)
        schema = bad if not host["properties"] else host
        if schema is host:
            name = gen.rng.choice(sorted(host["properties"]))
            host["properties"][name] = bad
        with pytest.raises(
            ValueError, match=f"^json: unsupported schema keyword.*{re.escape(keyword)}"
        ):
            StructuredOutputsParams(json=schema)


def test_every_unsupported_keyword_is_fuzzed():
    planted = {k for bad, k in UNENFORCEABLE}
    assert UNSUPPORTED_SCHEMA_KEYWORDS <= planted, UNSUPPORTED_SCHEMA_KEYWORDS - planted
