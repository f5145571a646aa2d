"""The process layout: frontend processes, how connections reach them, polling and pinning.

Each flag's default is ``auto`` (chosen for the machine by ``pyserve.handoff.layout``); the
fields' defaults are what an embedded server gets: this process alone.
"""

from __future__ import annotations

from dataclasses import dataclass

from pyserve.frontends.balancer import FRONTEND_BALANCE
from pyserve.server.options import values
from pyserve.server.options.declare import TUNING, flag, setting


@dataclass(kw_only=True)
class ScaleOptions:
    """How many processes serve, and how (the "advanced tuning" flags)."""

    # extra processes serving the HTTP/gRPC ports (see frontend_balance) that decode requests
    # and hand them to this process, which owns the models (pyserve.handoff)
    frontend_processes: int = setting(
        flag("--frontend-processes", type=values.auto_count, default=values.AUTO, metavar="auto|N", group=TUNING,
             headline=True,
             help="processes that serve the HTTP and gRPC ports beside this one, which holds the "
                  "models (default auto: one per usable CPU beyond this one; 0 = this process alone)"),
        default=0,
    )
    # none | auto | NAME[,NAME...]: models frontend processes load replicas of and answer
    # themselves (pyserve.handoff.replicas)
    replicate_models: str = setting(
        flag("--replicate-models", default=values.AUTO, metavar="auto|none|NAMES", group=TUNING,
             help="models that frontend processes answer themselves from a replica: auto (default: "
                  "every model that can be: no sequence batcher, decoupled, ensemble, GPU instances, "
                  "response cache, a dynamic batcher with a queue delay over 1 ms, priority levels, "
                  "preserve_ordering or a queue policy, or BLS / custom metrics in model.py; none while "
                  "summary_latencies is on), none (every request is "
                  "handed to this process), or comma-separated model names"),
        default="none",
    )
    # how new connections are spread over the processes: "connections" (this process accepts
    # and passes each to the one with the fewest open; pyserve.frontends.balancer), "frontends"
    # (the same, but every connection goes to a frontend while one is connected) or "kernel"
    # (every process listens with SO_REUSEPORT and the kernel picks)
    frontend_balance: str = setting(
        flag("--frontend-balance", choices=FRONTEND_BALANCE, group=TUNING,
             help="how new connections are spread over this process and its frontends: connections "
                  "(default: this process accepts each and passes it to the process with the fewest "
                  "open connections), frontends (each goes to the frontend with the fewest; this "
                  "process serves one only while no frontend is connected) or kernel (every process "
                  "listens with SO_REUSEPORT and the kernel picks by a hash of the addresses)"),
        default="connections",
    )
    # after a model executed on the event loop answers, the loop keeps polling for this many
    # microseconds instead of sleeping (pyserve.runtime.scheduling.busy_poll); 0 = off
    busy_poll_us: int = setting(
        flag("--busy-poll-us", type=values.busy_poll_us, default=values.AUTO, metavar="auto|US", group=TUNING,
             help="after a model executed on the event loop answers a lone client that sends its "
                  "requests back to back, keep polling the sockets for US microseconds instead of "
                  "sleeping (0-1000000; default auto: 300 on two or more CPUs, else 0)"),
        default=0,
    )
    # this process and each frontend process on a CPU of its own (pyserve.handoff.affinity)
    pin_processes: bool = setting(
        flag("--pin-processes", type=values.auto_bool, default=values.AUTO, metavar="auto|BOOL", group=TUNING,
             help="run this process and each frontend process on a CPU of its own (Linux; default "
                  "auto: only where the cgroup cpuset is exclusive to the server)"),
        default=False,
    )
