"""Responses API items: input items as chat messages, and a chat answer's deltas as output items
and their stream events (responses.py runs them)."""

from __future__ import annotations

import base64
import json
import uuid
import zlib
from typing import Any, Mapping, Optional

from openai_frontend.errors import bad_request, unsupported

_TEXT_PARTS = ("input_text", "output_text", "text")


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def _text_of(content: Any, where: str, field: str = "content") -> str:
    """A message's content as one string: text parts joined, other parts refused."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad_request(f"{where}.{field} must be a string or a list of content parts", param=f"{where}.{field}")
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in _TEXT_PARTS and isinstance(part.get("text"), str):
            texts.append(part["text"])
        elif kind == "refusal" and isinstance(part.get("refusal"), str):
            texts.append(part["refusal"])
        elif kind in ("input_image", "input_file", "input_audio"):
            raise unsupported(f"{where}.{field}[{j}]", f"'{kind}' parts are not supported: this server runs text models")
        else:
            raise bad_request(f"{where}.{field}[{j}] must be a text part ({{\"type\": \"input_text\", \"text\": ...}})",
                              param=f"{where}.{field}[{j}]")
    return "".join(texts)


# `include: ["reasoning.encrypted_content"]`: the reasoning item's text in a form a client passes
# back as it is (OpenAI's way to continue a turn's reasoning without a stored response). This
# server holds no key: it is the text compressed and base64-encoded, not encrypted (the same text
# is in the item's content anyway).
_BLOB = "trllm-rs1:"
_BLOB_MAX_CHARS = 16 * 1024 * 1024


def reasoning_blob(text: str) -> str:
    return _BLOB + base64.urlsafe_b64encode(zlib.compress(text.encode("utf-8"))).decode("ascii")


def reasoning_from_blob(blob: Any, where: str) -> str:
    """The reasoning text of an encrypted_content this server made; a 400 naming `where` otherwise."""
    refusal = bad_request(f"{where} was not made by this server (it reads back only the encrypted_content "
                          "of its own reasoning items)", param=where)
    if not isinstance(blob, str) or not blob.startswith(_BLOB):
        raise refusal
    try:
        inflate = zlib.decompressobj()
        data = inflate.decompress(base64.urlsafe_b64decode(blob[len(_BLOB):].encode("ascii")), _BLOB_MAX_CHARS * 4)
        if inflate.unconsumed_tail or not inflate.eof:  # past the limit, or cut short
            raise ValueError
        return data.decode("utf-8")
    except (ValueError, zlib.error, UnicodeError):
        raise refusal from None


def input_messages(items: Optional[str | list[dict[str, Any]]], name: str = "input") -> list[dict[str, Any]]:
    """Input items (the body's `name`, for errors) as chat messages. A function call joins the assistant message before it (or
    starts one); a reasoning item goes to the assistant message after it as its
    reasoning_content, which chat templates render (or drop) as they do a chat's (with none
    after it, to an assistant message of its own)."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    out: list[dict[str, Any]] = []
    reasoning: Optional[str] = None

    def assistant(joins: bool) -> dict[str, Any]:
        """The assistant message an item goes to: a function call joins the one just before it
        (a response's message and calls are one chat turn); a message starts its own."""
        nonlocal reasoning
        if joins and out and out[-1]["role"] == "assistant" and reasoning is None:
            return out[-1]
        msg: dict[str, Any] = {"role": "assistant", "content": ""}
        if reasoning is not None:
            msg["reasoning_content"] = reasoning
            reasoning = None
        out.append(msg)
        return msg

    def flush_reasoning() -> None:
        """Reasoning no assistant item followed: an assistant turn of its own."""
        if reasoning is not None:
            assistant(joins=False)

    for i, item in enumerate(items or ()):
        where = f"{name}[{i}]"
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "system", "developer", "assistant"):
                raise bad_request(f"{where}.role must be one of 'user', 'system', 'developer', 'assistant'",
                                  param=f"{where}.role")
            text = _text_of(item.get("content"), where)
            if role == "assistant":
                assistant(joins=False)["content"] = text
            else:
                flush_reasoning()
                out.append({"role": role, "content": text})
        elif kind == "function_call":
            for key in ("call_id", "name", "arguments"):
                if not isinstance(item.get(key), str):
                    raise bad_request(f"{where}.{key} must be a string", param=f"{where}.{key}")
            assistant(joins=True).setdefault("tool_calls", []).append(
                {"id": item["call_id"], "type": "function",
                 "function": {"name": item["name"], "arguments": item["arguments"]}})
        elif kind == "function_call_output":
            if not isinstance(item.get("call_id"), str):
                raise bad_request(f"{where}.call_id must be a string", param=f"{where}.call_id")
            flush_reasoning()
            out.append({"role": "tool", "tool_call_id": item["call_id"], "content": _text_of(item.get("output"), where, "output")})
        elif kind == "reasoning":
            parts = item.get("content") or []
            if not isinstance(parts, list) or not all(
                    isinstance(part, dict) and part.get("type") == "reasoning_text" and isinstance(part.get("text"), str)
                    for part in parts):
                raise bad_request(f"{where}.content must be a list of reasoning_text parts "
                                  '({"type": "reasoning_text", "text": ...})', param=f"{where}.content")
            text = "".join(part["text"] for part in parts)
            if item.get("encrypted_content") is not None and not text:
                text = reasoning_from_blob(item["encrypted_content"], f"{where}.encrypted_content")
            reasoning = (reasoning or "") + text
        else:
            raise unsupported(f"{where}.type", f"input items of type '{kind}' are not supported (messages, "
                                               "function_call, function_call_output and reasoning are)")
    flush_reasoning()
    return out


