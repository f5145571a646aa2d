"""Fixtures for the pytorch backend's tests (helpers live in ``pt_support``)."""

from __future__ import annotations

from pt_support import module_server

__all__ = ["module_server"]
