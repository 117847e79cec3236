"""Triton adapter for preprocessing: prompt tensors -> prompt_ids (logic in backend/)."""

import sys
from pathlib import Path

import triton_python_backend_utils as pb_utils

REPO_ROOT = Path(__file__).resolve().parents[3]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from backend.tokenizer import load_tokenizer  # noqa: E402
from backend.triton_utils import PREPROCESSING_INPUTS, model_path_from_config, preprocess_arrays  # noqa: E402


def _error(message: str, invalid_arg: bool) -> "pb_utils.TritonError":
    code = getattr(pb_utils.TritonError, "INVALID_ARG" if invalid_arg else "INTERNAL", None)
    return pb_utils.TritonError(message) if code is None else pb_utils.TritonError(message, code)


class TritonPythonModel:
    def initialize(self, args):
        self.model_path = model_path_from_config(args)
        self.tokenizer = load_tokenizer(self.model_path)
        pb_utils.Logger.log_info(f"preprocessing ready: tokenizer from {self.model_path}")

    def execute(self, requests):
        responses = []
        for request in requests:
            try:
                arrays = {}
                for name in PREPROCESSING_INPUTS:
                    tensor = pb_utils.get_input_tensor_by_name(request, name)
                    if tensor is not None:
                        arrays[name] = tensor.as_numpy()
                outputs = preprocess_arrays(self.tokenizer, arrays)
                tensors = [pb_utils.Tensor(name, value) for name, value in outputs.items()]
                responses.append(pb_utils.InferenceResponse(output_tensors=tensors))
            except ValueError as exc:  # bad input: an error response for this request only
                responses.append(pb_utils.InferenceResponse(output_tensors=[], error=_error(str(exc), True)))
            except Exception as exc:  # never let one request fail the others
                msg = f"preprocessing internal error: {type(exc).__name__}: {exc}"
                responses.append(pb_utils.InferenceResponse(output_tensors=[], error=_error(msg, False)))
        return responses
