"""Small ONNX models built with ``onnx.helper`` at test time (no binary files in the repository)."""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

OPSET = 17
IR_VERSION = 8


def _model(graph: onnx.GraphProto) -> bytes:
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)])
    model.ir_version = IR_VERSION
    onnx.checker.check_model(model)
    return model.SerializeToString()


def mlp(seed: int = 0, features: int = 4, hidden: int = 8, classes: int = 3, batch: str | int = "N") -> bytes:
    """``x`` [batch, features] FP32 → MatMul/Add/Relu/MatMul/Add → ``y`` [batch, classes]."""
    rng = np.random.default_rng(seed)
    inits = [
        numpy_helper.from_array(rng.standard_normal((features, hidden)).astype(np.float32), "w1"),
        numpy_helper.from_array(rng.standard_normal(hidden).astype(np.float32), "b1"),
        numpy_helper.from_array(rng.standard_normal((hidden, classes)).astype(np.float32), "w2"),
        numpy_helper.from_array(rng.standard_normal(classes).astype(np.float32), "b2"),
    ]
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
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [batch, features])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [batch, classes])],
        inits,
    )
    return _model(graph)


def convnet(seed: int = 1) -> bytes:
    """``image`` [N, 1, 8, 8] → Conv/Relu/GlobalAveragePool/Flatten → ``features`` [N, 4] → Gemm → ``logits`` [N, 2]."""
    rng = np.random.default_rng(seed)
    inits = [
        numpy_helper.from_array(rng.standard_normal((4, 1, 3, 3)).astype(np.float32), "cw"),
        numpy_helper.from_array(rng.standard_normal(4).astype(np.float32), "cb"),
        numpy_helper.from_array(rng.standard_normal((4, 2)).astype(np.float32), "fw"),
        numpy_helper.from_array(rng.standard_normal(2).astype(np.float32), "fb"),
    ]
    nodes = [
        helper.make_node("Conv", ["image", "cw", "cb"], ["c"], pads=[1, 1, 1, 1]),
        helper.make_node("Relu", ["c"], ["r"]),
        helper.make_node("GlobalAveragePool", ["r"], ["p"]),
        helper.make_node("Flatten", ["p"], ["features"]),
        helper.make_node("Gemm", ["features", "fw", "fb"], ["logits"]),
    ]
    graph = helper.make_graph(
        nodes,
        "convnet",
        [helper.make_tensor_value_info("image", TensorProto.FLOAT, ["N", 1, 8, 8])],
        [
            helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["N", 2]),
            helper.make_tensor_value_info("features", TensorProto.FLOAT, ["N", 4]),
        ],
        inits,
    )
    return _model(graph)


def strings() -> bytes:
    """``text`` [N, 2] STRING → Identity → ``echo`` (string tensors in and out)."""
    graph = helper.make_graph(
        [helper.make_node("Identity", ["text"], ["echo"])],
        "strings",
        [helper.make_tensor_value_info("text", TensorProto.STRING, ["N", 2])],
        [helper.make_tensor_value_info("echo", TensorProto.STRING, ["N", 2])],
    )
    return _model(graph)


def accumulator() -> bytes:
    """A sequence model: ``OUTPUT = INPUT + STATE_IN`` (also the next ``STATE_OUT``), and
    ``STARTED``, the ``START`` control input it was given (INT32, dims [1], no batching)."""
    nodes = [
        helper.make_node("Add", ["INPUT", "STATE_IN"], ["OUTPUT"]),
        helper.make_node("Identity", ["OUTPUT"], ["STATE_OUT"]),
        helper.make_node("Identity", ["START"], ["STARTED"]),
    ]
    int32 = TensorProto.INT32
    graph = helper.make_graph(
        nodes,
        "accumulator",
        [helper.make_tensor_value_info(n, int32, [1]) for n in ("INPUT", "START", "STATE_IN")],
        [helper.make_tensor_value_info(n, int32, [1]) for n in ("OUTPUT", "STATE_OUT", "STARTED")],
    )
    return _model(graph)
