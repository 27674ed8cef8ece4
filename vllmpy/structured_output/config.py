"""vLLM's StructuredOutputsConfig: engine-wide defaults for every constrained request
(`--structured-outputs-config '{"disable_additional_properties": true}'`, `LLM(structured_outputs_config=...)`).

Only llguidance is built in, so of vLLM's backends "auto" and "guidance" are accepted and fallback never
happens; vLLM's reasoning keys belong to --reasoning-parser here and are refused with the rest by name.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, fields
from typing import Any

from vllmpy.structured_output.params import StructuredOutputsParams, json_object

BACKENDS = ("auto", "guidance")


@dataclass(frozen=True)
class StructuredOutputsConfig:
    backend: str = "auto"
    disable_fallback: bool = False  # accepted for vLLM's sake: with one backend there is nothing to fall back to
    disable_any_whitespace: bool = False  # compact JSON for every request
    disable_additional_properties: bool = False  # every JSON schema strict (see strict.py)

    def __post_init__(self) -> None:
        if self.backend not in BACKENDS:
            raise ValueError(f"--structured-outputs-config: backend must be one of {', '.join(BACKENDS)} "
                             f"(llguidance is the only built-in backend), got {self.backend!r}")
        for f in fields(self):
            if f.type == "bool" and not isinstance(getattr(self, f.name), bool):
                raise ValueError(f"--structured-outputs-config: {f.name} must be true or false, "
                                 f"got {getattr(self, f.name)!r}")

    @classmethod
    def parse(cls, value: StructuredOutputsConfig | dict[str, Any] | str | None) -> StructuredOutputsConfig:
        """From the flag's JSON text, a dict of vLLM's key names, or an instance; unknown keys are refused."""
        if value is None or isinstance(value, cls):
            return value or cls()
        value = json_object(value, "--structured-outputs-config", "the value")
        known = [f.name for f in fields(cls)]
        unknown = sorted(set(value) - set(known))
        if unknown:
            raise ValueError(f"--structured-outputs-config: unsupported key {', '.join(unknown)}; "
                             f"supported: {', '.join(known)}")
        return cls(**value)

    def apply(self, params: StructuredOutputsParams) -> StructuredOutputsParams:
        """The request's params with the engine-wide defaults added (a default can only tighten a request)."""
        whitespace = params.disable_any_whitespace or self.disable_any_whitespace
        additional = params.disable_additional_properties or self.disable_additional_properties
        if (whitespace, additional) == (params.disable_any_whitespace, params.disable_additional_properties):
            return params
        return dataclasses.replace(params, disable_any_whitespace=whitespace,
                                   disable_additional_properties=additional)
