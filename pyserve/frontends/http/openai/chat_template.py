"""How ``/v1/chat/completions`` turns a list of messages into a prompt: a Jinja chat template.

The template is the model's own when its files have one, looked up in the version directory
first, then the model directory:

1. ``chat_template.jinja`` (the file Hugging Face models ship now);
2. the ``chat_template`` of ``tokenizer_config.json`` (a string, or a list of ``{"name",
   "template"}`` of which the one named ``default`` is used).

Otherwise ``DEFAULT_TEMPLATE``: one ``role: content`` line per message, then ``assistant:``,
e.g. ``system: Be brief.\\nuser: Hi\\nassistant:``.

Templates render in Jinja's sandbox (``ImmutableSandboxedEnvironment``) with the variables
Hugging Face templates expect: ``messages``, ``add_generation_prompt`` (true), ``bos_token`` and
``eos_token`` (from ``tokenizer_config.json``, else empty) and ``raise_exception(message)``, which
fails the request with a 400 carrying the message.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, NoReturn

from pyserve.frontends.http.openai.errors import invalid

DEFAULT_TEMPLATE = (
    "{% for message in messages %}{{ message['role'] }}: {{ message['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)
"""The template used when a model has none of its own."""


class TemplateError(ValueError):
    """A model's template files cannot be read or compiled (the message names the file)."""


class _RaisedByTemplate(Exception):
    """A template called ``raise_exception``."""


def _raise_exception(message: str) -> NoReturn:
    raise _RaisedByTemplate(message)


class ChatTemplate:
    """A compiled chat template.

    :param source: the Jinja source.
    :param origin: where it came from (a file path, or ``"default"``), for messages.
    :param bos_token: / :param eos_token: the values of the template's token variables.
    :raises TemplateError: the source does not compile.
    """

    def __init__(self, source: str, origin: str = "default", bos_token: str = "", eos_token: str = "") -> None:
        from jinja2 import TemplateSyntaxError
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        environment = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        environment.globals["raise_exception"] = _raise_exception
        try:
            self._template = environment.from_string(source)
        except TemplateSyntaxError as exc:
            raise TemplateError(f"{origin}: the chat template does not compile: {exc}") from None
        self.origin = origin
        self.bos_token = bos_token
        self.eos_token = eos_token

    def render(self, messages: list[dict[str, str]]) -> str:
        """The prompt for ``messages``.

        :raises OpenAIError: the template rejected the messages (``raise_exception``) or failed
            on them (400, naming the template).
        """
        from jinja2 import TemplateError as JinjaError

        try:
            return self._template.render(
                messages=messages, add_generation_prompt=True, bos_token=self.bos_token, eos_token=self.eos_token,
            )
        except _RaisedByTemplate as exc:
            raise invalid(f"the model's chat template refused the messages: {exc}", "messages") from None
        except (JinjaError, TypeError, ValueError, KeyError, AttributeError) as exc:
            where = Path(self.origin).name  # the file's name only: no server path in a client's answer
            raise invalid(f"the chat template ({where}) failed on the messages: {exc}", "messages") from None


def _token_text(value: Any) -> str:
    """A ``bos_token`` / ``eos_token`` of ``tokenizer_config.json``: a string or ``{"content": ...}``."""
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return str(value["content"])
    return ""


def _from_tokenizer_config(path: Path) -> tuple[str | None, str, str]:
    """``(template or None, bos, eos)`` from a ``tokenizer_config.json``.

    :raises TemplateError: not JSON, or a ``chat_template`` of the wrong form.
    """
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise TemplateError(f"{path}: cannot be read as JSON: {exc}") from None
    if not isinstance(config, dict):
        raise TemplateError(f"{path}: must hold a JSON object")
    bos, eos = _token_text(config.get("bos_token")), _token_text(config.get("eos_token"))
    template = config.get("chat_template")
    if template is None or isinstance(template, str):
        return template, bos, eos
    if isinstance(template, list):
        for entry in template:
            if isinstance(entry, dict) and entry.get("name") == "default" and isinstance(entry.get("template"), str):
                return str(entry["template"]), bos, eos
    raise TemplateError(f"{path}: 'chat_template' must be a string or a list holding a template named 'default'")


def load_chat_template(directories: list[Path]) -> ChatTemplate:
    """The chat template of a model whose files are in ``directories`` (searched in order).

    Reads files: call it off the event loop.

    :raises TemplateError: a template file that cannot be read or compiled.
    """
    bos = eos = ""
    for directory in directories:
        template: str | None = None
        config = directory / "tokenizer_config.json"
        if config.is_file():
            template, bos, eos = _from_tokenizer_config(config)
        jinja = directory / "chat_template.jinja"
        if jinja.is_file():
            try:
                source = jinja.read_text(encoding="utf-8")
            except (OSError, UnicodeDecodeError) as exc:
                raise TemplateError(f"{jinja}: cannot be read: {exc}") from None
            return ChatTemplate(source, str(jinja), bos, eos)
        if template is not None:
            return ChatTemplate(template, str(config), bos, eos)
    return ChatTemplate(DEFAULT_TEMPLATE, "default", bos, eos)
