"""Loading a Hugging Face tokenizer and turning requests (text, chat messages, ids) into prompt ids.

Used by the preprocessing model, the engine and the OpenAI frontend, so all of them render chat
templates and tokenize exactly the same way.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Mapping, Optional, Sequence

# Keys apply_chat_template owns; letting chat_template_kwargs set them would change what the
# call returns (tokens, tensors, dicts) instead of what the template renders.
# Twice the frontend's default body limit: messages that pass it render below this.
MAX_RENDERED_CHARS = 16 * 1024 * 1024

_RESERVED_TEMPLATE_KWARGS = frozenset(
    {
        "conversation",
        "messages",
        "tools",
        "documents",
        "chat_template",
        "add_generation_prompt",
        "continue_final_message",
        "tokenize",
        "padding",
        "truncation",
        "max_length",
        "return_tensors",
        "return_dict",
        "return_assistant_tokens_mask",
        "tokenizer_kwargs",
    }
)


def load_tokenizer(model_path: str | Path) -> Any:
    """The model directory's tokenizer (AutoTokenizer, local files only, no remote code)."""
    from transformers import AutoTokenizer

    path = Path(model_path)
    if not path.is_dir():
        raise FileNotFoundError(
            f"model directory {path} does not exist (build the demo model with "
            f"`python -m backend.demo_model --out models/demo`, or set LLM_MODEL_PATH)"
        )
    if not any((path / name).exists() for name in _TOKENIZER_FILES):
        # transformers would say to install sentencepiece or tiktoken (QA): the files are missing.
        raise FileNotFoundError(f"no tokenizer in {path}: none of {', '.join(_TOKENIZER_FILES)} is there")
    return AutoTokenizer.from_pretrained(str(path), local_files_only=True, trust_remote_code=False)


# Any of these makes a tokenizer AutoTokenizer can load (fast, or sentencepiece, or BPE files).
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def _load_json(value: Any, what: str) -> Any:
    if isinstance(value, (bytes, bytearray)):
        value = value.decode("utf-8")
    if isinstance(value, str):
        try:
            return json.loads(value)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{what} is not valid JSON: {exc}") from None
    return value


