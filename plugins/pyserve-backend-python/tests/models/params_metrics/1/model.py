"""Echoes the request parameters (as JSON, and as response parameters) and keeps custom metrics."""

import json

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        self.requests_family = pb_utils.MetricFamily(
            name="pyserve_test_requests", description="requests seen", kind=pb_utils.MetricFamily.COUNTER)
        self.sum_family = pb_utils.MetricFamily(
            name="pyserve_test_last_sum", description="sum of the last IN", kind=pb_utils.MetricFamily.GAUGE)
        self.size_family = pb_utils.MetricFamily(
            name="pyserve_test_input_size", description="IN sizes", kind=pb_utils.MetricFamily.HISTOGRAM)
        labels = {"model": args["model_name"], "version": args["model_version"]}
        self.requests = self.requests_family.Metric(labels=labels)
        self.last_sum = self.sum_family.Metric(labels=labels)
        self.sizes = self.size_family.Metric(labels=labels, buckets=[1.0, 4.0, 16.0])

    def execute(self, requests):
        responses = []
        for request in requests:
            values = pb_utils.get_input_tensor_by_name(request, "IN").as_numpy()
            self.requests.increment(1)
            self.last_sum.set(float(values.sum()))
            self.sizes.observe(values.size)
            params = json.loads(request.parameters())
            out = np.array([json.dumps(params, sort_keys=True).encode()], dtype=np.object_)
            responses.append(pb_utils.InferenceResponse(
                output_tensors=[pb_utils.Tensor("PARAMS", out)],
                parameters={"seen": len(params), "request_count": int(self.requests.value())}))
        return responses
