"""The prompts of benchmarks/peers.py's workloads (e) and (f): real text, because what speculative decoding
gains depends on what is being written. (e) asks for a code file back with one identifier renamed (mostly
copying the prompt: drafts are often right); (f) continues a story freely (little to copy: drafts are mostly
wrong, and must not cost). Plain completion prompts that end where the answer starts, so a base model (the
default GGUF has no chat template) and an instruct model alike write the answer. A numbered ticket opens
every prompt, so no engine ever reuses a cached prefix."""
from __future__ import annotations

from pathlib import Path

from vllmpy.tokenizer.tokenizer import Tokenizer

DATA = Path(__file__).with_name("data")
SOURCE = DATA / "code_edit_source.py.txt"
STORY = DATA / "prose_prompt.txt"
RENAME = ("queue", "backlog")  # (e): the identifier renamed, and its new name


def code_edit(ticket: int) -> str:
    old, new = RENAME
    return (f"Ticket {ticket:06d}. Rename the identifier `{old}` to `{new}` everywhere in this Python file and "
            f"return the whole file, otherwise unchanged.\n\n```python\n{SOURCE.read_text()}```\n\n"
            f"The whole file with `{old}` renamed to `{new}`:\n\n```python\n")


def prose(ticket: int) -> str:
    return f"Ticket {ticket:06d}. Continue this story.\n\n{STORY.read_text()}"


TEXTS = {"e": code_edit, "f": prose}


def source_lines() -> int:
    return len(SOURCE.read_text().splitlines())


class TextPrompts:
    """Token ids of a workload's prompt, with a new ticket number each time."""

    def __init__(self, tokenizer: Tokenizer, seed: int) -> None:
        self.tokenizer, self.ticket = tokenizer, seed * 1000

    def take(self, workload: str) -> list[int]:
        self.ticket += 1
        return self.tokenizer.encode(TEXTS[workload](self.ticket))


if __name__ == "__main__":  # the prompt text, for vllm-cli --prompt "$(python benchmarks/text_prompts.py e)"
    import sys

    print(TEXTS[sys.argv[1]](1), end="")
