"""NVIDIA model-analyzer 1.58 in remote mode against ``pyserve run --model-control-mode explicit``
(and, with ``--triton``, against Triton 2.51 in the same mode): its brute and quick searches over
HTTP and gRPC, on the ``add_sub`` model of ``_pa_models`` (a Triton Python-backend model, CPU only).

In remote mode model-analyzer loads each config variant it tries through the repository API
(``POST /v2/repository/models/<m>/load`` with a ``config`` override, or gRPC
``RepositoryModelLoad``), measures it with perf_analyzer and reads the server's statistics and
``/metrics``. A run passes when model-analyzer exits 0, says "Profile complete" and measured every
variant it created (its checkpoint holds a throughput for each).

model-analyzer comes from PyPI (``triton-model-analyzer==1.58.0``) into its own virtual
environment, by default ``$XDG_CACHE_HOME/pyserve-bench/model-analyzer-venv``; perf_analyzer
comes from ``_perf_analyzer`` and is given to model-analyzer as a small wrapper script.

Run: ``.venv/bin/python benchmarks/model_analyzer_remote.py [--triton] [--searches brute,quick]
[--protocols grpc,http]``. Prints one line per run; exits 1 when a pyserve run failed.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _pa_models  # noqa: E402  sibling helper modules
import _perf_analyzer  # noqa: E402
import _triton  # noqa: E402
from batching import free_port  # noqa: E402
from serving import Server, spawn  # noqa: E402

REQUIREMENT = "triton-model-analyzer==1.58.0"


def default_venv() -> Path:
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return cache / "pyserve-bench" / "model-analyzer-venv"


def ensure_model_analyzer(venv: Path, log: Path) -> Path:
    """The ``model-analyzer`` executable, installed into ``venv`` when missing.

    :raises RuntimeError: the venv or the install failed; the message names the log.
    """
    tool = venv / "bin" / "model-analyzer"
    if tool.is_file():
        return tool
    venv.parent.mkdir(parents=True, exist_ok=True)
    with log.open("w") as out:
        for step in ([sys.executable, "-m", "venv", str(venv)],
                     [str(venv / "bin" / "python"), "-m", "pip", "install", "--quiet", REQUIREMENT]):
            if subprocess.run(step, stdout=out, stderr=subprocess.STDOUT, check=False).returncode:
                raise RuntimeError(f"'{' '.join(step[:4])} ...' failed; see {log}")
    return tool


def wrapper(tool: _perf_analyzer.PerfAnalyzer, work: Path) -> Path:
    """A ``perf_analyzer`` script model-analyzer can call by path."""
    script = work / "perf_analyzer"
    script.write_text("#!/bin/sh\nexec " + " ".join(shlex.quote(p) for p in tool.command) + ' "$@"\n')
    script.chmod(0o755)
    return script


@dataclass(frozen=True)
class Endpoint:
    """Where a server listens (loopback): its name and HTTP, gRPC and metrics ports."""

    name: str
    http_port: int
    grpc_port: int
    metrics_port: int


@dataclass(frozen=True)
class Space:
    """The search space: concurrency, instance count and max batch size up to these."""

    concurrency: int = 2
    instances: int = 2
    batch: int = 2


def config_yaml(server: Endpoint, search: str, protocol: str, work: Path, repository: Path,
                perf_analyzer: Path, space: Space = Space()) -> str:
    """model-analyzer's config for one run (JSON is YAML)."""
    run = work / f"{server.name}-{search}-{protocol}"
    (run / "checkpoints").mkdir(parents=True, exist_ok=True)
    return json.dumps({
        "model_repository": str(repository),
        "profile_models": {"add_sub": {"cpu_only": True}},
        "triton_launch_mode": "remote",
        "triton_http_endpoint": f"127.0.0.1:{server.http_port}",
        "triton_grpc_endpoint": f"127.0.0.1:{server.grpc_port}",
        "triton_metrics_url": f"http://127.0.0.1:{server.metrics_port}/metrics",
        "client_protocol": protocol,
        "perf_analyzer_path": str(perf_analyzer),
        "perf_analyzer_flags": {"stability-percentage": 100, "max-trials": 20},
        "output_model_repository_path": str(run / "variants"),
        "override_output_model_repository": True,
        "checkpoint_directory": str(run / "checkpoints"),
        "export_path": str(run / "results"),
        "run_config_search_mode": search,
        "run_config_search_max_concurrency": space.concurrency,
        "run_config_search_max_instance_count": space.instances,
        "run_config_search_max_model_batch_size": space.batch,
        "skip_summary_reports": True,
    })


