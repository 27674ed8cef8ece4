"""Test-only fault injection: make the engine fail one chosen request, or die, on demand.

Tests use it to prove that a failing request fails alone and that a dead engine makes the server answer
503 and exit. It is read once at engine start from the environment and does nothing unless set:

    VLLMPY_TEST_FAULTS='{"fail": [9, 8, 7], "die": [6, 5, 4]}'

A request whose prompt token ids contain the "fail" sequence raises `InjectedFault` while its output is
processed inside the engine step; one whose prompt contains the "die" sequence raises
`InjectedEngineDeath`, which no per-request guard catches, so the engine thread dies as an unknown bug
would make it. Never set it in production.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass

ENV_VAR = "VLLMPY_TEST_FAULTS"


class InjectedFault(RuntimeError):
    """The failure a "fail"-marked request meets inside the engine step."""


class InjectedEngineDeath(BaseException):
    """Not an Exception: the engine's per-request guards catch Exception, so this one ends the loop."""


@dataclass(frozen=True)
class FaultInjector:
    fail: tuple[int, ...] = ()
    die: tuple[int, ...] = ()

    @classmethod
    def from_env(cls) -> FaultInjector | None:
        """The injector VLLMPY_TEST_FAULTS asks for, or None (the normal case) when it is unset."""
        raw = os.environ.get(ENV_VAR)
        if not raw:
            return None
        spec = json.loads(raw)
        if not isinstance(spec, dict) or not set(spec) <= {"fail", "die"}:
            raise ValueError(f"{ENV_VAR} must be a JSON object with keys 'fail' and/or 'die', got {raw!r}")
        for key, marker in spec.items():
            if not marker or not all(isinstance(t, int) for t in marker):
                raise ValueError(f"{ENV_VAR}.{key} must be a non-empty list of token ids, got {marker!r}")
        return cls(tuple(spec.get("fail", ())), tuple(spec.get("die", ())))

    def check(self, request_id: str, prompt_token_ids: list[int]) -> None:
        """Raise the fault this request's prompt is marked for, if any."""
        if _contains(prompt_token_ids, self.die):
            raise InjectedEngineDeath(f"injected engine death (request {request_id})")
        if _contains(prompt_token_ids, self.fail):
            raise InjectedFault(f"injected fault (request {request_id})")


def _contains(tokens: list[int], marker: tuple[int, ...]) -> bool:
    n = len(marker)
    return n > 0 and any(tuple(tokens[i:i + n]) == marker for i in range(len(tokens) - n + 1))
