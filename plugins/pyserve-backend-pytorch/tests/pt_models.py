"""Small PyTorch models saved at test time as TorchScript (and one ``torch.export`` program)."""

from __future__ import annotations

import warnings
from pathlib import Path

import torch


class MLP(torch.nn.Module):
    """``[N, 4]`` → ``[N, 3]``."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(x)


class ConvNet(torch.nn.Module):
    """``image [N, 1, 8, 8]`` → ``(logits [N, 2], features [N, 4])``."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = torch.nn.Conv2d(1, 4, 3, padding=1)
        self.head = torch.nn.Linear(4, 2)

    def forward(self, image: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        features = torch.relu(self.conv(image)).mean(dim=(2, 3))
        return self.head(features), features


class TwoInputs(torch.nn.Module):
    """``forward(x, y)`` → ``{"sum": x * 2 + y, "count": number of positive x as int64}``."""

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"sum": x * 2 + y, "count": (x > 0).sum(dim=1, keepdim=True)}


class Shout(torch.nn.Module):
    """``text: List[str]`` → ``(upper-cased text: List[str], character counts: int64 [N])``."""

    def forward(self, text: list[str]) -> tuple[list[str], torch.Tensor]:
        shouted = [t.upper() + "!" for t in text]
        return shouted, torch.tensor([len(t) for t in text], dtype=torch.int64)


class Echo(torch.nn.Module):
    """``INPUT__0: List[str]`` → the same list (one List[str] result, not a tuple)."""

    def forward(self, words: list[str]) -> list[str]:
        return words


class TensorForStrings(torch.nn.Module):
    """Returns a tensor where a config may wrongly declare a string output."""

    def forward(self, words: list[str]) -> torch.Tensor:
        return torch.zeros(len(words))


class Accumulator(torch.nn.Module):
    """A sequence model as Triton's QA writes one: ``forward(value, start, state)`` takes the
    config input ``INPUT__0``, the START control ``START__1`` and the implicit state
    ``STATE_IN__2``, and returns ``(value + state, value + state as the next state, start)``."""

    def forward(self, value: torch.Tensor, start: torch.Tensor,
                state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        total = value + state
        return total, total.clone(), start


def seeded(module: torch.nn.Module, seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    for parameter in module.parameters():
        torch.nn.init.normal_(parameter)
    return module.eval()


def save_traced(module: torch.nn.Module, example: torch.Tensor, path: Path) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # torch.jit is deprecated upstream
        torch.jit.trace(module, example).save(str(path))


def save_scripted(module: torch.nn.Module, path: Path) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        torch.jit.script(module).save(str(path))


def save_exported(module: torch.nn.Module, example: torch.Tensor, path: Path) -> None:
    batch = torch.export.Dim("batch", max=1024)
    program = torch.export.export(module, (example,), dynamic_shapes={"x": {0: batch}})
    torch.export.save(program, str(path))


def load_scripted(path: Path) -> torch.jit.ScriptModule:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        return torch.jit.load(str(path))
