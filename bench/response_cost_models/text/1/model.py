"""One text tensor per request, made from its ids without a tokenizer."""

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            ids = pb_utils.get_input_tensor_by_name(request, "detok_ids").as_numpy()
            start = int(pb_utils.get_input_tensor_by_name(request, "detok_prefix_len").as_numpy().reshape(-1)[0])
            text = " ".join(str(int(t)) for t in ids[start:])
            responses.append(pb_utils.InferenceResponse(
                output_tensors=[pb_utils.Tensor("text_output", np.asarray([text.encode()], dtype=object))]))
        return responses
