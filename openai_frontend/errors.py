"""One error type for the whole frontend and the OpenAI error body it renders to."""

from __future__ import annotations

import json
from typing import Optional

_TYPES = {
    400: "invalid_request_error",
    401: "invalid_request_error",
    403: "invalid_request_error",
    404: "invalid_request_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    502: "server_error",
    503: "service_unavailable_error",
    504: "server_error",
}


class APIError(Exception):
    """An error with an HTTP status, rendered as {"error": {"message", "type", "param", "code"}}."""

    def __init__(
        self,
        status_code: int,
        message: str,
        *,
        param: Optional[str] = None,
        code: Optional[str] = None,
        type: Optional[str] = None,
        headers: Optional[dict[str, str]] = None,
    ) -> None:
        super().__init__(message)
        self.status_code = status_code
        self.message = message
        self.param = param
        self.code = code
        self.headers = headers  # extra response headers (Retry-After on 503s)
        self.type = type or _TYPES.get(status_code, "server_error" if status_code >= 500 else "invalid_request_error")

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def json(self) -> str:
        return json.dumps(self.body(), ensure_ascii=False)

    def __repr__(self) -> str:
        return f"APIError({self.status_code}, {self.message!r}, param={self.param!r})"


def bad_request(message: str, param: Optional[str] = None, code: Optional[str] = None) -> APIError:
    return APIError(400, message, param=param, code=code)


def unsupported(param: str, detail: str = "") -> APIError:
    """A parameter this server does not implement (yet): always an error, never ignored."""
    msg = f"Unsupported parameter '{param}'" + (f": {detail}" if detail else "")
    return APIError(400, msg, param=param, code="unsupported_parameter")


def unavailable(message: str, retry_after: int = 1, code: Optional[str] = None) -> APIError:
    """503: Triton unreachable, the model not ready, or the engine overloaded; retry later."""
    return APIError(503, message, code=code, headers={"Retry-After": str(retry_after)})


def timed_out(message: str) -> APIError:
    """504: the request ran past the server's own time limit (--stream-timeout). The OpenAI SDK
    retries every 5xx unless told not to; a retry would run as long and time out again."""
    return APIError(504, message, headers={"x-should-retry": "false"})


def model_not_found(model: str) -> APIError:
    return APIError(404, f"The model `{model}` does not exist.", param="model", code="model_not_found")


def context_exceeded(context: int, prompt: int, completion: Optional[int] = None, detail: str = "",
                     param: Optional[str] = None) -> APIError:
    """A request past the model's context, in the words OpenAI and vLLM use and with OpenAI's
    code: clients find it so (LiteLLM's ContextWindowExceededError, which agent frameworks answer
    by trimming the history, matches "maximum context length")."""
    if completion is None:
        msg = (f"This model's maximum context length is {context} tokens. However, your request has {prompt} "
               "input tokens. Please reduce the length of the input.")
    else:
        msg = (f"This model's maximum context length is {context} tokens. However, you requested "
               f"{prompt + completion} tokens ({prompt} in the input, {completion} in the completion). Please "
               "reduce the length of the input or completion.")
    return APIError(400, f"{msg} ({detail})" if detail else msg, param=param, code="context_length_exceeded")
