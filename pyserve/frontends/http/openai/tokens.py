"""Counting the tokens of a text, for ``usage`` and the context-length check.

A model's own counts win where it reports them (outputs ``num_input_tokens`` /
``num_output_tokens``, read by ``pyserve.frontends.http.openai.binding``). Where it does not, the text is
counted with the model's tokenizer: a ``tokenizer.json`` in its version or model directory,
read with the ``tokenizers`` package when that is installed. Without one, a token is a UTF-8
byte (exact for byte-level models, an upper bound for the others).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

log = logging.getLogger("pyserve.openai")


class TokenCounter:
    """Counts tokens of text for one model. Thread-safe (``tokenizers`` encoders are).

    :param tokenizer: a ``tokenizers.Tokenizer``, or None to count UTF-8 bytes.
    :param origin: where the tokenizer came from (``"utf-8 bytes"`` without one).
    """

    def __init__(self, tokenizer: Any = None, origin: str = "utf-8 bytes") -> None:
        self._tokenizer = tokenizer
        self.origin = origin

    @property
    def exact(self) -> bool:
        """Whether counts come from the model's tokenizer (else they are UTF-8 bytes)."""
        return self._tokenizer is not None

    def count(self, text: str) -> int:
        """The number of tokens ``text`` takes (no special tokens added)."""
        if self._tokenizer is None:
            return len(text.encode("utf-8", "surrogatepass"))
        return len(self._tokenizer.encode(text, add_special_tokens=False).ids)


def load_counter(directories: list[Path]) -> TokenCounter:
    """The counter for a model whose files are in ``directories`` (searched in order).

    Reads files: call it off the event loop. A ``tokenizer.json`` that cannot be read is
    logged as a warning and bytes are counted instead (a model serves without its tokenizer).
    """
    for directory in directories:
        path = directory / "tokenizer.json"
        if not path.is_file():
            continue
        try:
            from tokenizers import Tokenizer
        except ImportError:
            log.info("%s: install the 'tokenizers' package to count tokens with it; counting UTF-8 bytes", path)
            return TokenCounter()
        try:
            return TokenCounter(Tokenizer.from_file(str(path)), str(path))
        except Exception as exc:  # noqa: BLE001 - a broken file must not stop the model being served
            log.warning("%s cannot be read as a tokenizer (%s); counting UTF-8 bytes", path, exc)
            return TokenCounter()
    return TokenCounter()