def measured_variants(checkpoints: Path) -> tuple[int, int]:
    """(variants with at least one throughput measured, measurements) in a run's checkpoint."""
    found = sorted(checkpoints.glob("*.ckpt"))
    if not found:
        return 0, 0
    results = json.loads(found[-1].read_text()).get("ResultManager.results", {}).get("_results", {})
    variants = measurements = 0
    for model in results.values():
        for entry in model.values():
            count = json.dumps(entry).count('["perf_throughput", {"_value"')
            variants += count > 0
            measurements += count
    return variants, measurements


def run_one(tool: Path, server: Endpoint, search: str, protocol: str, work: Path, repository: Path,
            perf_analyzer: Path, timeout: float, space: Space = Space()) -> tuple[bool, str]:
    """One ``model-analyzer profile``; (passed, note)."""
    config = work / f"{server.name}-{search}-{protocol}.yaml"
    config.write_text(config_yaml(server, search, protocol, work, repository, perf_analyzer, space))
    log = work / f"{server.name}-{search}-{protocol}.log"
    with log.open("w") as out:
        try:
            code = subprocess.run([str(tool), "profile", "-f", str(config)], stdout=out, stderr=subprocess.STDOUT,
                                  timeout=timeout, check=False, cwd=work).returncode
        except subprocess.TimeoutExpired:
            return False, f"timed out after {timeout:.0f} s"
    text = log.read_text(errors="replace")
    variants, measurements = measured_variants(work / f"{server.name}-{search}-{protocol}" / "checkpoints")
    errors = work / f"{server.name}-{search}-{protocol}" / "results" / "perf_analyzer_error.log"
    note = f"{variants} variants, {measurements} measurements"
    if errors.is_file():
        failed = [line for line in errors.read_text(errors="replace").splitlines()
                  if line.startswith(("Failed", "Thread", "error", "Error:"))]
        note += f"; perf_analyzer errors: {' | '.join(sorted(set(failed)))[:200]}"
    if code != 0 or "Profile complete" not in text or variants == 0:
        tail = " | ".join(line for line in text.splitlines()[-3:])
        return False, f"exit {code}: {tail[-300:]}; {note}"
    return True, note


def start(name: str, install: _triton.TritonInstall | None, repository: Path, work: Path) -> tuple[Server, int]:
    """pyserve (``install`` None) or Triton in explicit model control, no model loaded, loopback."""
    http, grpc_port, metrics = free_port(), free_port(), free_port()
    loopback = ["--grpc-address", "127.0.0.1", "--metrics-address", "127.0.0.1"]
    ports = ["--http-port", str(http), "--grpc-port", str(grpc_port), "--metrics-port", str(metrics)]
    if install is None:
        command = [sys.executable, "-m", "pyserve", "run", "--model-repository", str(repository),
                   "--model-control-mode", "explicit", "--host", "127.0.0.1", *loopback, *ports]
        env = None
    else:
        backends = work / "triton-backends"
        if not backends.exists():
            install.prepare_backends(backends)
        command = [str(install.binary), "--model-repository", str(repository), "--model-control-mode", "explicit",
                   "--backend-directory", str(backends),
                   "--http-address", "127.0.0.1", *loopback, *ports]
        env = install.environment()
    return spawn(name, command, http, grpc_port, work / f"{name}.log", env, 180), metrics


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--triton", action="store_true", help="also run against Triton 2.51 (nvidia-pytriton)")
    parser.add_argument("--searches", default="brute,quick")
    parser.add_argument("--protocols", default="grpc,http")
    parser.add_argument("--venv", type=Path, default=default_venv(), help="model-analyzer's virtual environment")
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds one run may take")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="ma-remote-") as tmp:
        work = Path(tmp)
        tool = ensure_model_analyzer(args.venv, work / "install.log")
        perf_analyzer = wrapper(_perf_analyzer.ensure(), work)
        repository = _pa_models.write_repository(work / "models")
        servers: list[tuple[str, _triton.TritonInstall | None]] = [("pyserve", None)]
        if args.triton:
            venv = _triton.default_venv()
            servers.append(("triton", _triton.find(venv) or _triton.install(venv, work / "triton-install.log")))
        failed_on_pyserve = False
        for name, install in servers:
            for search in args.searches.split(","):
                for protocol in args.protocols.split(","):
                    server, metrics_port = start(name, install, repository, work)  # a fresh server per run
                    assert server.http_port is not None and server.grpc_port is not None
                    endpoint = Endpoint(name, server.http_port, server.grpc_port, metrics_port)
                    try:
                        ok, note = run_one(tool, endpoint, search, protocol, work, repository, perf_analyzer,
                                           args.timeout)
                    finally:
                        server.stop()
                    failed_on_pyserve |= name == "pyserve" and not ok
                    print(f"{name:8} {search:6} {protocol:5} {'pass' if ok else 'FAIL'}  {note}", flush=True)
    return 1 if failed_on_pyserve else 0


if __name__ == "__main__":
    sys.exit(main())
