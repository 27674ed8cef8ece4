"""vLLM's StructuredOutputsParams: which constraint a request's output must satisfy (plain data, no engine)."""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

# The constraint kinds, in the order vLLM lists them; exactly one must be set.
KINDS = ("json", "regex", "choice", "grammar", "json_object")


def json_object(value: str | dict[str, Any], name: str, what: str) -> dict[str, Any]:
    """`value`, parsed when it is JSON text; ValueError naming `name` unless it is a JSON object."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{name}: {what} is not valid JSON ({exc})") from None
    if not isinstance(value, dict):
        raise ValueError(f"{name}: {what} must be a JSON object, got {value!r}")
    return value


@dataclass
class StructuredOutputsParams:
    """One constraint on the generated text.

    json: a JSON schema (dict or JSON text); regex: the whole output must match it; choice: the output is
    one of these strings; grammar: a GBNF (llama.cpp) or Lark grammar; json_object: any JSON object.
    disable_any_whitespace: JSON without free whitespace between tokens (small models otherwise may pad
    with whitespace for a long time). disable_additional_properties: a JSON schema's objects take only the
    properties they declare (OpenAI's strict; see strict.py).
    """

    json: str | dict[str, Any] | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False

    def __post_init__(self) -> None:
        chosen = [k for k in KINDS if getattr(self, k) not in (None, False)]
        if not chosen:
            raise ValueError(f"structured_outputs: set one of {', '.join(KINDS)}; none is set")
        if len(chosen) > 1:
            raise ValueError(f"structured_outputs: set only one of {', '.join(KINDS)}; got {', '.join(chosen)}")
        if self.json is not None and not isinstance(self.json, (str, dict)):
            raise ValueError(
                f"structured_outputs.json must be a JSON schema (dict or str), got {type(self.json).__name__}")
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value.strip()):
                raise ValueError(f"structured_outputs.{name} must be a non-empty string, got {value!r}")
        if self.choice is not None:
            if isinstance(self.choice, str) or not self.choice or not all(isinstance(c, str) for c in self.choice):
                raise ValueError(f"structured_outputs.choice must be a non-empty list of strings, got {self.choice!r}")
            self.choice = list(self.choice)
        if self.json_object not in (None, True, False):
            raise ValueError(f"structured_outputs.json_object must be a bool, got {self.json_object!r}")
        for name in ("disable_any_whitespace", "disable_additional_properties"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"structured_outputs.{name} must be a bool, got {getattr(self, name)!r}")

    @property
    def kind(self) -> str:
        return next(k for k in KINDS if getattr(self, k) not in (None, False))

    def key(self) -> tuple[str, str, bool, bool]:
        """Hashable identity of the constraint: equal keys compile to the same grammar."""
        kind = self.kind
        value = getattr(self, kind)
        if kind == "json" and isinstance(value, dict):
            spec = json.dumps(value, sort_keys=True)
        elif kind == "choice":
            spec = json.dumps(value)
        else:
            spec = str(value)
        return kind, spec, self.disable_any_whitespace, self.disable_additional_properties


# vLLM's older name for the same parameters (SamplingParams(guided_decoding=GuidedDecodingParams(...))).
GuidedDecodingParams = StructuredOutputsParams
