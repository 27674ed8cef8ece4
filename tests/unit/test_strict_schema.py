"""Strict JSON schemas without a server: the transform (nested cases, against schemas closed by hand and
checked with jsonschema), the request fields that ask for it, vLLM's --structured-outputs-config, and the
compiled grammar refusing an undeclared key whether the request or the engine default asks."""
from __future__ import annotations

import copy

import jsonschema
import pytest

from vllmpy import LLM, SamplingParams
from vllmpy.entrypoints.openai.api_server import main as server_main
from vllmpy.entrypoints.openai.errors import RequestError
from vllmpy.entrypoints.openai.protocol import ChatCompletionRequest
from vllmpy.entrypoints.openai.structured import request_constraint
from vllmpy.sampling_params import StructuredOutputsParams
from vllmpy.structured_output.config import StructuredOutputsConfig
from vllmpy.structured_output.manager import StructuredOutputManager
from vllmpy.structured_output.strict import forbid_additional_properties

CLOSED = {"additionalProperties": False}
OBJ = {"type": "object", "properties": {"a": {"type": "integer"}}}


@pytest.mark.parametrize("schema,expected", [
    (OBJ, {**OBJ, **CLOSED}),
    ({"type": "object"}, {"type": "object", **CLOSED}),  # declares nothing: only {} is left
    ({"type": ["object", "null"]}, {"type": ["object", "null"], **CLOSED}),
    ({"properties": {"o": OBJ}}, {"properties": {"o": {**OBJ, **CLOSED}}, **CLOSED}),
    ({"type": "array", "items": OBJ}, {"type": "array", "items": {**OBJ, **CLOSED}}),
    ({"type": "array", "items": [OBJ]}, {"type": "array", "items": [{**OBJ, **CLOSED}]}),  # draft-4 tuples
    ({"type": "array", "prefixItems": [OBJ], "items": OBJ},
     {"type": "array", "prefixItems": [{**OBJ, **CLOSED}], "items": {**OBJ, **CLOSED}}),
    ({"$ref": "#/$defs/X", "$defs": {"X": OBJ}}, {"$ref": "#/$defs/X", "$defs": {"X": {**OBJ, **CLOSED}}}),
    ({"definitions": {"X": OBJ}}, {"definitions": {"X": {**OBJ, **CLOSED}}}),
    ({"anyOf": [OBJ, {"type": "null"}], "oneOf": [OBJ], "allOf": [OBJ]},
     {"anyOf": [{**OBJ, **CLOSED}, {"type": "null"}], "oneOf": [{**OBJ, **CLOSED}], "allOf": [{**OBJ, **CLOSED}]}),
    ({"not": OBJ, "if": OBJ, "then": OBJ, "else": OBJ},
     {"not": {**OBJ, **CLOSED}, "if": {**OBJ, **CLOSED}, "then": {**OBJ, **CLOSED}, "else": {**OBJ, **CLOSED}}),
    # an explicit additionalProperties is the author's: kept, and a schema there is walked into
    ({**OBJ, "additionalProperties": True}, {**OBJ, "additionalProperties": True}),
    ({"type": "object", "additionalProperties": OBJ}, {"type": "object", "additionalProperties": {**OBJ, **CLOSED}}),
    # property names and data are not schemas
    ({"properties": {"properties": {"type": "string"}, "items": {"type": "integer"}}},
     {"properties": {"properties": {"type": "string"}, "items": {"type": "integer"}}, **CLOSED}),
    ({"type": "string", "default": {"properties": {}}, "enum": [{"type": "object"}], "const": {"properties": {}}},
     {"type": "string", "default": {"properties": {}}, "enum": [{"type": "object"}], "const": {"properties": {}}}),
    ({"properties": {"x": True, "y": False}}, {"properties": {"x": True, "y": False}, **CLOSED}),
], ids=["object", "bare-object", "type-list", "nested", "items", "items-tuple", "prefixItems", "$defs",
        "definitions", "anyOf-oneOf-allOf", "not-if-then-else", "explicit-true", "schema-valued",
        "property-names", "data-keywords", "boolean-schemas"])
def test_transform(schema, expected):
    before = copy.deepcopy(schema)
    assert forbid_additional_properties(schema) == expected
    assert schema == before  # the request's own schema is not modified


PERSON = {"type": "object", "required": ["name", "address"], "properties": {
    "name": {"type": "string"},
    "address": {"type": "object", "properties": {"city": {"type": "string"}}},
    "pets": {"type": "array", "items": {"$ref": "#/$defs/Pet"}},
    "nick": {"anyOf": [{"type": "null"}, {"type": "object", "properties": {"short": {"type": "string"}}}]}},
    "$defs": {"Pet": {"type": "object", "properties": {"kind": {"type": "string"}}}}}
GOOD = {"name": "Ann", "address": {"city": "Rome"}, "pets": [{"kind": "cat"}], "nick": {"short": "A"}}


@pytest.mark.parametrize("extra_at", [(), ("address",), ("pets", 0), ("nick",)])
def test_strict_schema_refuses_undeclared_keys_at_any_depth(extra_at):
    instance = copy.deepcopy(GOOD)
    target = instance
    for step in extra_at:
        target = target[step]
    target["zzz"] = 1
    strict = forbid_additional_properties(PERSON)
    jsonschema.validate(GOOD, strict)
    jsonschema.validate(instance, PERSON)  # the open schema takes it
    with pytest.raises(jsonschema.ValidationError, match="zzz"):
        jsonschema.validate(instance, strict)


