"""The worker process of ``execution_mode: "process"`` (see ``pyserve_backend_python.process``).

Messages from the parent: ``("init", args)``, ``("exec", arena_name, arena_size, requests)``,
``("finalize",)``, ``("stop",)``, and ``("auto_complete", config dict)`` (to a worker started
in an ``EXECUTION_ENV_PATH`` environment before the model loads; answered ``("ok", completed
config dict or None)`` or ``("error", message)``). Replies: ``("ok",)`` / ``("error", message)`` for init and
finalize; ``("results", segment_name, segment_size, responses)`` or
``("batch_error", message, code)`` for exec.

While it executes a batch, the worker may send ``("bls", call id, request fields, decoupled)``;
the parent runs that request on the server and answers ``("bls_result", call id, responses)``
(BLS from ``execute``; several calls may be in flight at once, each answered under its id;
tensors travel both ways in shared-memory segments, ``segments.share_arrays`` /
``take_arrays``: the receiver maps and unlinks each one). ``pb_utils.load_model`` /
``unload_model`` / ``is_model_ready`` send ``("control", call id, operation, args)`` the same
way and get ``("bls_result", call id, ("ok", value))`` or ``("bls_result", call id, ("error",
message))``. A decoupled model's response
senders send ``("send", request key, response or None, final)`` at any time, from any thread.
Before a reply, the worker sends ``("metrics", families)`` when its custom metrics changed. The
parent sends ``("cancel", request key)`` when a request's client went away (``is_cancelled()``),
and ``("ready", token)`` when a client asks whether the model is ready: a thread of the worker
calls the model's ``is_ready()`` (if it has one; ``True`` otherwise), also while a batch executes,
and answers ``("ready_result", token, "ok", answer)``, ``("ready_result", token, "not_bool", type
name)`` or ``("ready_result", token, "error", traceback text)``.

The loop is ``worker_loop.Worker``; its pipe, response senders and BLS calls are in
``worker_pipe`` and ``worker_calls``.
"""

from __future__ import annotations

from typing import Any


def main(conn: Any, spec: dict[str, Any], out_prefix: str) -> None:
    """The worker's loop: serve the parent's messages until ``stop`` or the pipe closes."""
    import logging
    import multiprocessing

    # started as a daemon so that it ends with the server; the model may still start processes
    # of its own (a multiprocessing.Pool), as in Triton's stub
    multiprocessing.current_process().daemon = False

    logging.basicConfig(level=logging.INFO,
                        format=f"%(asctime)s %(levelname)s [{spec['name']} worker %(process)d] %(message)s")
    from pyserve_backend_python.worker_loop import Worker  # the model's imports come after logging is set up

    Worker(conn, spec, out_prefix).serve()
