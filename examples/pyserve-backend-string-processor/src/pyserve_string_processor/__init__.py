"""An example third-party pyserve backend: keyword-based sentiment labels for text.

Registered under the entry-point group ``pyserve.backends`` as ``string_processor``; a model
uses it with ``backend: "string_processor"`` in its config.pbtxt.
"""

from __future__ import annotations

from pyserve_string_processor.backend import LABEL, TEXT, TOKEN_COUNT, StringProcessorBackend
from pyserve_string_processor.sentiment import KeywordClassifier, tokenize

__all__ = ["LABEL", "TEXT", "TOKEN_COUNT", "KeywordClassifier", "StringProcessorBackend", "tokenize"]