# ---------------------------------------------------------------- the request fields


def _constraint(**body):
    return request_constraint(ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], **body))


@pytest.mark.parametrize("strict", [True, False, None])
def test_response_format_strict_sets_disable_additional_properties(strict):
    spec = {"name": "p", "schema": PERSON, **({} if strict is None else {"strict": strict})}
    params = _constraint(response_format={"type": "json_schema", "json_schema": spec}).params
    assert params.json == PERSON and params.disable_additional_properties is bool(strict)


def test_instructor_json_object_schema_is_the_constraint():
    params = _constraint(response_format={"type": "json_object", "schema": PERSON}).params
    assert params.kind == "json" and params.json == PERSON
    assert _constraint(response_format={"type": "json_object"}).params.kind == "json_object"


@pytest.mark.parametrize("kind", ["text", "json_schema"])
def test_schema_beside_another_type_is_refused(kind):
    with pytest.raises(RequestError) as refused:
        _constraint(response_format={"type": kind, "schema": PERSON, "json_schema": {"name": "p", "schema": PERSON}})
    assert refused.value.param == "response_format" and "json_object" in refused.value.message


def test_structured_outputs_field_takes_disable_additional_properties():
    params = _constraint(structured_outputs={"json": PERSON, "disable_additional_properties": True}).params
    assert params.disable_additional_properties
    with pytest.raises(RequestError, match="disable_additional_properties must be a bool"):
        _constraint(structured_outputs={"json": PERSON, "disable_additional_properties": "yes"})


def test_params_key_tells_strict_from_open():
    assert StructuredOutputsParams(json=OBJ).key() != StructuredOutputsParams(
        json=OBJ, disable_additional_properties=True).key()


# ---------------------------------------------------------------- --structured-outputs-config


def test_config_parses_vllm_keys():
    config = StructuredOutputsConfig.parse('{"disable_additional_properties": true, "backend": "guidance"}')
    assert config.disable_additional_properties and not config.disable_any_whitespace
    assert StructuredOutputsConfig.parse(None) == StructuredOutputsConfig()
    assert StructuredOutputsConfig.parse({"disable_any_whitespace": True}).disable_any_whitespace
    params = config.apply(StructuredOutputsParams(json=OBJ))
    assert params.disable_additional_properties and not params.disable_any_whitespace


@pytest.mark.parametrize("value,words", [
    ('{"disable_additional_propertie": true}', ["unsupported key disable_additional_propertie",
                                                "disable_additional_properties"]),
    ('{"reasoning_parser": "qwen3"}', ["unsupported key reasoning_parser"]),
    ('{"backend": "xgrammar"}', ["backend", "auto, guidance"]),
    ('{"disable_any_whitespace": 1}', ["disable_any_whitespace must be true or false"]),
    ("[true]", ["JSON object"]),
    ("{oops", ["not valid JSON"]),
])
def test_config_refuses_by_name(value, words):
    with pytest.raises(ValueError) as refused:
        StructuredOutputsConfig.parse(value)
    assert all(word in str(refused.value) for word in words), refused.value


def test_server_flag_refuses_an_unknown_key_before_loading(capsys):
    assert server_main(["--structured-outputs-config", '{"nope": true}', "--model", "/nonexistent"]) == 2
    assert "unsupported key nope" in capsys.readouterr().err


# ---------------------------------------------------------------- the compiled grammar


@pytest.fixture(scope="module")
def tiny_llm(tiny_llama_dir) -> LLM:
    return LLM(model=tiny_llama_dir, num_blocks=64, structured_outputs_config={"disable_additional_properties": True})


@pytest.mark.parametrize("request_strict,engine_strict,accepted", [
    (False, False, True), (True, False, False), (False, True, False)])
def test_grammar_refuses_an_undeclared_key(tiny_llm, request_strict, engine_strict, accepted):
    tokenizer = tiny_llm.get_tokenizer()
    manager = StructuredOutputManager(tokenizer, tokenizer.vocab_size, set(),
                                      StructuredOutputsConfig(disable_additional_properties=engine_strict))
    params = StructuredOutputsParams(json=PERSON, disable_additional_properties=request_strict)
    grammar = manager.new_grammar(params, [])
    declared = '{"name": "Ann", "address": {"city": "Rome"'
    assert grammar.accept(tokenizer.encode(declared, add_special_tokens=False))
    assert grammar.accept(tokenizer.encode(', "zip": 1}}', add_special_tokens=False)) is accepted


def test_llm_structured_outputs_config_reaches_the_engine(tiny_llm):
    """With the engine default on, a schema declaring no property leaves the random model only `{}`."""
    params = SamplingParams(temperature=1.0, seed=0, max_tokens=16, n=4, structured_outputs=StructuredOutputsParams(
        json={"type": "object", "properties": {}}, disable_any_whitespace=True))
    [out] = tiny_llm.generate(["Hello"], params, use_tqdm=False)
    assert [c.text for c in out.outputs] == ["{}"] * 4
