"""Fixtures for the onnxruntime backend's tests (helpers live in ``ort_support``)."""

from __future__ import annotations

from ort_support import module_server

__all__ = ["module_server"]
