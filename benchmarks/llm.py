"""The OpenAI-compatible routes under LLM benchmark clients: time to first token, inter-token
latency and tokens/s of the bundled ``tiny_lm``, streamed.

Starts ``pyserve run`` on the bundled example repository and measures, at each ``--concurrency``:

1. the official ``openai`` client (``AsyncOpenAI``, ``stream=True`` with
   ``stream_options.include_usage``), timed here: TTFT from the call to the first chunk with
   text, ITL = (last text - first text) / (completion tokens - 1), tokens/s over the level;
2. ``pyserve bench --endpoint-type chat`` (pyserve's own raw-HTTP client) on the same server;
3. NVIDIA's ``aiperf`` (pip ``aiperf``, genai-perf's successor) when it is installed or given with
   ``--aiperf PATH``, with the model's folder as its local tokenizer (``tokenizer.json``):
   ``aiperf profile --endpoint-type chat --streaming``.

genai-perf itself runs the compiled ``perf_analyzer``: ``pip install genai-perf`` resolves its
``perf-analyzer`` dependency to a 0.1.0 placeholder without the binary on a host older than glibc
2.38 (the 2.60 wheel's floor; ``_perf_analyzer.py`` runs that binary for perf_analyzer itself), so
genai-perf is not tried here; aiperf needs no binary.

Prints a markdown table on stdout and exits 0 (a failed client is a note in the output).
Run: ``.venv/bin/python benchmarks/llm.py [--requests 32] [--concurrency 1 4] [--max-tokens 64]``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
TOKENIZER = ROOT / "examples" / "model_repository" / "tiny_lm"
STARTED = re.compile(r"Started HTTPService at (\S+):(\d+)")
PROMPT = "Tell me how the server measures the time to the first token"


def start_server() -> tuple[subprocess.Popen[str], str]:
    """``pyserve run`` on the bundled repository, loopback, free ports; ``(process, host:port)``."""
    process = subprocess.Popen(
        [sys.executable, "-m", "pyserve", "run", "--http-address", "127.0.0.1", "--http-port", "0",
         "--grpc-port", "0", "--metrics-port", "0"], cwd=ROOT, stderr=subprocess.PIPE, text=True)
    assert process.stderr is not None
    deadline = time.monotonic() + 60
    for line in process.stderr:
        match = STARTED.search(line)
        if match:  # read the rest of the log on a thread, so the server never blocks on a full pipe
            threading.Thread(target=lambda: [None for _ in process.stderr or ()], daemon=True).start()
            return process, f"127.0.0.1:{match.group(2)}"
        if time.monotonic() > deadline:
            break
    process.kill()
    raise RuntimeError("pyserve did not start")


async def openai_level(url: str, concurrency: int, requests: int, max_tokens: int) -> dict[str, float]:
    """The openai client's measurements at one concurrency (milliseconds, tokens/s)."""
    import openai

    ttft: list[float] = []
    itl: list[float] = []
    tokens = 0
    remaining = requests

    async with openai.AsyncOpenAI(base_url=f"http://{url}/v1", api_key="unused", max_retries=0, timeout=120) as client:
        async def lane() -> None:
            nonlocal remaining, tokens
            while remaining > 0:
                remaining -= 1
                start = time.perf_counter()
                first = last = 0.0
                usage = 0
                stream = await client.chat.completions.create(
                    model="tiny_lm", messages=[{"role": "user", "content": PROMPT}], max_tokens=max_tokens,
                    stream=True, stream_options={"include_usage": True})
                async for chunk in stream:
                    if chunk.usage is not None:
                        usage = chunk.usage.completion_tokens
                    if chunk.choices and chunk.choices[0].delta.content:
                        last = time.perf_counter() - start
                        first = first or last
                tokens += usage
                if first:
                    ttft.append(first * 1000)
                    if usage > 1:
                        itl.append((last - first) * 1000 / (usage - 1))

        began = time.perf_counter()
        await asyncio.gather(*(lane() for _ in range(concurrency)))
        seconds = time.perf_counter() - began
    return {"ttft": float(np.mean(ttft)), "ttft_p99": float(np.percentile(ttft, 99)),
            "itl": float(np.mean(itl)) if itl else 0.0, "tokens_s": tokens / seconds, "req_s": requests / seconds}


