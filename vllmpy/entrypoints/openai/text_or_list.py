"""A field that is a string or a list (content, input, system): a union tagged by which of the two was sent,
so that a refusal names only that branch ("content.list.0.type: ...") rather than both."""
from __future__ import annotations

from typing import Annotated, Any, Union

from pydantic import Discriminator, Tag


def _kind(value: Any) -> str:
    return "text" if isinstance(value, str) else "list"


def text_or_list(items: Any) -> Any:
    """`str | items`, tagged; `items` is a list type (it may carry its own constraints)."""
    return Annotated[Union[Annotated[str, Tag("text")], Annotated[items, Tag("list")]], Discriminator(_kind)]
