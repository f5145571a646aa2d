"""Write the binary model files of the mixed repository (they are generated, never committed).

    python examples/mixed_repository/build_models.py [--output DIR]

Without ``--output`` the files go next to this script's config.pbtxt files, so that
``pyserve run --model-repository examples/mixed_repository`` serves them. With ``--output``
the whole repository (configs, model.py and generated files) is written to DIR.

Needs ``onnx``, ``torch`` and ``tensorflow`` (``make install-test`` installs them). Weights
come from fixed seeds, so every run writes the same models; ``reference_outputs`` computes
what each model returns, straight from the frameworks, for tests and for comparison.
"""

from __future__ import annotations

import argparse
import os
import shutil
import warnings
from pathlib import Path
from typing import Any

import numpy as np

HERE = Path(__file__).resolve().parent
MODELS = ("onnx_mlp", "torch_convnet", "tf_mlp", "preprocess", "pipeline")


def mlp_weights(seed: int = 0) -> dict[str, np.ndarray]:
    """The MLP's weights, shared by the ONNX and the TensorFlow model."""
    rng = np.random.default_rng(seed)
    return {
        "w1": rng.standard_normal((4, 8)).astype(np.float32),
        "b1": rng.standard_normal(8).astype(np.float32),
        "w2": rng.standard_normal((8, 3)).astype(np.float32),
        "b2": rng.standard_normal(3).astype(np.float32),
    }


def mlp_numpy(x: np.ndarray) -> np.ndarray:
    """The MLP in numpy (what both the ONNX and the TensorFlow models compute)."""
    w = mlp_weights()
    return np.maximum(x @ w["w1"] + w["b1"], 0.0) @ w["w2"] + w["b2"]


def build_onnx(path: Path) -> None:
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    w = mlp_weights()
    nodes = [
        helper.make_node("MatMul", ["x", "w1"], ["h0"]),
        helper.make_node("Add", ["h0", "b1"], ["h1"]),
        helper.make_node("Relu", ["h1"], ["h2"]),
        helper.make_node("MatMul", ["h2", "w2"], ["h3"]),
        helper.make_node("Add", ["h3", "b2"], ["y"]),
    ]
    graph = helper.make_graph(
        nodes,
        "mlp",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 3])],
        [numpy_helper.from_array(v, k) for k, v in w.items()],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.checker.check_model(model)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(model.SerializeToString())


def torch_convnet() -> Any:
    """The conv net as an eager ``torch.nn.Module`` with fixed weights."""
    import torch

    class ConvNet(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv = torch.nn.Conv2d(1, 4, 3, padding=1)
            self.head = torch.nn.Linear(4, 2)

        def forward(self, image: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            features = torch.relu(self.conv(image)).mean(dim=(2, 3))
            return self.head(features), features

    torch.manual_seed(1)
    return ConvNet().eval()


def build_torchscript(path: Path) -> None:
    import torch

    path.parent.mkdir(parents=True, exist_ok=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # TorchScript is deprecated upstream
        torch.jit.trace(torch_convnet(), torch.zeros(2, 1, 8, 8)).save(str(path))


def build_savedmodel(path: Path) -> None:
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import tensorflow as tf

    w = mlp_weights()

    class MLP(tf.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = {k: tf.Variable(v) for k, v in w.items()}

        @tf.function(input_signature=[tf.TensorSpec([None, 4], tf.float32, name="x")])
        def __call__(self, x: tf.Tensor) -> dict[str, tf.Tensor]:
            hidden = tf.nn.relu(tf.matmul(x, self.w["w1"]) + self.w["b1"])
            return {"y": tf.matmul(hidden, self.w["w2"]) + self.w["b2"]}

    module = MLP()
    if path.exists():
        shutil.rmtree(path)
    tf.saved_model.save(module, str(path), signatures={"serving_default": module.__call__})


def reference_outputs(name: str, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """What model ``name`` returns for ``inputs``, computed by the framework (or numpy) directly."""
    if name in ("onnx_mlp", "tf_mlp"):
        return {"y": mlp_numpy(inputs["x"])}
    if name == "torch_convnet":
        import torch

        with torch.inference_mode():
            logits, features = torch_convnet()(torch.from_numpy(inputs["image"]))
        return {"logits__0": logits.numpy(), "features__1": features.numpy()}
    if name == "pipeline":  # the preprocessing constants come from the model.py itself
        from importlib import util

        spec = util.spec_from_file_location("mixed_preprocess", HERE / "preprocess" / "1" / "model.py")
        assert spec is not None and spec.loader is not None
        module = util.module_from_spec(spec)
        spec.loader.exec_module(module)  # needs triton_python_backend_utils (pyserve-backend-python)
        return {"SCORES": mlp_numpy((inputs["RAW"] - module.MEAN) / module.SCALE)}
    raise KeyError(name)


def build(output: Path = HERE) -> Path:
    """Write the repository's generated files under ``output`` (copying the configs there first
    when ``output`` is not this folder); returns ``output``."""
    output = output.resolve()
    if output != HERE:
        for name in MODELS:
            shutil.copytree(HERE / name, output / name, dirs_exist_ok=True)
    build_onnx(output / "onnx_mlp" / "1" / "model.onnx")
    build_torchscript(output / "torch_convnet" / "1" / "model.pt")
    build_savedmodel(output / "tf_mlp" / "1" / "model.savedmodel")
    (output / "pipeline" / "1").mkdir(parents=True, exist_ok=True)
    return output


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output", type=Path, default=HERE, help="repository to write (default: next to this script)")
    args = parser.parse_args()
    print(f"wrote the mixed repository to {build(args.output)}")


if __name__ == "__main__":
    main()
