"""Tracing, the response cache, client shared memory and the input tensor limit."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

from pyserve.server.options import values
from pyserve.server.options.declare import OPERATIONS, flag, setting

if TYPE_CHECKING:
    from pyserve.tracing import TraceConfig


@dataclass(kw_only=True)
class OperationsOptions:
    """What is traced, what is cached, whether clients may use shared memory, and how large an
    input tensor may be."""

    trace_config: TraceConfig | None = setting(
        flag("--trace-config", action="append", metavar="[MODE,]KEY=VALUE", group=OPERATIONS,
             help="trace setting (repeatable), e.g. level=TIMESTAMPS, rate=100, triton,file=PATH, "
                  "mode=opentelemetry, opentelemetry,url=http://host:4318/v1/traces"),
        default=None, convert=values.trace_config,
    )
    cache_config: tuple[str, Mapping[str, str]] | None = setting(  # (cache, settings)
        flag("--cache-config", action="append", type=values.backend_setting, metavar="CACHE,KEY=VALUE",
             group=OPERATIONS, help="response cache (repeatable): local,size=BYTES or redis,host=H / redis,port=P"),
        default=None, convert=values.cache_config,
    )
    allow_client_shm: bool = setting(  # Triton 2.69 added the flag, default false; 2.51 allows it
        flag("--allow-client-shm", type=values.boolean, metavar="BOOL", group=OPERATIONS,
             help="let clients register and unregister system and CUDA shared-memory regions "
                  "(default true, as Triton 2.51; false refuses them as Triton 2.69+ does by default)"),
        default=True,
    )
    max_tensor_elements: int = setting(  # elements per input tensor; 0 = no limit
        flag("--max-tensor-elements", type=int, metavar="N", group=OPERATIONS,
             help="refuse input tensors declaring more than N elements (default 0: no limit)"),
        default=0, convert=values.at_least_zero("--max-tensor-elements"),
    )