class OutputBuilder:
    """Output items from a chat answer's deltas, in order: reasoning, message, function calls.
    Each call returns the stream events it makes (without sequence numbers)."""

    def __init__(self, logprobs: bool, namespaces: Optional[dict[str, str]] = None,
                 reasoning_blob: bool = False) -> None:
        self.logprobs = logprobs
        self.reasoning_blob = reasoning_blob  # include reasoning.encrypted_content
        self.namespaces = namespaces or {}  # a namespace tool's function -> the namespace (its calls name it)
        self.items: list[dict[str, Any]] = []
        self._open: Optional[dict[str, Any]] = None
        self._calls: dict[int, dict[str, Any]] = {}  # chat tool-call index -> its item
        # Logprobs of tokens that came with no text at all (a token ending inside a character, a
        # marker the parsers hold back): the message's next text takes them; reasoning or a call
        # coming next shows they were its markers.
        self._held: list[dict[str, Any]] = []

    def _add(self, item: dict[str, Any]) -> list[dict[str, Any]]:
        events = self._close()
        self.items.append(item)
        self._open = item
        events.append({"type": "response.output_item.added", "output_index": len(self.items) - 1,
                       "item": snapshot(item)})
        return events

    def _close(self, status: str = "completed") -> list[dict[str, Any]]:
        item, self._open = self._open, None
        if item is None:
            return []
        index = self.items.index(item)
        item["status"] = status
        events: list[dict[str, Any]] = []
        if item["type"] == "reasoning":
            part = item["content"][0]
            if self.reasoning_blob:
                item["encrypted_content"] = reasoning_blob(part["text"])
            events += [{"type": "response.reasoning_text.done", "item_id": item["id"], "output_index": index,
                        "content_index": 0, "text": part["text"]},
                       {"type": "response.content_part.done", "item_id": item["id"], "output_index": index,
                        "content_index": 0, "part": dict(part)}]
        elif item["type"] == "message":
            part = item["content"][0]
            done = {"type": "response.output_text.done", "item_id": item["id"], "output_index": index,
                    "content_index": 0, "text": part["text"]}
            if self.logprobs:
                done["logprobs"] = part["logprobs"]
            events += [done, {"type": "response.content_part.done", "item_id": item["id"], "output_index": index,
                              "content_index": 0, "part": snapshot(part)}]
        else:
            events.append({"type": "response.function_call_arguments.done", "item_id": item["id"],
                           "output_index": index, "name": item["name"], "arguments": item["arguments"]})
        events.append({"type": "response.output_item.done", "output_index": index, "item": snapshot(item)})
        return events

    def reasoning(self, delta: str) -> list[dict[str, Any]]:
        self._held = []
        events: list[dict[str, Any]] = []
        item = self._open
        if item is None or item["type"] != "reasoning":
            item = {"id": new_id("rs"), "type": "reasoning", "summary": [], "content": [], "status": "in_progress"}
            events = self._add(item)
            part = {"type": "reasoning_text", "text": ""}
            item["content"].append(part)
            events.append({"type": "response.content_part.added", "item_id": item["id"],
                           "output_index": len(self.items) - 1, "content_index": 0, "part": dict(part)})
        item["content"][0]["text"] += delta
        events.append({"type": "response.reasoning_text.delta", "item_id": item["id"],
                       "output_index": len(self.items) - 1, "content_index": 0, "delta": delta})
        return events

    def hold_logprobs(self, logprobs: list[dict[str, Any]]) -> None:
        self._held.extend(logprobs)

    def text(self, delta: str, logprobs: Optional[list[dict[str, Any]]] = None) -> list[dict[str, Any]]:
        if self._held:
            logprobs, self._held = self._held + (logprobs or []), []
        events: list[dict[str, Any]] = []
        item = self._open
        if item is None or item["type"] != "message":
            item = {"id": new_id("msg"), "type": "message", "role": "assistant", "status": "in_progress",
                    "content": []}
            events = self._add(item)
            part: dict[str, Any] = {"type": "output_text", "text": "", "annotations": []}
            if self.logprobs:
                part["logprobs"] = []
            item["content"].append(part)
            events.append({"type": "response.content_part.added", "item_id": item["id"],
                           "output_index": len(self.items) - 1, "content_index": 0, "part": snapshot(part)})
        part = item["content"][0]
        part["text"] += delta
        if self.logprobs:
            part["logprobs"].extend(logprobs or [])
        if delta or logprobs:
            events.append({"type": "response.output_text.delta", "item_id": item["id"],
                           "output_index": len(self.items) - 1, "content_index": 0, "delta": delta,
                           "logprobs": logprobs or []})
        return events

    def tool_call(self, delta: dict[str, Any]) -> list[dict[str, Any]]:
        """A chat tool-call delta: its first names the call (id, name), later ones add arguments."""
        events: list[dict[str, Any]] = []
        index = delta.get("index", len(self._calls))
        fn = delta.get("function") or {}
        self._held = []
        item = self._calls.get(index)
        if item is None:
            item = {"id": new_id("fc"), "type": "function_call", "call_id": delta.get("id") or new_id("call"),
                    "name": fn.get("name") or "", "arguments": "", "status": "in_progress"}
            if item["name"] in self.namespaces:
                item["namespace"] = self.namespaces[item["name"]]
            self._calls[index] = item
            events += self._add(item)
        args = fn.get("arguments") or ""
        if args:
            item["arguments"] += args
            events.append({"type": "response.function_call_arguments.delta", "item_id": item["id"],
                           "output_index": self.items.index(item), "delta": args})
        return events

    def finish(self, incomplete: bool) -> list[dict[str, Any]]:
        """Closes the open item. An answer with neither text nor a call (nothing at all, or
        reasoning cut short) still has its message, empty."""
        opened = self._open is not None and self._open["type"] == "message"
        needs_message = not any(i["type"] != "reasoning" for i in self.items)
        events = self.text("") if needs_message or (opened and self._held) else []
        return events + self._close("incomplete" if incomplete else "completed")

    def reasoning_text(self) -> str:
        return "".join(i["content"][0]["text"] for i in self.items if i["type"] == "reasoning")


