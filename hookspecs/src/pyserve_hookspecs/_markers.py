"""The marker used by the spec modules (kept apart so they can import it without a cycle)."""

from __future__ import annotations

import pluggy

hookspec = pluggy.HookspecMarker("pyserve")
