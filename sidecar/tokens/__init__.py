"""Prompt tokens counted locally: the model's tokenizer and chat template, rendered as
vLLM renders them, and the policy that checks them against the server's /tokenize.

Reads the model's tokenizer files; no HTTP, no asyncio."""

from sidecar.tokens.chat_template import CannotRender, ChatTemplate, content_format
from sidecar.tokens.local import LocalTokenizer, TokenizerFiles, TokenizerFilesError, find_files
from sidecar.tokens.verification import Plan, Verification, shape_of

__all__ = [
    "CannotRender",
    "ChatTemplate",
    "LocalTokenizer",
    "Plan",
    "TokenizerFiles",
    "TokenizerFilesError",
    "Verification",
    "content_format",
    "find_files",
    "shape_of",
]
