"""The tokenizer package's errors, apart from chat_template.py so that importing them does not import jinja2
(a process that never renders a chat template, such as vllm-cli, then never pays for it)."""


class ChatTemplateError(ValueError):
    """The chat template cannot be rendered for this request; the message says why."""
