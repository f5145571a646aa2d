"""The ``pyserve`` command: ``run`` (Triton's flag names), ``validate``, ``backends`` and ``new-backend``."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import os
import sys
import tempfile
from collections.abc import Callable, Coroutine, Iterator, Sequence
from pathlib import Path
from typing import Any

from pyserve import __version__, logs
from pyserve.cli import triton_flags
from pyserve.cli.option_flags import add_option_flags, option_values
from pyserve.handoff.layout import Layout
from pyserve.handoff.layout import choose as choose_layout
from pyserve.repository.bundled import EXAMPLE_REPOSITORY, missing_backends
from pyserve.server.argtypes import boolean as _bool
from pyserve.server.options import RUN_GROUPS, LogOptions, ServerOptions
from pyserve.server.options.values import backend_config as _backend_config
from pyserve.server.options.values import backend_setting as _backend_setting
from pyserve.server.options.values import config_name as _config_name


def _load_model_problem(mode: str, names: Sequence[str]) -> str | None:
    """Why the ``--load-model`` values cannot be used with ``--model-control-mode``, or None."""
    if names and mode != "explicit":
        return "--load-model can only be used with --model-control-mode=explicit"
    if "*" in names and len(names) > 1:
        return "--load-model=* must be the only --load-model argument"
    return None


def _add_run(sub: "argparse._SubParsersAction[argparse.ArgumentParser]") -> None:
    run = sub.add_parser("run", help="serve a Triton model repository over KServe v2 (HTTP and gRPC)")
    add_option_flags(run, RUN_GROUPS)
    triton_flags.add_flags(run)


def _bundled_repositories(exit_on_error: bool) -> list[Path]:
    """The repositories to serve without any ``--model-repository``: the bundled example
    repository (whose backends, missing, would each fail a model; with ``exit_on_error`` that
    is said at once)."""
    if not EXAMPLE_REPOSITORY.is_dir():
        raise SystemExit(
            "pyserve: no --model-repository given, and the bundled example repository is not "
            "available in this installation"
        )
    missing = missing_backends() if exit_on_error else []
    if missing:
        raise SystemExit(
            "pyserve: no --model-repository given, and the bundled example repository needs backends "
            f"that are not installed ({', '.join(missing)}): pip install 'pyserve-server[examples]' "
            "(from the wheels of `make dist`: pip install --find-links dist 'pyserve-server[examples]'), "
            "or serve a repository of your own with --model-repository"
        )
    return [EXAMPLE_REPOSITORY]


def _layout(args: argparse.Namespace) -> Layout:
    """The process layout for ``run``: each ``auto`` flag resolved (``pyserve.handoff.layout``)."""
    single = None
    if not (args.allow_http or args.allow_grpc):
        single = "neither HTTP nor gRPC is served"
    elif args.allow_http and args.http_server != "pyserve":
        single = f"--http-server {args.http_server} serves HTTP from this process only"
    return choose_layout(args.frontend_processes, args.replicate_models, args.busy_poll_us, args.pin_processes,
                         single_reason=single)


def _run_problem(args: argparse.Namespace, options: ServerOptions) -> str | None:
    """Why ``pyserve run`` cannot serve ``options`` as asked, or None; notices are logged."""
    for repo in options.model_repositories:
        if not repo.is_dir():
            return f"--model-repository '{repo}' does not exist or is not a directory"
    fixed_ports = [p for p in (options.http_port, options.grpc_port, options.metrics_port) if p]  # 0 = any free port
    if len(set(fixed_ports)) < len(fixed_ports):
        return "--http-port, --grpc-port and --metrics-port must differ"
    notices, flag_problem = triton_flags.check(args)
    if flag_problem:
        return flag_problem
    for notice in notices:
        logging.getLogger("pyserve").info("%s", notice)
    return _load_model_problem(options.model_control_mode, options.load_models)


def run_options(args: argparse.Namespace) -> ServerOptions:
    """Configure logging from ``args`` (``pyserve run``'s), then the server's options from them,
    with the process layout's ``auto`` flags resolved (the choice is logged).

    :raises ValueError: a flag value the options cannot take (the message names the flag).
    """
    LogOptions(**option_values(LogOptions, args)).configure()
    values = option_values(ServerOptions, args)
    layout = _layout(args)
    logging.getLogger("pyserve").info("%s", layout.describe())
    values.update(frontend_processes=layout.frontend_processes, replicate_models=layout.replicate_models,
                  busy_poll_us=layout.busy_poll_us, pin_processes=layout.pin_processes)
    if not values["model_repositories"]:
        values["model_repositories"] = _bundled_repositories(values["exit_on_error"])
    return ServerOptions(**values)


def cmd_run(args: argparse.Namespace) -> int:
    from pyserve.runtime import startup_gc

    startup_gc.pause()  # resumed once the models frontends replicate are loaded (after prefork)
    from pyserve.server.core import Server, StartupError, prebind_listeners

    try:
        options = run_options(args)
    except ValueError as exc:
        print(f"pyserve: {exc}", file=sys.stderr)
        return 2
    problem = _run_problem(args, options)
    if problem:
        print(f"pyserve: {problem}", file=sys.stderr)
        return 2
    runner: Callable[[Coroutine[Any, Any, None]], None]
    try:
        import uvloop

        runner = uvloop.run
    except ImportError:  # pragma: no cover - uvloop is a dependency on POSIX
        runner = asyncio.run

    def serve() -> int:
        try:
            server = Server(options)
            server.prefork()  # frontends forked from the loaded models, before any thread starts
            startup_gc.resume()
            runner(server.run(exit_when_stuck=True))
        except (StartupError, OSError) as exc:
            print(f"pyserve: error: {exc}", file=sys.stderr)
            return 1
        return 0

    from pyserve.handoff import keeper

    if not keeper.supported() or keeper.adopt():  # adopt: a server the keeper started again
        return serve()
    try:  # the keeper holds the ports, so that they outlive a server process a model crashed
        prebind_listeners(options)
    except StartupError as exc:
        print(f"pyserve: error: {exc}", file=sys.stderr)
        return 1
    kept = keeper.Keeper(args.argv, stop_timeout=options.exit_timeout_secs + 15)
    return kept.run(serve, small=getattr(args, "whole_process", False))


def cmd_validate(args: argparse.Namespace) -> int:
    from pyserve.repository.validate import validate_repositories

    problems = validate_repositories(
        [Path(p) for p in args.repository],
        config_name=args.model_config_name,
        auto_complete=not (args.strict_model_config or args.disable_auto_complete_config),
        backend_config=_backend_config(args.backend_config),
    )
    for line in problems:
        print(line)
    if problems:
        print(f"{len(problems)} problem(s) found", file=sys.stderr)
        return 1
    print("OK: no problems found")
    return 0


def cmd_backends(args: argparse.Namespace) -> int:
    from pyserve.host.plugins import PluginHost

    if args.check:
        return _check_backends()
    host = PluginHost()
    infos = host.installed()
    plugins = host.installed_server_plugins()
    if args.json:
        print(json.dumps([
            *({"kind": "backend", "name": i.name, "distribution": i.distribution, "version": i.version,
               "platforms": list(i.platforms), "entry_point": i.source} for i in infos),
            *({"kind": "server_plugin", "name": p.name, "distribution": p.distribution, "version": p.version,
               "platforms": [], "entry_point": p.source, "resolves_backends": p.resolves_backends,
               "summary": p.summary} for p in plugins),
        ], indent=2))
        return 0
    if not infos and not plugins:
        print("no backends installed (pip install pyserve-backend-<name>)")
        return 0
    rows = [[i.name, i.distribution, i.version, ", ".join(i.platforms) or "-"] for i in infos]
    rows += [[f"{p.name} *", p.distribution, p.version, "-"] for p in plugins if p.resolves_backends]
    print(logs.table(["Backend", "Distribution", "Version", "Platforms"], rows))
    for plugin in plugins:  # a resolver is asked first for every model's backend
        summary = plugin.summary.rstrip(".") or "no summary"
        if plugin.resolves_backends:
            print(f"* {plugin.name}: {summary} (a server plugin, asked first for the backend of every model)")
        else:
            print(f"server plugin {plugin.name} ({plugin.distribution} {plugin.version}): {summary}")
    return 0


def _check_backends() -> int:
    """``pyserve backends --check``: exit 1 if any installed backend breaks the contract."""
    from pyserve.host.check import check_installed

    infos, problems = check_installed()
    for problem in problems:
        print(f"error: {problem}", file=sys.stderr)
    failed = {p.backend for p in problems}
    for info in infos:
        if info.name not in failed:
            print(f"ok: backend '{info.name}' ({info.distribution} {info.version})".rstrip())
    if problems:
        print(f"{len(problems)} problem(s) in {len(failed)} backend(s)", file=sys.stderr)
        return 1
    if not infos:
        print("no backends installed (pip install pyserve-backend-<name>)")
    return 0


def cmd_new_backend(args: argparse.Namespace) -> int:
    from pyserve.cli.scaffold import ScaffoldError, create_backend_project

    try:
        project = create_backend_project(args.name, Path(args.directory), args.style)
    except (ScaffoldError, OSError) as exc:
        print(f"pyserve new-backend: error: {exc}", file=sys.stderr)
        return 2
    print(f"created {project.path} ({project.distribution}, backend '{project.name}', {project.style} style)")
    print(f"next: pip install -e {project.path} && pytest {project.path}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pyserve", description="A Python inference server that speaks Triton's protocol.")
    parser.add_argument("--version", action="version", version=f"pyserve {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    _add_run(sub)
    validate = sub.add_parser("validate", help="check model repositories without serving them")
    validate.add_argument("repository", nargs="+", help="model repository directories")
    validate.add_argument("--model-config-name", default="", type=_config_name, metavar="NAME",
                          help="check configs/NAME.pbtxt instead of config.pbtxt where a model has one")
    validate.add_argument("--strict-model-config", type=_bool, nargs="?", const=True, default=False, metavar="BOOL",
                          help="as for run: every config must declare its inputs and outputs")
    validate.add_argument("--disable-auto-complete-config", action="store_true",
                          help="as for run: backends will not complete model configs")
    validate.add_argument("--backend-config", action="append", default=[], type=_backend_setting,
                          metavar="BACKEND,KEY=VALUE",
                          help="as for run: settings the backends' own checks use (repeatable)")
    backends = sub.add_parser("backends", help="list installed backends")
    backends.add_argument("--json", action="store_true", help="print JSON instead of a table")
    backends.add_argument("--check", action="store_true",
                          help="import every backend and check its hooks against the contract (exit 1 on problems)")
    new_backend = sub.add_parser("new-backend", help="write a ready-to-install backend plugin project")
    new_backend.add_argument("name", help="the backend name (lowercase letters, digits, underscores)")
    style = new_backend.add_mutually_exclusive_group()
    style.add_argument("--class", dest="style", action="store_const", const="class", default="class",
                       help="a pyserve.Backend subclass (default)")
    style.add_argument("--hooks", dest="style", action="store_const", const="hooks",
                       help="@pyserve.hookimpl functions in a module")
    new_backend.add_argument("--directory", default=".", metavar="DIR",
                             help="where pyserve-backend-NAME/ is created (default: the current directory)")
    from pyserve.tools.bench import add_bench_parser  # standard library only: keeps --help fast

    add_bench_parser(sub)
    ray = sub.add_parser("ray-deploy", help="deploy a model repository as a Ray Serve application (pyserve-server[ray])")
    ray.add_argument("--model-repository", action="append", required=True, metavar="PATH",
                     help="model repository (repeatable); every Ray node must reach it at the same path")
    ray.add_argument("--address", default="auto", help="the Ray cluster to join (default auto: the running one)")
    ray.add_argument("--name", default="pyserve", help="the Serve application name (default pyserve)")
    ray.add_argument("--per-repository", action="store_true",
                     help="one deployment holding every model instead of one deployment per model")
    ray.add_argument("--num-replicas", type=int, default=None, metavar="N",
                     help="replicas for models whose config sets no ray_num_replicas (default 1)")
    ray.add_argument("--http-host", default="0.0.0.0", help="Serve's HTTP proxy address (default 0.0.0.0)")
    ray.add_argument("--http-port", type=int, default=8000, help="Serve's HTTP proxy port (default 8000)")
    ray.add_argument("--grpc-port", type=int, default=9000, help="Serve's gRPC proxy port (default 9000)")
    ray.add_argument("--backend-config", action="append", default=[], type=_backend_setting, metavar="<backend>,<key>=<value>",
                     help="backend settings passed to every replica, as pyserve run's")
    ray.add_argument("--num-cpus", type=float, default=None, metavar="N",
                     help="CPUs each model replica reserves where its config sets no ray_num_cpus (fractions allowed, "
                          "e.g. 0.5; default: its CPU instance count; 1 with --per-repository; ensembles run in the "
                          "ingress and reserve none)")
    ray.add_argument("--skip-resource-check", action="store_true",
                     help="deploy even when the cluster lacks the CPUs/GPUs the deployments reserve (a cluster that "
                          "adds nodes on demand)")
    ray.add_argument("--timeout", type=float, default=300.0, help="seconds to wait for the application (300)")
    return parser


def cmd_ray_deploy(args: argparse.Namespace) -> int:
    """Deploy to Ray Serve; returns once the application is RUNNING (it keeps running)."""
    try:
        import ray
        from ray import serve
    except ImportError:
        print("pyserve: error: Ray Serve is not installed: pip install 'pyserve-server[ray]'", file=sys.stderr)
        return 1
    from pyserve.tools.ray_serve import (
        GRPC_SERVICER_FUNCTION,
        RayConfigError,
        build_app,
        plan_app,
    )
    from pyserve.tools.ray_serve.resources import shortfall

    if args.num_replicas is not None and args.num_replicas < 1:
        print("pyserve: error: --num-replicas must be at least 1", file=sys.stderr)
        return 2
    try:
        backend_config = {k: dict(v) for k, v in _backend_config(args.backend_config).items()}
        plan = plan_app(args.model_repository, per_repository=args.per_repository, num_replicas=args.num_replicas,
                        backend_config=backend_config, num_cpus=args.num_cpus)
    except (RayConfigError, ValueError) as exc:
        print(f"pyserve: error: {exc}", file=sys.stderr)
        return 2
    with _neutral_directory():  # Ray puts the driver's folder first on its workers' path
        ray.init(address=args.address, log_to_driver=False)
    if not args.skip_resource_check:
        nodes = [node.get("Resources", {}) for node in ray.nodes() if node.get("Alive")]
        problems = shortfall(plan, ray.cluster_resources(), nodes, args.per_repository)
        if problems:
            print("pyserve: error: " + "\n  ".join(problems), file=sys.stderr)
            return 1
    serve.start(
        http_options={"host": args.http_host, "port": args.http_port},
        grpc_options={"port": args.grpc_port, "grpc_servicer_functions": [GRPC_SERVICER_FUNCTION]},
    )
    serve.run(build_app([], plan=plan), name=args.name, route_prefix="/", blocking=False)
    return _wait_for_application(serve, args)


@contextlib.contextmanager
def _neutral_directory() -> Iterator[None]:
    """Run the block in an empty folder of its own: ``ray.init`` gives Ray's workers the
    driver's current folder at the front of their ``sys.path``, where a folder named like an
    installed package (a checkout's ``pyserve/``) would be imported instead of it."""
    here = os.getcwd()
    with tempfile.TemporaryDirectory(prefix="pyserve-ray-") as empty:
        os.chdir(empty)
        try:
            yield
        finally:
            os.chdir(here)


def _wait_for_application(serve: Any, args: argparse.Namespace) -> int:
    """Wait until the application is RUNNING (0) or failed or timed out (1), printing what Serve
    says about a deployment as it changes (a replica waiting for resources, one failing)."""
    import time

    said: dict[str, str] = {}
    deadline = time.monotonic() + args.timeout
    while time.monotonic() < deadline:
        status = serve.status().applications.get(args.name)
        if status is not None and status.status == "RUNNING":
            print(f"pyserve: application '{args.name}' RUNNING: HTTP :{args.http_port}, gRPC :{args.grpc_port}")
            return 0
        if status is not None and status.status in ("DEPLOY_FAILED", "UNHEALTHY"):
            print(f"pyserve: error: application '{args.name}' {status.status}: {status.message}", file=sys.stderr)
            return 1
        for name, deployment in (status.deployments.items() if status is not None else ()):
            message = (deployment.message or "").strip()
            if message and said.get(name) != message:
                said[name] = message
                print(f"pyserve: {name}: {message}", file=sys.stderr)
        time.sleep(0.5)
    print(f"pyserve: error: application '{args.name}' not RUNNING after {args.timeout:.0f} s", file=sys.stderr)
    return 1


def cmd_bench(args: argparse.Namespace) -> int:
    from pyserve.tools.bench import cmd_bench as run_bench

    return run_bench(args)


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)  # what starts the server again (the keeper)
    args.whole_process = argv is None  # the keeper may replace the program (not when main is embedded)
    if argv is None and args.command == "run":
        # Model code sees no command-line arguments, as in Triton's Python-backend stub: a
        # model's unittest.main("model", exit=False) must not read the server's flags.
        del sys.argv[1:]
    handlers = {"run": cmd_run, "validate": cmd_validate, "backends": cmd_backends, "new-backend": cmd_new_backend,
                "bench": cmd_bench, "ray-deploy": cmd_ray_deploy}
    return handlers[args.command](args)
