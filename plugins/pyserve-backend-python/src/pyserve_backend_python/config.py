"""``pb_utils.ModelConfig`` (what ``auto_complete_config`` receives) and the config helpers."""

from __future__ import annotations

import copy
import json
from typing import Any

from pyserve.protocol.config_json import model_config_from_dict, model_config_to_dict

_REQUIRED = ("name", "data_type", "dims")
_ALLOWED: dict[str, tuple[str, ...]] = {
    "input": ("name", "data_type", "dims", "optional"),
    "output": ("name", "data_type", "dims"),
}
"""The keys ``add_input`` / ``add_output`` accept (those of Triton's ``pb_utils``)."""
_ALLOWED_TEXT = {
    "input": "'name', 'data_type', 'dims' and 'optional'",
    "output": "'name', 'data_type' and 'dims'",
}
_DEFAULTS: tuple[Any, ...] = (None, False, 0, "", [], {}, "TYPE_INVALID", "FORMAT_NONE")
"""Values the JSON form prints for fields config.pbtxt did not set."""


class ModelConfig:
    """A model's configuration in Triton's JSON form, as ``auto_complete_config`` edits it.

    Callers may rely on Triton's rules: the setters only add what the config leaves out and
    raise ``ValueError`` when they would contradict what config.pbtxt says. ``as_dict()``
    returns the live dict (changes to it are kept).

    :param model_config: the config as Triton's JSON string, a dict, or a ``ModelConfig``
        protobuf message.
    """

    def __init__(self, model_config: str | dict[str, Any] | Any) -> None:
        if isinstance(model_config, str):
            self._model_config: dict[str, Any] = json.loads(model_config)
        elif isinstance(model_config, dict):
            self._model_config = model_config
        else:
            self._model_config = model_config_to_dict(model_config)

    @property
    def _name(self) -> str:
        return str(self._model_config.get("name", ""))

    def as_dict(self) -> dict[str, Any]:
        """The config as Triton's JSON object (the live dict)."""
        return self._model_config

    def set_max_batch_size(self, max_batch_size: int) -> None:
        """Set ``max_batch_size``.

        :raises ValueError: not a non-negative int, or config.pbtxt set a larger value.
        """
        if isinstance(max_batch_size, bool) or not isinstance(max_batch_size, int) or max_batch_size < 0:
            raise ValueError(f"model '{self._name}': max_batch_size must be a non-negative int, got {max_batch_size!r}")
        configured = int(self._model_config.get("max_batch_size", 0))
        if configured > max_batch_size:
            raise ValueError(
                f"configuration specified max_batch_size {configured}, but in auto-complete-config "
                f"function for model '{self._name}' specified max_batch_size {max_batch_size}"
            )
        self._model_config["max_batch_size"] = max_batch_size

    def set_dynamic_batching(self) -> None:
        """Enable the dynamic batcher (with default settings) unless config.pbtxt configured it.

        :raises ValueError: the config uses the sequence batcher or an ensemble scheduler.
        """
        for other in ("sequence_batching", "ensemble_scheduling"):
            if other in self._model_config:
                raise ValueError(
                    f"Configuration specified scheduling_choice as '{other}', but auto-complete-config "
                    f"function for model '{self._name}' tries to set scheduling_choice as 'dynamic_batching'"
                )
        self._model_config.setdefault("dynamic_batching", {})

    def add_input(self, input: dict[str, Any]) -> None:
        """Add an input (keys ``name``, ``data_type``, ``dims``, optionally ``optional``), or fill in
        the data_type / dims of an input config.pbtxt declares without them.

        :raises ValueError: a key other than those four (Triton's message), a required key is
            missing, or the input contradicts config.pbtxt; the config is then left unchanged.
        """
        self._add_tensor("input", input)

    def add_output(self, output: dict[str, Any]) -> None:
        """Add an output (keys ``name``, ``data_type``, ``dims``), like ``add_input``.

        :raises ValueError: another key (Triton's message), a required key is missing, or the
            output contradicts config.pbtxt; the config is then left unchanged.
        """
        self._add_tensor("output", output)

    def set_model_transaction_policy(self, transaction_policy_dict: dict[str, Any]) -> None:
        """Set ``model_transaction_policy`` (key ``decoupled``).

        :raises ValueError: another key, or config.pbtxt set a different ``decoupled``.
        """
        if not isinstance(transaction_policy_dict, dict):
            raise ValueError(f"model '{self._name}': the transaction policy must be a dict")
        for key in transaction_policy_dict:
            if key != "decoupled":
                raise ValueError(
                    f"model '{self._name}': model transaction property '{key}' is not supported "
                    "(only 'decoupled')"
                )
        decoupled = bool(transaction_policy_dict.get("decoupled", False))
        current = self._model_config.get("model_transaction_policy")
        if current is not None and bool(current.get("decoupled", False)) != decoupled:
            raise ValueError(
                f"trying to change decoupled property in auto-complete-config for model '{self._name}', "
                f"which is already set to {bool(current.get('decoupled', False))}"
            )
        self._model_config["model_transaction_policy"] = {"decoupled": decoupled}

    # -- internals -----------------------------------------------------------------------------
    def _add_tensor(self, kind: str, tensor: dict[str, Any]) -> None:
        if not isinstance(tensor, dict):
            raise ValueError(f"model '{self._name}': add_{kind} expects a dict, got {type(tensor).__name__}")
        self._check_keys(kind, tensor)
        tensor = copy.deepcopy(tensor)
        tensor["dims"] = [int(d) for d in tensor["dims"]]
        tensors = self._model_config.setdefault(kind, [])
        for existing in tensors:
            if existing.get("name") == tensor["name"]:
                self._merge(existing, tensor)
                return
        tensors.append(tensor)

    def _check_keys(self, kind: str, tensor: dict[str, Any]) -> None:
        """Refuse unknown and missing keys, with Triton's wording for unknown ones."""
        for key in tensor:
            if key not in _ALLOWED[kind]:
                raise ValueError(
                    f"{kind} '{tensor.get('name', '')}' in auto-complete-config function for model "
                    f"'{self._name}' contains property other than {_ALLOWED_TEXT[kind]}."
                )
        for key in _REQUIRED:
            if key not in tensor:
                raise ValueError(f"model '{self._name}': {kind} {tensor.get('name', '')!r} is missing property '{key}'")

    def _merge(self, existing: dict[str, Any], tensor: dict[str, Any]) -> None:
        """Fill in what ``existing`` (from config.pbtxt) leaves unset; a contradiction raises
        ValueError before anything is changed."""
        for key, value in tensor.items():
            old = existing.get(key)
            if key == "name" or old == value or any(old is d or (type(old) is type(d) and old == d) for d in _DEFAULTS):
                continue
            raise ValueError(
                f"model '{self._name}', tensor '{tensor['name']}': the model configuration specifies "
                f"{key} {old!r}, but auto-complete-config gives {value!r}"
            )
        existing.update(tensor)

    def to_message(self) -> Any:
        """The config as a ``ModelConfig`` protobuf message.

        :raises ValueError: the dict is not a valid config (e.g. an unknown key or data_type).
        """
        return model_config_from_dict(self._model_config)


def get_input_config_by_name(model_config: dict[str, Any], name: str) -> dict[str, Any] | None:
    """The ``input`` entry called ``name`` of a config dict (``json.loads(args["model_config"])``)."""
    for item in model_config.get("input", []):
        if item.get("name") == name:
            return item
    return None


def get_output_config_by_name(model_config: dict[str, Any], name: str) -> dict[str, Any] | None:
    """The ``output`` entry called ``name`` of a config dict."""
    for item in model_config.get("output", []):
        if item.get("name") == name:
            return item
    return None


def using_decoupled_model_transaction_policy(model_config: dict[str, Any]) -> bool:
    """Whether a config dict sets ``model_transaction_policy { decoupled: true }``."""
    policy = model_config.get("model_transaction_policy")
    return bool(policy.get("decoupled", False)) if isinstance(policy, dict) else False
