"""Fixtures for the tensorflow backend's tests (helpers live in ``tf_support``)."""

from __future__ import annotations

from tf_support import module_server

__all__ = ["module_server"]
