"""BLS, blocking: forwards INPUT0/INPUT1 to add_sub (or MODEL_NAME) with exec()."""

import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            name = pb_utils.get_input_tensor_by_name(request, "MODEL_NAME")
            model_name = name.as_numpy()[0].decode() if name is not None else "add_sub"
            inputs = [pb_utils.Tensor("INPUT0", pb_utils.get_input_tensor_by_name(request, "INPUT0").as_numpy()[None]),
                      pb_utils.Tensor("INPUT1", pb_utils.get_input_tensor_by_name(request, "INPUT1").as_numpy()[None])]
            bls_request = pb_utils.InferenceRequest(
                model_name=model_name,
                inputs=inputs,
                requested_output_names=["OUTPUT0", "OUTPUT1"],
            )
            bls_response = bls_request.exec()
            if bls_response.has_error():
                responses.append(pb_utils.InferenceResponse(
                    error=pb_utils.TritonError(f"BLS failed: {bls_response.error().message()}")))
                continue
            out0 = pb_utils.get_output_tensor_by_name(bls_response, "OUTPUT0").as_numpy()
            out1 = pb_utils.get_output_tensor_by_name(bls_response, "OUTPUT1").as_numpy()
            responses.append(pb_utils.InferenceResponse([
                pb_utils.Tensor("OUTPUT0", out0[0]), pb_utils.Tensor("OUTPUT1", out1[0])]))
        return responses
