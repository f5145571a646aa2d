"""Small TensorFlow models saved at test time: SavedModels from ``tf.Module`` and a frozen GraphDef."""

from __future__ import annotations

from pathlib import Path

import tensorflow as tf
from tensorflow.python.framework.convert_to_constants import convert_variables_to_constants_v2


class MLP(tf.Module):
    """``x [N, 4]`` → ``{"y": [N, 3], "norm": [N, 1]}``."""

    def __init__(self, seed: int = 0) -> None:
        super().__init__()
        rng = tf.random.Generator.from_seed(seed)
        self.w1 = tf.Variable(rng.normal([4, 8]))
        self.b1 = tf.Variable(rng.normal([8]))
        self.w2 = tf.Variable(rng.normal([8, 3]))

    @tf.function(input_signature=[tf.TensorSpec([None, 4], tf.float32, name="x")])
    def __call__(self, x: tf.Tensor) -> dict[str, tf.Tensor]:
        hidden = tf.nn.relu(tf.matmul(x, self.w1) + self.b1)
        y = tf.identity(tf.matmul(hidden, self.w2), name="y")
        return {"y": y, "norm": tf.norm(x, axis=1, keepdims=True)}


class ConvNet(tf.Module):
    """``image [N, 8, 8, 1]`` → ``{"logits": [N, 2], "features": [N, 4]}`` (signature ``predict``)."""

    def __init__(self, seed: int = 1) -> None:
        super().__init__()
        rng = tf.random.Generator.from_seed(seed)
        self.kernel = tf.Variable(rng.normal([3, 3, 1, 4]))
        self.dense = tf.Variable(rng.normal([4, 2]))

    @tf.function(input_signature=[tf.TensorSpec([None, 8, 8, 1], tf.float32, name="image")])
    def __call__(self, image: tf.Tensor) -> dict[str, tf.Tensor]:
        conv = tf.nn.relu(tf.nn.conv2d(image, self.kernel, strides=1, padding="SAME"))
        features = tf.reduce_mean(conv, axis=[1, 2])
        return {"logits": tf.matmul(features, self.dense), "features": features}


class Upper(tf.Module):
    """``text [N]`` STRING → ``upper [N]`` STRING."""

    @tf.function(input_signature=[tf.TensorSpec([None], tf.string, name="text")])
    def __call__(self, text: tf.Tensor) -> dict[str, tf.Tensor]:
        return {"upper": tf.strings.upper(text)}


def save(module: tf.Module, path: Path, signature: str = "serving_default") -> None:
    tf.saved_model.save(module, str(path), signatures={signature: module.__call__})


def save_frozen_graphdef(module: MLP, path: Path) -> None:
    """The MLP's ``y`` as a frozen GraphDef: placeholder ``x``, output tensor ``y:0``."""
    frozen = convert_variables_to_constants_v2(module.__call__.get_concrete_function())
    path.write_bytes(frozen.graph.as_graph_def().SerializeToString())
