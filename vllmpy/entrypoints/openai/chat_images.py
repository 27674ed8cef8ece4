"""image_url content parts of chat messages on the server: refused by what is wrong (param "messages", the
message names the part), counted against --limit-mm-per-prompt, then loaded off the event loop."""
from __future__ import annotations

import asyncio

from PIL import Image

from vllmpy.entrypoints.openai.errors import RequestError
from vllmpy.multimodal.chat import chat_image_sources
from vllmpy.multimodal.media import MediaConfig, MediaError, load_image
from vllmpy.multimodal.processor import MultiModalProcessor


async def load_chat_images(messages: list[dict], processor: MultiModalProcessor | None, media: MediaConfig,
                           architecture: str) -> list[Image.Image]:
    """`messages` as dumped from the request (dicts)."""
    parts = chat_image_sources(messages)
    if not parts:
        return []
    if processor is None:
        raise RequestError(f"{parts[0][0]}: content parts of type 'image_url' need a multimodal model; model "
                           f"{architecture} takes text only", "messages")
    try:
        processor.check_count(len(parts), "messages")
    except ValueError as exc:
        raise RequestError(str(exc), "messages") from None
    images = []
    for where, url in parts:
        try:  # a download or a decode must not stall the event loop
            images.append(await asyncio.to_thread(load_image, url, media, f"{where}.image_url"))
        except MediaError as exc:
            raise RequestError(f"{exc.field}: {exc}", "messages") from None
    return images
