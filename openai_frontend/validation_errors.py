"""Pydantic's validation errors of a request body as one OpenAI-style message naming the parameter
(server.py's 400s, and responses.py's chat request)."""

from __future__ import annotations

import json
import re
from typing import Any, Literal, Optional, get_args, get_origin

from pydantic import BaseModel

from openai_frontend import protocol

_TYPE_NAMES = frozenset({"str", "int", "float", "bool", "dict", "list", "none"})
# pydantic tags a model's branch of a union with the model's name.
_MODELS: dict[str, type[BaseModel]] = {
    name: cls for name, cls in vars(protocol).items() if isinstance(cls, type) and issubclass(cls, BaseModel)
}


def _is_branch(part: Any) -> bool:
    """A union branch's tag in an error location ('str', 'list[constrained-int]'), not a field."""
    return isinstance(part, str) and (
        "[" in part or part in _TYPE_NAMES or part.startswith("constrained-") or part in _MODELS)


def _first_error(errors: list[dict[str, Any]]) -> dict[str, Any]:
    """The error to report. For a value no branch of a union accepts, pydantic reports every
    branch: the error of a branch whose type fits but whose bound is broken (a negative token id)
    says what is wrong; when none fits, a message naming the accepted forms does. An object is
    judged by the object branches (`_object_branch_error`)."""
    err = errors[0]
    loc = list(err.get("loc", ()))
    cut = next((i for i, part in enumerate(loc) if _is_branch(part)), None)
    if cut is None:
        return err
    head = loc[:cut]
    branches = [e for e in errors if list(e.get("loc", ()))[:cut] == head and len(e.get("loc", ())) > cut]
    if isinstance(_union_input(branches, cut), dict):
        return _object_branch_error(head, cut, branches)
    bounded = [e for e in branches if not str(e.get("type", "")).endswith(("_type", "_parsing"))]
    if bounded:
        return {**bounded[0], "loc": tuple(p for p in bounded[0]["loc"] if not _is_branch(p))}
    return _forms_error(head, cut, branches)


def _union_input(branches: list[dict[str, Any]], cut: int) -> Any:
    """The value given to the union, as a branch that refused it whole reports it (None if none did)."""
    return next((e.get("input") for e in branches if len(e["loc"]) == cut + 1), None)


def _object_branch_error(head: list[Any], cut: int, branches: list[dict[str, Any]]) -> dict[str, Any]:
    """An object given to a union of literals (or strings) and objects: a string branch's 'Input
    should be ...' says nothing about it. An object branch that looked inside says what is wrong
    there (`tool_choice.function` missing), unless the object's discriminator, a field that branch
    holds to one value (`"type": "function"`), differs: then it is of no accepted kind at all."""
    inside = [e for e in branches if len(e["loc"]) > cut + 1]
    misfits = {e["loc"][cut] for e in inside if e.get("type") == "literal_error" and len(e["loc"]) == cut + 2
               and _is_discriminator(e["loc"][cut], e["loc"][cut + 1])}
    fitting = [e for e in inside if e["loc"][cut] not in misfits]
    if not fitting:
        return _forms_error(head, cut, branches)
    return {**fitting[0], "loc": (*head, *(p for p in fitting[0]["loc"][cut + 1:] if not _is_branch(p)))}


def _is_discriminator(model: Any, field: Any) -> bool:
    info = _MODELS[model].model_fields.get(field) if model in _MODELS else None
    return info is not None and get_origin(info.annotation) is Literal and len(get_args(info.annotation)) == 1


def _forms_error(head: list[Any], cut: int, branches: list[dict[str, Any]]) -> dict[str, Any]:
    forms = dict.fromkeys(_form(str(e["loc"][cut])) for e in branches)
    return {"loc": tuple(head), "type": "union", "msg": f"expected one of: {', '.join(forms)}"}


def _form(tag: str) -> str:
    """How a union branch's tag reads in a message: its values for a literal, its shape for a model."""
    values = re.findall(r"'((?:[^'\\]|\\.)*)'", tag) if tag.startswith("literal[") else []
    if values:
        return ", ".join(f'"{v}"' for v in values)
    if tag in _MODELS:
        return _model_form(_MODELS[tag])
    return tag.replace("constrained-", "")


def _model_form(model: type[BaseModel]) -> str:
    """A model's shape: its discriminators' values and its required fields (`{"type": "function",
    "function": {"name": ...}}`)."""
    parts = []
    for name, info in model.model_fields.items():
        ann = info.annotation
        if get_origin(ann) is Literal and len(get_args(ann)) == 1:
            parts.append(f'"{name}": {json.dumps(get_args(ann)[0])}')
        elif info.is_required():
            nested = isinstance(ann, type) and issubclass(ann, BaseModel)
            parts.append(f'"{name}": ' + (_model_form(ann) if nested else "..."))
    return "{" + ", ".join(parts) + "}"


def validation_message(errors: list[dict[str, Any]]) -> tuple[str, Optional[str]]:
    """(message, param) for pydantic's errors of a request body (FastAPI's, whose locations start
    with "body", or a model's own)."""
    if not errors:
        return "Invalid request", None
    err = _first_error(errors)
    loc = [str(p) for p in err.get("loc", ()) if p != "body"]
    param = ".".join(loc) or None
    kind = err.get("type", "")
    if kind == "extra_forbidden":
        return f"Unrecognized request argument supplied: {param}", param
    if kind == "json_invalid":
        return f"Invalid JSON body: {err.get('msg', '')}", None
    if kind == "missing":
        if param is None:  # the body itself
            return "The request body is missing: send a JSON object", None
        return f"Missing required parameter: '{param}'", param
    msg = str(err.get("msg", "invalid value")).removeprefix("Value error, ")
    if param is None and (m := _UNICODE_AT.match(msg)):
        param = m.group(1)  # a body-wide check (protocol._Body) names the field in its words only
    return (f"Invalid value for '{param}': {msg}" if loc else msg), param


_UNICODE_AT = re.compile(r"invalid Unicode at ([A-Za-z_][\w.\[\]]*):")
