"""Triton ``tritonserver`` flags that pyserve accepts so that existing command lines keep working.

Two kinds (``pyserve run --help`` lists them under "Triton compatibility"):

* tuning flags — thread counts, memory pools, GPU limits — whose job pyserve does differently:
  accepted with any value and reported once at start-up as having no effect;
* feature flags that pyserve does not implement: accepted only at the value that matches what
  pyserve does (e.g. ``--model-namespacing false``); any other value stops ``pyserve run`` with a message
  naming the flag.
"""

from __future__ import annotations

import argparse
from collections.abc import Mapping

TUNING_FLAGS: Mapping[str, str] = {
    "--http-thread-count": "HTTP is served by one event loop per process (--frontend-processes adds processes)",
    "--grpc-infer-thread-count": "gRPC is served by the event loop of each process",
    "--grpc-infer-allocation-pool-size": "gRPC messages are not pooled",
    "--grpc-max-response-pool-size": "gRPC responses are not pooled",
    "--pinned-memory-pool-byte-size": "host buffers come from the frameworks' own allocators",
    "--cuda-memory-pool-byte-size": "GPU memory is managed by each framework",
    "--cuda-virtual-address-size": "GPU memory is managed by each framework",
    "--min-supported-compute-capability": "GPU checks are left to the frameworks",
    "--buffer-manager-thread-count": "there is no buffer manager",
    "--enable-peer-access": "GPU peer access is left to the frameworks",
    "--repoagent-directory": "repository agents are not supported",
    "--cache-directory": "caches are Python plugins (--cache-config)",
    "--host-policy": "instances are not pinned to NUMA nodes",
    "--model-load-gpu-limit": "GPU memory is not limited per device at load",
}
"""Accepted, with no effect (the reason is logged)."""

FEATURE_FLAGS: Mapping[str, tuple[str, ...]] = {
    "--model-namespacing": ("false", "0"),
    "--allow-sagemaker": ("false", "0"),
    "--allow-vertex-ai": ("false", "0"),
}
"""Accepted only at these values (what pyserve does); anything else is refused."""


def add_flags(parser: argparse.ArgumentParser) -> None:
    """Add both kinds of flags to ``pyserve run``'s parser (values kept as given, repeatable)."""
    group = parser.add_argument_group(
        "Triton compatibility", "accepted so that tritonserver command lines run unchanged; see pyserve.cli.triton_flags"
    )
    for flag in (*TUNING_FLAGS, *FEATURE_FLAGS):
        group.add_argument(flag, action="append", default=[], metavar="VALUE", dest=_dest(flag),
                           help=argparse.SUPPRESS)


def check(args: argparse.Namespace) -> tuple[list[str], str | None]:
    """(notices to log, error) for the compatibility flags on a command line.

    The error names the flag and value that pyserve cannot honour; notices name the tuning flags
    given and why they do nothing here.
    """
    notices = []
    for flag, reason in TUNING_FLAGS.items():
        if getattr(args, _dest(flag)):
            notices.append(f"{flag} is accepted for Triton compatibility and has no effect: {reason}")
    for flag, allowed in FEATURE_FLAGS.items():
        for value in getattr(args, _dest(flag)):
            if value.strip().lower() not in allowed:
                shown = ", ".join(repr(v) for v in allowed)
                return notices, f"{flag} {value!r} is not supported by pyserve (accepted: {shown})"
    return notices, None


def _dest(flag: str) -> str:
    return "triton_" + flag.lstrip("-").replace("-", "_")
