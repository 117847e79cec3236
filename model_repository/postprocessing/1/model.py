"""Triton adapter for postprocessing: one llm response -> text (logic in backend/)."""

import sys
from pathlib import Path

import triton_python_backend_utils as pb_utils

REPO_ROOT = Path(__file__).resolve().parents[3]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from backend.gc_freeze import freeze_startup_heap  # noqa: E402
from backend.tokenizer import load_tokenizer  # noqa: E402
from backend.triton_utils import (  # noqa: E402
    POSTPROCESSING_PARAMETERS,
    check_serving_config,
    exit_with_server,
    POSTPROCESSING_INPUTS,
    model_path_from_config,
    postprocess_arrays,
    respond_each,
)


class TritonPythonModel:
    def initialize(self, args):
        self._watcher = exit_with_server("postprocessing")
        check_serving_config(
            args, "postprocessing", parameters=POSTPROCESSING_PARAMETERS,
            one_instance="the ensemble hands it each llm response as it arrives, and two instances decoded a "
                         "stream's responses concurrently and sent them out of order")
        self.model_path = model_path_from_config(args)
        self.tokenizer = load_tokenizer(self.model_path)
        freeze_startup_heap()
        pb_utils.Logger.log_info(f"postprocessing ready: tokenizer from {self.model_path}")

    def execute(self, requests):
        return respond_each(
            pb_utils, requests, POSTPROCESSING_INPUTS, lambda arrays: postprocess_arrays(self.tokenizer, arrays),
            "postprocessing",
        )
