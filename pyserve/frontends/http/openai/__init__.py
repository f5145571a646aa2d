"""OpenAI-compatible routes on the HTTP port: ``/v1/models``, ``/v1/completions``, ``/v1/chat/completions``.

On by default (``pyserve run --allow-openai false`` turns them off). Any model with a text
input and a text output is served (``binding`` says which and how its inputs are filled),
streamed when it is decoupled. The modules: ``schema`` (the request bodies, checked),
``binding`` (model ↔ request), ``chat_template`` (messages → prompt), ``tokens`` (counting),
``run`` (the model requests of one API request), ``routes`` (the handlers and the stream
chunks), ``metrics`` (time to first token, inter-token latency, tokens) and ``errors``
(OpenAI's error object).
"""

from __future__ import annotations

from pyserve.frontends.http.openai.metrics import OpenAIMetrics
from pyserve.frontends.http.openai.routes import openai_routes

__all__ = ["OpenAIMetrics", "openai_routes"]
