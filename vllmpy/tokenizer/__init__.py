"""Tokenizers for Hugging Face directories and GGUF files, streaming detokenization, chat templates."""

from vllmpy.tokenizer.detokenizer import IncrementalDetokenizer
from vllmpy.tokenizer.errors import ChatTemplateError
from vllmpy.tokenizer.tokenizer import Tokenizer

__all__ = ["ChatTemplateError", "IncrementalDetokenizer", "Tokenizer"]
