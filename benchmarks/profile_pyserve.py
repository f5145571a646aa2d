"""Sample pyserve with ``py-spy`` under the ``serving.py`` load and write flame graphs.

Starts ``pyserve run`` on the ``serving.py`` repository (identity ``model.py``), then for each
load — HTTP/1.1 JSON at 8 connections (``wrk -t1 -c8``) and gRPC unary at 8 connections
(``h2load -t1 -c8 -m1``) — records ``--duration`` seconds with ``py-spy record`` twice: a
flame graph (``benchmarks/profiles/<load>.svg``) and collapsed stacks, from which it prints the
functions with the largest inclusive and self share of the samples. ``--gil``: only samples of
the thread holding the GIL, i.e. where the one Python core goes (waiting threads drop out).

Needs ``py-spy`` (``.venv/bin/pip install py-spy``) and ptrace permission on the server.
Run: ``.venv/bin/python benchmarks/profile_pyserve.py [--duration 5] [--rate 200]``; exits 0.
"""

from __future__ import annotations

import argparse
import collections
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import serving  # noqa: E402  sibling benchmark module
from batching import run_report  # noqa: E402

OUT = Path(__file__).resolve().parent / "profiles"
LOADS = {
    "pyserve-http-json-c8": serving.cell("http", "json", serving.SMALL, 8),
    "pyserve-grpc-c8": serving.cell("grpc", "grpc", serving.SMALL, 8),
}


def _frame(frame: str) -> str:
    """``func (path/to/file.py:123)`` → ``func (file.py)``, the granularity the summary uses."""
    name, _, where = frame.partition(" (")
    return f"{name} ({where.rsplit('/', 1)[-1].split(':')[0]})" if where else name


def summarize(collapsed: Path, top: int) -> list[str]:
    inclusive: collections.Counter[str] = collections.Counter()
    own: collections.Counter[str] = collections.Counter()
    total = 0
    for line in collapsed.read_text().splitlines():
        stack, _, count_text = line.rpartition(" ")
        if not stack:
            continue
        count = int(count_text)
        frames = [_frame(f) for f in stack.split(";")]
        total += count
        for frame in set(frames):
            inclusive[frame] += count
        own[frames[-1]] += count
    if not total:
        return ["(no samples)"]
    lines = [f"{total} samples", "", "| inclusive % | function |", "|---:|---|"]
    lines += [f"| {100 * n / total:.1f} | `{f}` |" for f, n in inclusive.most_common(top)]
    lines += ["", "| self % | function |", "|---:|---|"]
    lines += [f"| {100 * n / total:.1f} | `{f}` |" for f, n in own.most_common(top)]
    return lines


def _scrub(svg: Path, replacements: dict[str, str]) -> None:
    """Drop this machine's paths from the flame graph (its title holds the command line)."""
    if svg.exists():
        text = svg.read_text()
        for old, new in sorted(replacements.items(), key=lambda item: -len(item[0])):
            text = text.replace(old, new)
        svg.write_text(text)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--duration", type=int, default=5, help="seconds per py-spy recording (5)")
    parser.add_argument("--rate", type=int, default=200, help="py-spy samples per second (200)")
    parser.add_argument("--top", type=int, default=25, help="rows per summary table (25)")
    args = parser.parse_args(argv)
    py_spy = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
    if not Path(py_spy).exists():
        print("py-spy not found: .venv/bin/pip install py-spy")
        return 0
    OUT.mkdir(exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="pyserve-profile-") as temp:
        work = Path(temp)
        repository = serving.write_repository(work / "repo", [serving.MODEL])
        server = serving.start_pyserve(repository, work, 120, [serving.MODEL])
        try:
            cache: dict[tuple[str, str, int], serving.RequestFiles] = {}
            for name, spec in LOADS.items():
                files = serving.prepare_requests(spec, work, cache)
                why = serving.check(server, spec, files)
                if why:
                    print(f"## {name}\n\ncheck failed: {why}\n")
                    continue
                load = subprocess.Popen(serving._load_command(server, spec, files, 2 * args.duration + 3,
                                                              work / "h2load.log"),
                                        stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
                time.sleep(1.0)
                common = ["--pid", str(server.process.pid), "--duration", str(args.duration),
                          "--rate", str(args.rate), "--gil", "--subprocesses"]  # the keeper's server and frontends
                svg, raw = OUT / f"{name}.svg", work / f"{name}.txt"
                subprocess.run([py_spy, "record", *common, "--format", "flamegraph", "--output", str(svg)],
                               capture_output=True, check=False)
                subprocess.run([py_spy, "record", *common, "--format", "raw", "--output", str(raw)],
                               capture_output=True, check=False)
                load.wait()
                _scrub(svg, {str(work): "TMP", sys.prefix: "VENV", str(serving.ROOT): "REPO", str(Path.home()): "HOME"})
                print(f"## {name}\n")
                print("\n".join(summarize(raw, args.top)) if raw.exists() else "(py-spy wrote nothing)")
                print()
        finally:
            server.stop()
    return 0


if __name__ == "__main__":
    run_report(main)
