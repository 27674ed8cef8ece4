"""Checks on a parsed JSON body as a whole, before any field is read: bounded nesting and valid Unicode.

JSON may escape lone UTF-16 surrogates ("\\ud800"), which Python decodes into a str that cannot be encoded
again; such text would fail in the tokenizer, a grammar or the response, so it is refused here, naming the
place. Deep nesting is bounded so that nothing downstream (templates, grammar compilers) recurses without
limit. The walk is iterative: a hostile body cannot exhaust the stack here either.
"""
from __future__ import annotations

from typing import Any

from vllmpy.entrypoints.openai.errors import RequestError

# Levels of objects and arrays, the body itself being 1. A JSON schema nested 45 objects deep still fits,
# and the grammar compiler's own limit (serde_json: 128) is never reached.
MAX_JSON_DEPTH = 100


def check_json_body(body: dict[str, Any]) -> None:
    """RequestError naming the top-level field whose value nests too deeply or holds invalid Unicode."""
    pending: list[tuple[dict | list, str, int]] = []
    _visit(body, "", 1, pending)
    while pending:
        value, path, depth = pending.pop()
        if depth > MAX_JSON_DEPTH:
            field = _top_field(path)
            raise RequestError(f"{field} nests objects and arrays more than {MAX_JSON_DEPTH} levels deep (counting "
                               f"the request body as 1); flatten it", field)
        _visit(value, path, depth, pending)


def _visit(value: dict | list, path: str, depth: int, pending: list[tuple[dict | list, str, int]]) -> None:
    """Check the strings directly inside `value`; queue the containers (scalars cost no path string)."""
    items = value.items() if isinstance(value, dict) else enumerate(value)
    for key, item in items:
        if isinstance(key, str):
            _check_text(key, f"a key in {path}" if path else "a field name", path or None)
        if isinstance(item, (str, dict, list)):
            where = _child_path(path, key)
            if isinstance(item, str):
                _check_text(item, where, where)
            else:
                pending.append((item, where, depth + 1))


def _child_path(path: str, key: str | int) -> str:
    if not path:
        return str(key)
    return f"{path}.{key}" if isinstance(key, str) else f"{path}[{key}]"


def _check_text(text: str, where: str, path: str | None) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise RequestError(f"{where} is not valid Unicode: it holds the lone surrogate \\u{ord(text[exc.start]):04x} "
                           f"at character {exc.start}; send text as UTF-8 (escaped surrogates must come in pairs)",
                           _top_field(path) if path else None) from None


def _top_field(path: str) -> str:
    """The request field a path starts in ("messages[0].content" -> "messages")."""
    return path.split(".", 1)[0].split("[", 1)[0]
