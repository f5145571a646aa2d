"""Why a model version failed to load, in the two forms it is shown in.

* The full text (``ModelVersion.detail``) goes to the server's log: the backend's whole
  message, Python tracebacks included, with the place the exception was raised.
* The reason (``ModelVersion.reason``) is what clients see (repository index, model metadata,
  infer on the unavailable model, the load API's answer) and what the startup table shows: a
  traceback is reduced to its exception line and the place in the model's own files where it
  happened, paths inside a model repository are relative to it (a repository itself is named
  as given), and paths of the server's own files (its Python environment, its package) are cut
  to their file names.

A model's file that is missing or broken (``pyserve.ModelFileError`` and ``ModelFileNotFound``,
``FileNotFoundError``, a ``SyntaxError`` in its code) says what it is: it is not labelled with
the step of the load that ran into it.
"""

from __future__ import annotations

import re
import sys
import traceback
from collections.abc import Sequence
from pathlib import Path

from pyserve.api.errors import ModelFileError

_TRACEBACK = "Traceback (most recent call last):"
_FRAME = re.compile(r'^\s*File "(?P<file>[^"]+)", line (?P<line>\d+)')
_CHAINED = ("During handling of the above exception", "The above exception was the direct cause")
_ABSOLUTE_PATH = re.compile(r"(?<![\w:/.~-])/(?:[\w.@+~-]+/)+(?P<name>[\w.@+~-]+)")


def speaks_for_itself(exc: BaseException) -> bool:
    """Whether ``exc``, or an exception it was raised from, says what it is: a model's file that
    is missing or broken (``pyserve.ModelFileError``, ``FileNotFoundError``, ``SyntaxError``).
    Its message then needs no label naming the step of the load that ran into it."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        if isinstance(current, (ModelFileError, FileNotFoundError, SyntaxError)):
            return True
        seen.add(id(current))
        current = current.__cause__ or (None if current.__suppress_context__ else current.__context__)
    return False


def describe(stage: str, exc: BaseException) -> tuple[str, str]:
    """An exception a hook raised at ``stage`` (e.g. ``"auto-complete of the config failed"``)
    as ``(text, detail)``: the text is the message, labelled with the stage and the exception
    type unless the exception says what it is (``speaks_for_itself``); the detail adds where it
    was raised, for the log."""
    if isinstance(exc, SyntaxError):
        text = _syntax_error_text(exc)
    elif speaks_for_itself(exc):
        text = str(exc) or type(exc).__name__
    else:
        text = f"{stage}: {type(exc).__name__}: {exc}"
    frames = traceback.extract_tb(exc.__traceback__)
    detail = f"{text}\n(raised at {frames[-1].filename}:{frames[-1].lineno})" if frames else text
    return text, detail


def _syntax_error_text(exc: SyntaxError) -> str:
    where = f"{exc.filename}:{exc.lineno}" if exc.filename and exc.lineno else exc.filename or "<unknown>"
    return f"{where}: {type(exc).__name__}: {exc.msg}"


def public(text: str, roots: Sequence[Path]) -> str:
    """The client-facing form of a reason's full text (see the module docstring). Applying it
    twice changes nothing."""
    text = _without_tracebacks(text, roots)
    return _relative_paths(text, roots)


def first_line(reason: str, width: int = 80) -> str:
    """The reason's first line, cut to ``width`` characters (``...`` marks a cut, as does a
    reason that goes on after its first line)."""
    line, _, rest = reason.partition("\n")
    cut = len(line) > width
    line = line[: width - 3].rstrip() if cut else line
    return line + "..." if cut or rest.strip() else line


def _without_tracebacks(text: str, roots: Sequence[Path]) -> str:
    """Each ``Traceback (most recent call last):`` block replaced by its last exception line
    and the innermost frame inside a model repository."""
    if _TRACEBACK not in text:
        return text
    lines = text.splitlines()
    out: list[str] = []
    index = 0
    while index < len(lines):
        line = lines[index]
        if line.strip() != _TRACEBACK:
            out.append(line)
            index += 1
            continue
        where = ""
        exception = ""
        index += 1
        while index < len(lines):  # frames and their code, chained tracebacks, the exception line
            current = lines[index]
            frame = _FRAME.match(current)
            if frame is not None:
                if _inside(frame["file"], roots):
                    where = f"{frame['file']}:{frame['line']}"
            elif current.strip() == _TRACEBACK or current.startswith(_CHAINED) or not current.strip():
                exception = ""
            elif not current[:1].isspace():
                exception = current.strip()
                if index + 1 >= len(lines) or not _continues(lines[index + 1]):
                    index += 1
                    break
            index += 1
        summary = exception + (f" (at {where})" if where and where not in exception else "")
        if out and out[-1].rstrip().endswith(":"):
            out[-1] = out[-1].rstrip() + " " + summary
        else:
            out.append(summary)
    return "\n".join(out).strip()


def _continues(line: str) -> bool:
    """Whether a traceback goes on after an exception line (a chained one follows)."""
    stripped = line.strip()
    return not stripped or stripped == _TRACEBACK or line.startswith(_CHAINED) or line[:1].isspace()


def _inside(file: str, roots: Sequence[Path]) -> bool:
    return any(_relative_to(file, root) is not None for root in roots)


def _relative_to(file: str, root: Path) -> str | None:
    for base in {str(root).rstrip("/"), str(root.resolve()).rstrip("/")}:
        if file.startswith(base + "/"):
            return file[len(base) + 1:]
    return None


def _server_prefixes() -> tuple[str, ...]:
    """Where the server's own files are: its Python installation and environment, and the
    folder holding the ``pyserve`` package (a checkout, for an editable install)."""
    places = {sys.prefix, sys.base_prefix, sys.exec_prefix, str(Path(__file__).resolve().parents[2])}
    return tuple(sorted({p.rstrip("/") for p in places if p and p != "/"}, key=len, reverse=True))


def _relative_paths(text: str, roots: Sequence[Path]) -> str:
    """Paths inside a repository made relative to it; paths of the server's own files cut to
    their file names; other paths (a config's values, say) left as they are."""
    bases = sorted({b for root in roots for b in (str(root).rstrip("/"), str(root.resolve()).rstrip("/"))},
                   key=len, reverse=True)
    server = _server_prefixes()

    def shorten(match: re.Match[str]) -> str:
        path = match.group(0)
        for base in bases:
            if path == base:  # a repository as the operator named it
                return path
            if path.startswith(base + "/"):
                return path[len(base) + 1:]
        if any(path.startswith(prefix + "/") for prefix in server):
            return match["name"]
        return path

    return _ABSOLUTE_PATH.sub(shorten, text)