def snapshot(value: dict[str, Any]) -> dict[str, Any]:
    return json.loads(json.dumps(value))  # an event holds the item as it was then


_ITEM_ID_PREFIX = {"message": "msg", "function_call": "fc", "function_call_output": "fco", "reasoning": "rs"}


def item_id(kind: Any) -> str:
    """A new id for an item of this type (OpenAI's prefixes)."""
    return new_id(_ITEM_ID_PREFIX.get(kind, "item") if isinstance(kind, str) else "item")


def input_items(value: Optional[str | list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """A request's input as OpenAI lists it back (GET .../input_items): items with ids, a
    message's text as content parts."""
    if value is None:
        return []
    out = []
    for item in [{"role": "user", "content": value}] if isinstance(value, str) else value:
        item = dict(item)
        kind = item.setdefault("type", "message")
        if kind == "message":
            if isinstance(item.get("content"), str):
                part = "output_text" if item.get("role") == "assistant" else "input_text"
                item["content"] = [{"type": part, "text": item["content"]}]
            item.setdefault("status", "completed")
        item.setdefault("id", item_id(kind))
        out.append(item)
    return out


def list_items(items: list[dict[str, Any]], query: Mapping[str, str], whose: str = "response's input"
               ) -> dict[str, Any]:
    """OpenAI's list object over `items` (oldest first), the page its query asks for: `limit`
    (1-100, 20), `order` (desc, the default, starts from the newest), `after` (the id of the item
    the page starts after)."""
    try:
        limit = int(query.get("limit", "20"))
    except ValueError:
        limit = 0
    if not 1 <= limit <= 100:
        raise bad_request("limit must be an integer from 1 to 100", param="limit")
    order = query.get("order", "desc")
    if order not in ("asc", "desc"):
        raise bad_request("order must be 'asc' or 'desc'", param="order")
    after = query.get("after")
    ordered = items[::-1] if order == "desc" else items
    if after is not None:
        ids = [item["id"] for item in ordered]
        if after not in ids:
            raise bad_request(f"No item with id '{after}' in this {whose}", param="after")
        ordered = ordered[ids.index(after) + 1:]
    page = ordered[:limit]
    return {"object": "list", "data": page, "first_id": page[0]["id"] if page else None,
            "last_id": page[-1]["id"] if page else None, "has_more": len(ordered) > limit}


def output_messages(items: list[dict[str, Any]], name: str = "output") -> list[dict[str, Any]]:
    """A response's output items (or a conversation's items) as the chat messages a next turn's
    history holds."""
    return input_messages([{k: v for k, v in item.items() if k != "status"} for item in items], name)
