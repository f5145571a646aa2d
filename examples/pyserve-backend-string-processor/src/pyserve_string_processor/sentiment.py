"""The model itself, free of any server code: tokenizing and keyword scoring.

Keeping this part independent of pyserve is what makes a backend easy to test; the
backend class (``backend.py``) only adapts tensors to these functions.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

POSITIVE = "positive"
NEGATIVE = "negative"
NEUTRAL = "neutral"

POSITIVE_WORDS_PARAMETER = "positive_words"
"""Model parameter: comma-separated words that count towards ``positive`` (tokenized like the text)."""

NEGATIVE_WORDS_PARAMETER = "negative_words"
"""Model parameter: comma-separated words that count towards ``negative`` (tokenized like the text)."""

DEFAULT_POSITIVE_WORDS = frozenset(
    {"good", "great", "excellent", "love", "like", "happy", "awesome", "fantastic", "best", "wonderful"}
)
DEFAULT_NEGATIVE_WORDS = frozenset(
    {"bad", "terrible", "awful", "hate", "dislike", "sad", "worst", "poor", "horrible", "boring"}
)

_TOKEN = re.compile(r"[^\W_]+")  # runs of letters and digits, in any script


def tokenize(text: str) -> list[str]:
    """Lowercase ``text`` and split it on everything that is not a letter or a digit."""
    return _TOKEN.findall(text.lower())


@dataclass(frozen=True)
class KeywordClassifier:
    """Labels a token list by counting positive and negative keywords.

    The label is ``positive`` or ``negative`` when that side has strictly more hits, and
    ``neutral`` otherwise (no hits, or a tie).
    """

    positive_words: frozenset[str] = DEFAULT_POSITIVE_WORDS
    negative_words: frozenset[str] = DEFAULT_NEGATIVE_WORDS

    @classmethod
    def from_parameters(cls, parameters: Mapping[str, str]) -> KeywordClassifier:
        """Build from the model's ``parameters``; a missing list keeps its default.

        :raises ValueError: a list is empty, or a word is in both lists.
        """
        positive = _word_list(parameters, POSITIVE_WORDS_PARAMETER, DEFAULT_POSITIVE_WORDS)
        negative = _word_list(parameters, NEGATIVE_WORDS_PARAMETER, DEFAULT_NEGATIVE_WORDS)
        both = sorted(positive & negative)
        if both:
            raise ValueError(
                f"model parameters '{POSITIVE_WORDS_PARAMETER}' and '{NEGATIVE_WORDS_PARAMETER}' "
                f"share the word(s) {both}"
            )
        return cls(positive, negative)

    def classify(self, tokens: Iterable[str]) -> str:
        """The label of one tokenized text."""
        score = 0
        for token in tokens:
            score += (token in self.positive_words) - (token in self.negative_words)
        if score > 0:
            return POSITIVE
        if score < 0:
            return NEGATIVE
        return NEUTRAL


def _word_list(parameters: Mapping[str, str], key: str, default: frozenset[str]) -> frozenset[str]:
    raw = parameters.get(key)
    if raw is None:
        return default
    words = frozenset(word for part in raw.split(",") for word in tokenize(part))
    if not words:
        raise ValueError(f"model parameter '{key}' must list at least one word (got {raw!r})")
    return words
