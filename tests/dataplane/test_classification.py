"""Classification labels read as Triton 2.51 reads a ``label_filename`` (checked side by side):
lines split at ``\\n`` only, and an empty line is no label."""

from __future__ import annotations

import numpy as np

from pyserve.dataplane.classification import classify
from pyserve.repository.model_config import label_lines


def test_label_lines_split_at_newlines_only() -> None:
    assert label_lines("cat\r\n\nbird \n  \nfish") == ("cat", "", "bird ", "  ", "fish")
    assert label_lines("a\nb\n") == ("a", "b")  # a final newline ends the last line
    assert label_lines("x\x0by\x1cz\u2028w\n") == ("x\x0by\x1cz\u2028w",)  # no other line breaks
    assert label_lines("") == ()


def test_an_empty_label_line_gives_no_label() -> None:
    labels = label_lines("cat\r\n\nbird\n")
    scores = np.array([0.1, 3.5, 2.0, 9.0], dtype=np.float32)
    assert classify(scores, 4, labels, batched=False, name="OUT").tolist() == [
        b"9.000000:3", b"3.500000:1", b"2.000000:2:bird", b"0.100000:0:cat"]
