#!/usr/bin/env python3
"""Regenerate ``pyserve/protocol/descriptors.binpb`` from the ``.proto`` sources.

The output is a serialized ``google.protobuf.FileDescriptorSet`` holding every
file under ``pyserve/protocol`` plus its imports, without source info, written
with deterministic serialization so that reruns produce identical bytes.

Usage::

    python scripts/gen_protos.py [--output PATH]

Requires ``grpcio-tools``.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

from google.protobuf import descriptor_pb2

REPO_ROOT = Path(__file__).resolve().parent.parent
PROTO_DIR = REPO_ROOT / "pyserve" / "protocol"
DEFAULT_OUTPUT = PROTO_DIR / "descriptors.binpb"


def build_descriptor_set() -> bytes:
    """Compile every ``.proto`` in ``pyserve/protocol`` and return the set's bytes."""
    from grpc_tools import protoc

    protos = sorted(p.relative_to(REPO_ROOT).as_posix() for p in PROTO_DIR.glob("*.proto"))
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "descriptors.binpb"
        rc = protoc.main(
            [
                "protoc",
                f"--proto_path={REPO_ROOT}",
                f"--descriptor_set_out={out}",
                "--include_imports",
                *(str(REPO_ROOT / p) for p in protos),
            ]
        )
        if rc != 0:
            raise RuntimeError(f"protoc failed with exit code {rc}")
        fds = descriptor_pb2.FileDescriptorSet.FromString(out.read_bytes())
    return fds.SerializeToString(deterministic=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--output",
        type=Path,
        default=DEFAULT_OUTPUT,
        help="where to write the descriptor set (default: pyserve/protocol/descriptors.binpb)",
    )
    args = parser.parse_args(argv)
    args.output.write_bytes(build_descriptor_set())
    return 0


if __name__ == "__main__":
    sys.exit(main())
