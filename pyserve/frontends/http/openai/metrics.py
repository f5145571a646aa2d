"""The ``/v1`` routes' own metrics, on the server's ``/metrics`` page beside ``nv_inference_*``.

* ``pyserve_openai_time_to_first_token_seconds`` (histogram, label ``model``): from the request's
  arrival to the first text of each choice;
* ``pyserve_openai_inter_token_latency_seconds`` (histogram, label ``model``): between two
  successive pieces of text of a choice, one observation per piece after the first (a streaming
  model sends one token per piece);
* ``pyserve_openai_prompt_tokens`` / ``pyserve_openai_completion_tokens`` (counters, label
  ``model``): the tokens of ``usage``, for every request whether or not it asked for usage.

The model requests behind them are counted in ``nv_inference_*`` like any other.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram

FAMILIES = (
    "pyserve_openai_time_to_first_token_seconds", "pyserve_openai_inter_token_latency_seconds",
    "pyserve_openai_prompt_tokens", "pyserve_openai_completion_tokens",
)
"""The family names (reserved: a backend's custom metrics cannot take them)."""
TTFT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
ITL_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0)


class OpenAIMetrics:
    """The families, registered in one server's registry. Thread-safe (prometheus_client is).

    :param registry: the server's registry (``ServerMetrics.registry``).
    """

    def __init__(self, registry: CollectorRegistry) -> None:
        self._ttft = Histogram(FAMILIES[0], "Time from an OpenAI API request to the first text of a choice, in seconds",
                               ["model"], registry=registry, buckets=TTFT_BUCKETS)
        self._itl = Histogram(FAMILIES[1], "Time between two successive pieces of text of a choice, in seconds",
                              ["model"], registry=registry, buckets=ITL_BUCKETS)
        self._prompt = Counter(FAMILIES[2], "Prompt tokens of OpenAI API requests", ["model"], registry=registry)
        self._completion = Counter(FAMILIES[3], "Completion tokens of OpenAI API requests", ["model"],
                                   registry=registry)

    def first_token(self, model: str, seconds: float) -> None:
        """A choice's first text arrived ``seconds`` after its request."""
        self._ttft.labels(model=model).observe(seconds)

    def inter_token(self, model: str, seconds: float) -> None:
        """A choice's next text arrived ``seconds`` after its previous one."""
        self._itl.labels(model=model).observe(seconds)

    def tokens(self, model: str, prompt: int, completion: int) -> None:
        """A request ended with these token counts."""
        self._prompt.labels(model=model).inc(prompt)
        self._completion.labels(model=model).inc(completion)
