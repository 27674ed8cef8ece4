"""Chat messages with image parts (vLLM's shapes: {"type": "image_url", "image_url": {"url": ...}} or
{"type": "image_pil", "image_pil": PIL.Image}): where the images are, and each message's content as the
chat template takes it. As vLLM: a template that loops over a message's content parts gets the parts,
each image as {"type": "image"} (it writes the model's marker itself, as Gemma 3's does); any other gets
one string, text parts and each image's marker joined by newlines (vLLM's string content format)."""
from __future__ import annotations

import re

from vllmpy.multimodal.media import MediaConfig, load_image

IMAGE_PART_TYPES = ("image_url", "image_pil")
# `{% for item in message['content'] %}` / `message.content`: the template reads parts (vLLM's "openai" format).
_LOOPS_OVER_PARTS = re.compile(r"for\s+\w+\s+in\s+\w+\s*(\[\s*['\"]content['\"]\s*\]|\.content\b)")


def template_takes_parts(template: str | None) -> bool:
    return bool(template) and _LOOPS_OVER_PARTS.search(template) is not None


def chat_image_sources(messages: list[dict]) -> list[tuple[str, object]]:
    """(where, source) per image part in prompt order; where = "messages[i].content[j]"."""
    found = []
    for i, message in enumerate(messages):
        content = message.get("content")
        for j, part in enumerate(content if isinstance(content, list) else []):
            kind = part.get("type") if isinstance(part, dict) else None
            if kind == "image_url":
                url = part.get("image_url")
                found.append((f"messages[{i}].content[{j}]", url.get("url") if isinstance(url, dict) else url))
            elif kind == "image_pil":
                found.append((f"messages[{i}].content[{j}]", part.get("image_pil")))
    return found


def template_content(content: object, image_marker: str | None, takes_parts: bool) -> object:
    """A message's content for the template: a string passes through; parts become one string (text and
    `image_marker` per image, joined by newlines), or with `takes_parts` and images the parts themselves
    with each image as {"type": "image"}. ValueError when there are images and the model takes none
    (image_marker None)."""
    if not isinstance(content, list):
        return "" if content is None else content
    has_images = False
    for part in content:
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in IMAGE_PART_TYPES:
            if image_marker is None:
                raise ValueError(f"messages: content parts of type {kind!r} need a multimodal model; this model "
                                 f"takes text only")
            has_images = True
        elif kind != "text":
            raise ValueError(f"messages: content part type {kind!r} is not supported; send 'text' or 'image_url'")
    if has_images and takes_parts:
        return [{"type": "image"} if p["type"] in IMAGE_PART_TYPES else p for p in content]
    return "\n".join(image_marker if p["type"] in IMAGE_PART_TYPES else p.get("text", "") for p in content)


def load_conversation_images(conversation: list[dict], processor, media: MediaConfig, architecture: str,
                             template: str | None) -> tuple[list[dict], list]:
    """Offline chat: the conversation as its template takes it, and its images loaded (PIL images pass
    through; URLs as the server reads them). ValueError names the part."""
    sources = chat_image_sources(conversation)
    if not sources:
        return conversation, []
    if processor is None:
        raise ValueError(f"{sources[0][0]}: image parts need a multimodal model; model {architecture} takes "
                         f"text only")
    processor.check_count(len(sources), "messages")
    images = [load_image(source, media, where) for where, source in sources]
    marker, takes_parts = processor.layout.chat_marker or processor.layout.marker, template_takes_parts(template)
    return [{**m, "content": template_content(m.get("content"), marker, takes_parts)} for m in conversation], images
