"""Flag checks every mode runs before it loads a model or opens a connection."""
from __future__ import annotations

import argparse


def require_positive(args: argparse.Namespace, *names: str) -> None:
    for name in names:
        value = getattr(args, name)
        if value < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {value}")