def bench_level(url: str, concurrency: int, requests: int, max_tokens: int, work: Path) -> dict[str, float]:
    """``pyserve bench --endpoint-type chat`` at one concurrency."""
    out = work / f"bench-{concurrency}.json"
    subprocess.run([sys.executable, "-m", "pyserve", "bench", "-m", "tiny_lm", "-u", url, "--endpoint-type", "chat",
                    "--concurrency-range", str(concurrency), "--request-count", str(requests), "--max-tokens",
                    str(max_tokens), "--prompt", PROMPT, "--json", str(out), "-q"],
                   cwd=ROOT, check=True, capture_output=True, timeout=600)
    level = json.loads(out.read_text())["levels"][0]
    return {"ttft": level["ttft_ms"]["avg"], "ttft_p99": level["ttft_ms"]["p99"], "itl": level["itl_ms"]["avg"],
            "tokens_s": level["output_tokens_per_s"], "req_s": level["requests_per_s"]}


def aiperf_level(aiperf: str, url: str, concurrency: int, requests: int, max_tokens: int,
                 work: Path) -> dict[str, float]:
    """``aiperf profile`` at one concurrency (its JSON export)."""
    artifacts = work / f"aiperf-{concurrency}"
    subprocess.run([aiperf, "profile", "--model", "tiny_lm", "--url", f"http://{url}", "--endpoint-type", "chat",
                    "--streaming", "--tokenizer", str(TOKENIZER), "--request-count", str(requests),
                    "--concurrency", str(concurrency), "--isl", "32", "--osl", str(max_tokens), "--ui-type", "simple",
                    "--artifact-dir", str(artifacts)], cwd=work, check=True, capture_output=True, timeout=900)
    data: dict[str, Any] = json.loads((artifacts / "profile_export_aiperf.json").read_text())
    return {"ttft": data["time_to_first_token"]["avg"], "ttft_p99": data["time_to_first_token"]["p99"],
            "itl": data["inter_token_latency"]["avg"], "tokens_s": data["output_token_throughput"]["avg"],
            "req_s": data["request_throughput"]["avg"]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=32, help="streamed requests per level and client")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--aiperf", default=shutil.which("aiperf"), help="the aiperf executable (default: on PATH)")
    args = parser.parse_args(argv)
    rows: list[tuple[str, int, dict[str, float]]] = []
    notes: list[str] = []
    process, url = start_server()
    try:
        with tempfile.TemporaryDirectory(prefix="pyserve-llm-") as temp:
            work = Path(temp)
            for concurrency in args.concurrency:
                clients: list[tuple[str, Any]] = [
                    ("openai client", lambda c=concurrency: asyncio.run(openai_level(url, c, args.requests, args.max_tokens))),
                    ("pyserve bench", lambda c=concurrency: bench_level(url, c, args.requests, args.max_tokens, work)),
                ]
                if args.aiperf:
                    clients.append(("aiperf", lambda c=concurrency: aiperf_level(
                        args.aiperf, url, c, args.requests, args.max_tokens, work)))
                for name, measure in clients:
                    try:
                        rows.append((name, concurrency, measure()))
                    except Exception as exc:  # noqa: BLE001 - reported, the other clients go on
                        notes.append(f"{name} at concurrency {concurrency} failed: {exc}")
            if not args.aiperf:
                notes.append("aiperf is not installed (pip install aiperf, or --aiperf PATH): not measured")
    finally:
        process.terminate()
        process.wait(30)
    print(f"tiny_lm, /v1/chat/completions streamed, {args.requests} requests per level, max_tokens {args.max_tokens}\n")
    print("| client | concurrency | req/s | output tok/s | TTFT avg ms | TTFT p99 ms | ITL avg ms |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for name, concurrency, r in rows:
        print(f"| {name} | {concurrency} | {r['req_s']:.1f} | {r['tokens_s']:.0f} | {r['ttft']:.2f} | "
              f"{r['ttft_p99']:.2f} | {r['itl']:.3f} |")
    for note in notes:
        print(f"\nnote: {note}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
