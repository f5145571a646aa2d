"""Triton's platform names and the backends that serve them."""

from __future__ import annotations

TRITON_PLATFORMS: dict[str, str] = {
    "tensorrt_plan": "tensorrt",
    "onnxruntime_onnx": "onnxruntime",
    "pytorch_libtorch": "pytorch",
    "libtorch": "pytorch",
    "torch_aoti": "pytorch",
    "tensorflow_savedmodel": "tensorflow",
    "tensorflow_graphdef": "tensorflow",
}
"""Triton's fixed platform → backend table (``ensemble`` has no backend)."""
