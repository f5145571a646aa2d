import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            x = pb_utils.get_input_tensor_by_name(request, "INPUT0")
            call = pb_utils.InferenceRequest(
                model_name="add_one", requested_output_names=["OUTPUT0"], inputs=[pb_utils.Tensor("INPUT0", x.as_numpy())]
            )
            answer = call.exec()
            if answer.has_error():
                responses.append(pb_utils.InferenceResponse(error=pb_utils.TritonError(answer.error().message())))
                continue
            y = pb_utils.get_output_tensor_by_name(answer, "OUTPUT0").as_numpy()
            counted = [
                int(pb_utils.get_output_tensor_by_name(r, "OUT").as_numpy()[0])
                for r in pb_utils.InferenceRequest(
                    model_name="count_up", requested_output_names=["OUT"],
                    inputs=[pb_utils.Tensor("IN", np.array([3], dtype=np.int32))],
                ).exec(decoupled=True)
                if pb_utils.get_output_tensor_by_name(r, "OUT") is not None
            ]
            responses.append(pb_utils.InferenceResponse([
                pb_utils.Tensor("OUTPUT0", (y * 2).astype(np.float32)),
                pb_utils.Tensor("COUNTED", np.array(counted, dtype=np.int32)),
            ]))
        return responses
