"""OpenAI's Conversations API (/v1/conversations): a conversation is a list of items that a
response created with `conversation` reads as its history, and adds its input and output to once
it has finished (completed, or cut by max_output_tokens).

Its items are a response's input and output items (messages, function calls and their outputs,
reasoning), each with an id. A conversation is one record (its "conv_" id) of a ResponseStore of
its own: responses, however many, never evict one; past --conversations-store-size or its byte
budget the least recently used conversation goes. With --workers the store is a directory every
process shares, and a conversation is changed in place under the store's lock, so two workers
adding to one conversation lose nothing.
"""

from __future__ import annotations

import time
from typing import Any, Callable, Mapping, Optional

from openai_frontend.errors import APIError, bad_request, unsupported
from openai_frontend.response_items import input_items, item_id, list_items, new_id, output_messages
from openai_frontend.response_store import ResponseStore

_ITEMS_QUERY = ("after", "limit", "order")


def not_found(conversation_id: str, param: str = "conversation_id") -> APIError:
    return APIError(404, f"Conversation with id '{conversation_id}' not found", param=param,
                    code="conversation_not_found")


def _new_items(items: list[dict[str, Any]], existing: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """`items` as stored: checked as a response's input is (a 400 naming items[i]), each with an id
    of its own (a given one kept unless the conversation has it already)."""
    output_messages(items, "items")
    taken = {item["id"] for item in existing}
    out = []
    for item in input_items(items):
        if not isinstance(item["id"], str) or item["id"] in taken:
            item["id"] = item_id(item["type"])
        taken.add(item["id"])
        out.append(item)
    return out


class Conversations:
    def __init__(self, store: ResponseStore) -> None:
        self.store = store

    # -- the routes ---------------------------------------------------------------------------

    def create(self, items: Optional[list[dict[str, Any]]], metadata: Optional[dict[str, str]]) -> dict[str, Any]:
        if self.store.capacity <= 0:
            raise bad_request("This server keeps no conversations (--conversations-store-size 0)")
        conversation = {"id": new_id("conv"), "object": "conversation", "created_at": int(time.time()),
                        "metadata": metadata or {}}
        self.store.put(conversation["id"], {"conversation": conversation, "items": _new_items(items or [], [])})
        return conversation

    def retrieve(self, conversation_id: str) -> dict[str, Any]:
        return self._record(conversation_id)["conversation"]

    def update(self, conversation_id: str, metadata: dict[str, str]) -> dict[str, Any]:
        def change(record: dict[str, Any]) -> dict[str, Any]:
            record["conversation"]["metadata"] = metadata
            return record["conversation"]

        return self._update(conversation_id, change)

    def delete(self, conversation_id: str) -> dict[str, Any]:
        self._record(conversation_id)
        self.store.delete(conversation_id)
        return {"id": conversation_id, "object": "conversation.deleted", "deleted": True}

    def add_items(self, conversation_id: str, items: list[dict[str, Any]], query: Mapping[str, str]) -> dict[str, Any]:
        _no_include(query, ())

        def change(record: dict[str, Any]) -> list[dict[str, Any]]:
            added = _new_items(items, record["items"])
            record["items"].extend(added)
            return added

        added = self._update(conversation_id, change)
        return {"object": "list", "data": added, "first_id": added[0]["id"], "last_id": added[-1]["id"],
                "has_more": False}

    def list_items(self, conversation_id: str, query: Mapping[str, str]) -> dict[str, Any]:
        _no_include(query, _ITEMS_QUERY)
        return list_items(self._record(conversation_id)["items"], query, "conversation")

    def item(self, conversation_id: str, item_id: str, query: Mapping[str, str]) -> dict[str, Any]:
        _no_include(query, ())
        for item in self._record(conversation_id)["items"]:
            if item["id"] == item_id:
                return item
        raise _item_not_found(item_id)

    def delete_item(self, conversation_id: str, item_id: str) -> dict[str, Any]:
        def change(record: dict[str, Any]) -> Optional[dict[str, Any]]:
            kept = [item for item in record["items"] if item["id"] != item_id]
            if len(kept) == len(record["items"]):
                return None
            record["items"] = kept
            return record["conversation"]

        conversation = self._update(conversation_id, change)
        if conversation is None:
            raise _item_not_found(item_id)
        return conversation

    # -- for the Responses API ----------------------------------------------------------------

    def history(self, conversation_id: str) -> list[dict[str, Any]]:
        """The conversation's items as the chat messages a response's prompt starts with."""
        return output_messages(self._record(conversation_id, "conversation")["items"], "conversation.items")

    def append(self, conversation_id: str, items: list[dict[str, Any]]) -> None:
        """A finished response's input and output items, at the conversation's end (gone meanwhile:
        nothing to add to)."""
        self.store.update(conversation_id, lambda record: record["items"].extend(items))

    # -----------------------------------------------------------------------------------------

    def _record(self, conversation_id: str, param: str = "conversation_id") -> dict[str, Any]:
        record = self.store.get(conversation_id) if conversation_id.startswith("conv_") else None
        if record is None or "conversation" not in record:
            raise not_found(conversation_id, param)
        return record

    def _update(self, conversation_id: str, change: Callable[[dict[str, Any]], Any]) -> Any:
        """`change`'s result on the conversation's record, changed in one step; a 404 when there is
        no such conversation (or it went meanwhile)."""
        found = False

        def guarded(record: dict[str, Any]) -> Any:
            nonlocal found
            found = "conversation" in record
            return change(record) if found else None

        result = self.store.update(conversation_id, guarded) if conversation_id.startswith("conv_") else None
        if not found:
            raise not_found(conversation_id)
        return result


def _item_not_found(item_id: str) -> APIError:
    return APIError(404, f"Item with id '{item_id}' not found in this conversation", param="item_id",
                    code="item_not_found")


def _no_include(query: Mapping[str, str], known: tuple[str, ...]) -> None:
    for key in query:
        if key.startswith("include"):
            raise unsupported(key, "items come back whole; there is nothing more to include")
        if key not in known:
            raise bad_request(f"Unknown query parameter '{key}'", param=key)
