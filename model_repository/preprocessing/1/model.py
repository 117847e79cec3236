"""Triton adapter for preprocessing: prompt tensors -> prompt_ids (logic in backend/)."""

import sys
from pathlib import Path

import triton_python_backend_utils as pb_utils

REPO_ROOT = Path(__file__).resolve().parents[3]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from backend.gc_freeze import freeze_startup_heap  # noqa: E402
from backend.tokenizer import load_tokenizer  # noqa: E402
from backend.triton_utils import (  # noqa: E402
    PREPROCESSING_PARAMETERS,
    check_serving_config,
    exit_with_server,
    PREPROCESSING_INPUTS,
    chat_template_from_config,
    model_path_from_config,
    preprocess_arrays,
    respond_each,
    trust_request_chat_template,
)


class TritonPythonModel:
    def initialize(self, args):
        self._watcher = exit_with_server("preprocessing")
        check_serving_config(args, "preprocessing", parameters=PREPROCESSING_PARAMETERS)
        self.model_path = model_path_from_config(args)
        self.tokenizer = load_tokenizer(self.model_path)
        template = chat_template_from_config(args)
        if template is not None:
            self.tokenizer.chat_template = template
        self.trust_request_template = trust_request_chat_template(args)
        freeze_startup_heap()
        pb_utils.Logger.log_info(
            f"preprocessing ready: tokenizer from {self.model_path}"
            + (", chat template from the chat_template setting" if template is not None else "")
            + (", chat templates in requests allowed" if self.trust_request_template else "")
        )

    def execute(self, requests):
        return respond_each(
            pb_utils, requests, PREPROCESSING_INPUTS,
            lambda arrays: preprocess_arrays(self.tokenizer, arrays, self.trust_request_template),
            "preprocessing",
        )