def _content_text(content: Any, index: int, role: Any = None) -> str:
    """OpenAI message content (string, None or list of parts) as the string templates expect; an
    assistant's refusal parts are text, as vLLM reads them."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for part in content:
            if isinstance(part, str):
                texts.append(part)
            elif isinstance(part, Mapping) and part.get("type", "text") == "text" and isinstance(part.get("text"), str):
                texts.append(part["text"])
            elif (role == "assistant" and isinstance(part, Mapping) and part.get("type") == "refusal"
                  and isinstance(part.get("refusal"), str)):
                texts.append(part["refusal"])
            else:
                kind = part.get("type") if isinstance(part, Mapping) else type(part).__name__
                raise ValueError(f"messages[{index}].content: unsupported content part {kind!r} (only text)")
        # Same joining as vLLM's "string" content format.
        return "\n".join(texts)
    raise ValueError(f"messages[{index}].content must be a string, null or a list of text parts")


def _tool_calls(calls: Any, index: int) -> list[dict]:
    if not isinstance(calls, list):
        raise ValueError(f"messages[{index}].tool_calls must be a list")
    out = []
    for j, call in enumerate(calls):
        if not isinstance(call, Mapping):
            raise ValueError(f"messages[{index}].tool_calls[{j}] must be an object")
        call = dict(call)
        fn = call.get("function")
        if isinstance(fn, Mapping) and (fn.get("arguments") is None or isinstance(fn.get("arguments"), str)):
            # OpenAI sends arguments as a JSON string; templates (Qwen's `arguments | tojson`)
            # expect an object, or they would render a doubly-encoded string. As vLLM: none or ""
            # (a call without arguments) is {}, and text that is not JSON is refused.
            args = fn.get("arguments")
            try:
                call["function"] = {**fn, "arguments": json.loads(args) if args else {}}
            except json.JSONDecodeError as exc:
                raise ValueError(f"messages[{index}].tool_calls[{j}].function.arguments is not valid JSON: {exc}") from None
        out.append(call)
    return out


def normalize_messages(messages: Any) -> list[dict]:
    """Validate OpenAI chat messages (list or JSON string) and shape them for chat templates.

    Unknown roles and extra keys pass through: templates decide what they mean.
    """
    messages = _load_json(messages, "messages")
    if not isinstance(messages, list) or not messages:
        raise ValueError("messages must be a non-empty JSON list of message objects")
    out = []
    for i, msg in enumerate(messages):
        if not isinstance(msg, Mapping):
            raise ValueError(f"messages[{i}] must be an object with 'role' and 'content'")
        role = msg.get("role")
        if not isinstance(role, str) or not role:
            raise ValueError(f"messages[{i}].role must be a non-empty string")
        m = dict(msg)
        m["content"] = _content_text(msg.get("content"), i, msg.get("role"))
        if role == "assistant" and m.get("refusal") is not None:
            # OpenAI's assistant `refusal` is part of what the model said; templates never read
            # the key, so it joins the text as a refusal part does.
            if not isinstance(m["refusal"], str):
                raise ValueError(f"messages[{i}].refusal must be a string")
            m["content"] = "\n".join(t for t in (m["content"], m.pop("refusal")) if t)
        if role == "assistant":
            # vLLM since 0.11 returns an answer's thinking as `reasoning`, SGLang as
            # `reasoning_content`; a client sends back either, and templates read either.
            for have, alias in (("reasoning", "reasoning_content"), ("reasoning_content", "reasoning")):
                if m.get(have) is not None and m.get(alias) is None:
                    m[alias] = m[have]
        if role == "assistant" and m.get("audio") is not None:
            raise ValueError(f"messages[{i}].audio: audio replies are not supported (this server has no audio)")
        if m.get("tool_calls"):
            m["tool_calls"] = _tool_calls(m["tool_calls"], i)
        else:  # none or [] (some clients send it): the template's plain assistant path, as vLLM's
            m.pop("tool_calls", None)
        out.append(m)
    return out


def normalize_tools(tools: Any) -> Optional[list[dict]]:
    """OpenAI tool definitions (list or JSON string) or None; an empty list means no tools."""
    tools = _load_json(tools, "tools")
    if tools is None:
        return None
    if not isinstance(tools, list) or not all(isinstance(t, Mapping) for t in tools):
        raise ValueError("tools must be a JSON list of tool objects")
    return [dict(t) for t in tools] or None


def normalize_documents(documents: Any) -> Optional[list[dict]]:
    """RAG documents for the chat template (vLLM's `documents`: a list of string-valued
    objects, as a list or JSON string), or None."""
    documents = _load_json(documents, "documents")
    if documents is None:
        return None
    if not isinstance(documents, list) or not all(
        isinstance(d, Mapping) and all(isinstance(k, str) and isinstance(v, str) for k, v in d.items())
        for d in documents
    ):
        raise ValueError("documents must be a JSON list of objects with string values")
    return [dict(d) for d in documents]


def _uses(template: str, variable: str) -> bool:
    from jinja2 import Environment, TemplateSyntaxError, meta

    try:
        return variable in meta.find_undeclared_variables(Environment().parse(template))
    except TemplateSyntaxError:
        return True  # rendering reports the syntax error itself


def _template_kwargs(kwargs: Any) -> dict[str, Any]:
    kwargs = _load_json(kwargs, "chat_template_kwargs")
    if kwargs is None:
        return {}
    if not isinstance(kwargs, Mapping):
        raise ValueError("chat_template_kwargs must be a JSON object")
    bad = sorted(set(kwargs) & _RESERVED_TEMPLATE_KWARGS)
    if bad:
        raise ValueError(f"chat_template_kwargs may not set {', '.join(bad)}")
    return dict(kwargs)


def render_chat(
    tokenizer: Any,
    messages: Any,
    tools: Any = None,
    add_generation_prompt: bool = True,
    chat_template_kwargs: Any = None,
    chat_template: Optional[str] = None,
    continue_final_message: bool = False,
    documents: Any = None,
) -> str:
    """The prompt text for chat `messages` rendered with the model's (or the given) chat template.

    `messages`, `tools`, `chat_template_kwargs` and `documents` may be Python objects or JSON
    strings. Documents need a template that reads them: a template that never mentions
    `documents` would drop them silently, so that is an error.
    Raises ValueError for malformed input or a template error.
    """
    from jinja2 import TemplateError

    conversation = normalize_messages(messages)
    tool_list = normalize_tools(tools)
    extra = _template_kwargs(chat_template_kwargs)
    docs = normalize_documents(documents)
    if add_generation_prompt and continue_final_message:
        raise ValueError("add_generation_prompt and continue_final_message cannot both be true")
    if continue_final_message and conversation[-1]["role"] != "assistant":
        raise ValueError("continue_final_message needs a final assistant message")
    if chat_template is None and not getattr(tokenizer, "chat_template", None):
        raise ValueError("the model has no chat template; send a prompt instead of messages")
    developer = any(m.get("role") == "developer" for m in conversation)
    template = ""
    effort = "reasoning_effort" in extra
    if docs is not None or developer or effort:
        try:
            template = tokenizer.get_chat_template(chat_template, tool_list)
        except ValueError:
            pass
    if docs is not None and not _uses(template, "documents"):
        raise ValueError("documents: the chat template does not use documents (they would be dropped)")
    if effort and not _uses(template, "reasoning_effort"):
        # OpenAI's parameter reaches the model only through a template that reads it (gpt-oss's
        # does, as vLLM passes it); elsewhere it would change nothing, unannounced.
        raise ValueError("reasoning_effort: the chat template does not read reasoning_effort, so it would have "
                         "no effect on this model")
    if developer and "developer" not in template:
        # OpenAI's `developer` messages are its system instructions. A template that has never
        # heard of the role (Qwen2.5's, Llama's) skips such a message without a word, so it
        # renders as the system message it is; a template that names the role gets it as sent.
        conversation = [{**m, "role": "system"} if m.get("role") == "developer" else m for m in conversation]
    try:
        text = tokenizer.apply_chat_template(
            conversation,
            tools=tool_list,
            documents=docs,
            chat_template=chat_template,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message,
            tokenize=False,
            **extra,
        )
    except TemplateError as exc:  # includes raise_exception() calls inside templates
        raise ValueError(f"chat template error: {exc}") from None
    except (TypeError, KeyError, IndexError, AttributeError, ValueError, ArithmeticError) as exc:
        # A template computing on input it did not expect (iterating a missing `documents`,
        # indexing an empty list, the sandbox's "Range too big", 1/0): the request's input (or
        # its template), not a server fault.
        raise ValueError(f"chat template error: {type(exc).__name__}: {exc}") from None
    if not isinstance(text, str):  # pragma: no cover - tokenize=False always returns text
        raise TypeError(f"apply_chat_template returned {type(text).__name__}, expected str")
    if len(text) > MAX_RENDERED_CHARS:
        # Before tokenizing: a request's template (`{{ "x" * 100000000 }}`) kept preprocessing,
        # which every request goes through, busy for minutes (QA).
        raise ValueError(f"chat template error: the rendered prompt has {len(text)} characters, more than "
                         f"{MAX_RENDERED_CHARS} (a prompt that long fits no context)")
    return text


def _present(value: Any) -> bool:
    if value is None:
        return False
    if isinstance(value, (str, bytes, list, tuple)):
        return len(value) > 0
    size = getattr(value, "size", None)  # numpy arrays
    return bool(size) if size is not None else True


def refuse_chat_only(prompt: str, *, tools: Any, chat_template_kwargs: Any, documents: Any, chat_template: Any,
                     add_generation_prompt: Optional[bool], continue_final_message: bool) -> None:
    """What applies to messages only, given (away from its default) with another `prompt` kind
    (text_input, input_ids, input_embeds), is refused, not dropped."""
    chat_only = [name for name, unused in (
        ("tools", tools is None), ("chat_template_kwargs", chat_template_kwargs is None),
        ("documents", documents is None), ("chat_template", chat_template is None),
        ("add_generation_prompt", add_generation_prompt is None or add_generation_prompt),
        ("continue_final_message", not continue_final_message)) if not unused]
    if chat_only:
        raise ValueError(f"{', '.join(chat_only)} only apply to messages, not to {prompt}")


def encode_prompt(
    tokenizer: Any,
    *,
    text: Optional[str] = None,
    messages: Any = None,
    input_ids: Optional[Sequence[int]] = None,
    tools: Any = None,
    chat_template_kwargs: Any = None,
    add_generation_prompt: Optional[bool] = None,
    chat_template: Optional[str] = None,
    continue_final_message: bool = False,
    documents: Any = None,
    add_special_tokens: Optional[bool] = None,
) -> list[int]:
    """Prompt token ids from exactly one of `text`, chat `messages` or `input_ids`.

    Empty values count as absent. Raw text gets the tokenizer's own special tokens (a BOS for
    Llama-style models, nothing for Qwen); a rendered chat template already contains them.
    `add_special_tokens` overrides either default (vLLM's parameter of the same name).
    `tools`, `chat_template_kwargs`, `add_generation_prompt` (default true), `continue_final_message`,
    `documents` and `chat_template` only apply to `messages`: given away from their defaults with
    text or ids they are refused, not dropped. Ids are taken as given, whatever
    `add_special_tokens` says (vLLM ignores it for token prompts too).
    """
    sources = (("text_input", text), ("messages", messages), ("input_ids", input_ids))
    given = [name for name, v in sources if _present(v)]
    empty = [name for name, v in sources if v is not None and not _present(v)]
    if not given and empty:
        # Sent, but empty (vLLM: "prompt cannot be empty"); not "nothing sent".
        raise ValueError(f"the prompt is empty ({' and '.join(empty)} given empty)")
    if len(given) != 1:
        raise ValueError(
            "exactly one of text_input, messages, input_ids, input_embeds is required"
            + (f" (got {', '.join(given)})" if given else "")
        )
    if not _present(messages):
        refuse_chat_only(given[0], tools=tools, chat_template_kwargs=chat_template_kwargs, documents=documents,
                         chat_template=chat_template, add_generation_prompt=add_generation_prompt,
                         continue_final_message=continue_final_message)
    if _present(input_ids):
        ids = [int(i) for i in (input_ids.tolist() if hasattr(input_ids, "tolist") else input_ids)]
        limit = len(tokenizer)
        bad = [i for i in ids if i < 0 or i >= limit]
        if bad:
            raise ValueError(f"input_ids out of range [0, {limit}): {bad[:5]}")
        return ids
    if _present(messages):
        prompt = render_chat(
            tokenizer,
            messages,
            tools=tools,
            add_generation_prompt=add_generation_prompt is not False,
            chat_template_kwargs=chat_template_kwargs,
            chat_template=chat_template,
            continue_final_message=continue_final_message,
            documents=documents,
        )
        ids = tokenizer.encode(prompt, add_special_tokens=bool(add_special_tokens))
    else:
        if isinstance(text, (bytes, bytearray)):
            text = text.decode("utf-8")
        ids = tokenizer.encode(text, add_special_tokens=add_special_tokens is not False)
    if not ids:
        raise ValueError("the prompt is empty")
    return list(ids)


def bad_word_token_ids(tokenizer: Any, words: Sequence[str]) -> list[list[int]]:
    """vLLM's bad_words as token sequences: each word as it would start the text, and as it would
    follow a space (how a word mid-sentence tokenizes). vLLM keeps the second spelling only when
    it has as many tokens as the first, which on a byte-level BPE (Qwen's, Llama 3's) drops the
    common case: "boils" is two tokens and " boils" one, so " boils" stayed allowed. Here both
    are banned whenever they differ."""
    found: list[list[int]] = []
    for word in words:
        for text in (word.lstrip(), " " + word.lstrip()):
            ids = list(tokenizer.encode(text, add_special_tokens=False))
            if ids and ids not in found:
                found.append(ids)
    return found
