"""The request fields that constrain the output, mapped to one StructuredOutputsParams.

OpenAI's response_format, vLLM's structured_outputs and its older guided_* names all say the same thing,
so a request may send only one of them; refusals name the field the client actually sent.
"""
from __future__ import annotations

from dataclasses import dataclass, fields

from vllmpy.entrypoints.openai.errors import RequestError
from vllmpy.entrypoints.openai.protocol import ResponseFormat, SamplingRequest
from vllmpy.sampling_params import StructuredOutputsParams

# vLLM's older top-level names → the StructuredOutputsParams field each sets.
_GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}
_FIELDS = ("response_format", "structured_outputs", *_GUIDED)
_PARAMS_KEYS = tuple(f.name for f in fields(StructuredOutputsParams))


@dataclass(frozen=True)
class Constraint:
    params: StructuredOutputsParams
    field: str  # the request field it came from; a refusal of the spec names it


def request_constraint(request: SamplingRequest) -> Constraint | None:
    """The request's constraint, or None; 400 when several fields set one or the spec is malformed."""
    sent = [name for name in _FIELDS if getattr(request, name) is not None]
    response_format = request.response_format
    if (response_format is not None and response_format.object_schema is not None
            and response_format.type != "json_object"):
        raise RequestError(f'response_format.schema is read only with type "json_object", not '
                           f'"{response_format.type}"; a "json_schema" format carries its schema in '
                           'json_schema.schema', "response_format")
    if response_format is not None and response_format.type == "text":
        sent.remove("response_format")  # plain text: no constraint
    if len(sent) > 1:
        raise RequestError(f"{', '.join(sent)} each constrain the output; send only one of them", sent[1])
    if not sent:
        return None
    field = sent[0]
    try:
        return Constraint(_params(request, field), field)
    except ValueError as exc:
        raise RequestError(str(exc), field) from None


def _params(request: SamplingRequest, field: str) -> StructuredOutputsParams:
    value = getattr(request, field)
    if field == "response_format":
        return _from_response_format(value)
    if field == "structured_outputs":
        unknown = sorted(set(value) - set(_PARAMS_KEYS))
        if unknown:
            raise ValueError(f"structured_outputs: unsupported key {', '.join(unknown)}; "
                             f"supported: {', '.join(_PARAMS_KEYS)}")
        return StructuredOutputsParams(**value)
    return StructuredOutputsParams(**{_GUIDED[field]: value})


def _from_response_format(response_format: ResponseFormat) -> StructuredOutputsParams:
    """OpenAI's json_object and json_schema (strict: no undeclared properties), and instructor's json_object
    with a `schema` beside the type, which constrains the output like a json_schema would."""
    if response_format.type == "json_object":
        if response_format.object_schema is not None:
            return StructuredOutputsParams(json=response_format.object_schema)
        return StructuredOutputsParams(json_object=True)
    spec = response_format.json_schema
    if spec is None or spec.json_schema is None:
        raise ValueError('response_format of type "json_schema" needs json_schema.schema, the JSON schema '
                         'the output must follow')
    return StructuredOutputsParams(json=spec.json_schema, disable_additional_properties=bool(spec.strict))
