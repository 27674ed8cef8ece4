"""Chat content with images as templates take it (vllmpy/multimodal/chat.py): a template that loops over
content parts gets the parts (images as {"type": "image"}), any other one string; refusals name the part."""
from __future__ import annotations

import pytest

from vllmpy.multimodal.chat import chat_image_sources, template_content, template_takes_parts

GEMMA3_LOOP = "{%- for item in message['content'] -%}{%- if item['type'] == 'image' -%}<start_of_image>"
STRING_ONLY = "{% for message in messages %}{{ message['content'] }}{% endfor %}"
PARTS = [{"type": "text", "text": "Look:"}, {"type": "image_url", "image_url": {"url": "data:,"}},
         {"type": "text", "text": "what is it?"}]


def test_templates_that_loop_over_parts_are_detected():
    assert template_takes_parts(GEMMA3_LOOP)
    assert template_takes_parts("{% for p in m.content %}{{ p.text }}{% endfor %}")
    assert not template_takes_parts(STRING_ONLY)
    assert not template_takes_parts(None)


def test_content_by_template_kind():
    assert template_content(PARTS, "<img>", takes_parts=False) == "Look:\n<img>\nwhat is it?"
    assert template_content(PARTS, "<img>", takes_parts=True) == [PARTS[0], {"type": "image"}, PARTS[2]]
    text_only = [PARTS[0], PARTS[2]]
    assert template_content(text_only, "<img>", takes_parts=True) == "Look:\nwhat is it?"  # as before images
    assert template_content("plain", None, takes_parts=True) == "plain"
    assert template_content(None, None, takes_parts=False) == ""


def test_refusals_and_sources():
    with pytest.raises(ValueError, match="'image_url' need a multimodal model"):
        template_content(PARTS, None, takes_parts=False)
    with pytest.raises(ValueError, match="'input_audio' is not supported"):
        template_content([{"type": "input_audio"}], "<img>", takes_parts=False)
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": PARTS}]
    assert chat_image_sources(messages) == [("messages[1].content[1]", "data:,")]
