"""Request and response models: OpenAI chat / completions / models / errors, SGLang /generate.

Requests are validated with pydantic (once per request). Every model forbids unknown fields, so
a misspelled or unknown parameter is a 400 naming it, as OpenAI does, never silently ignored.
Parameters that are known (OpenAI, vLLM extras, SGLang extras) but not implemented are declared
here and refused in sampling.py with a message that names them.

Responses on the hot path (stream chunks, non-streaming bodies) are built as plain dicts / JSON
strings by the handlers; the response models below document their shape and serve /v1/models.
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal, Optional, Union

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, field_validator, model_validator


# Token ids travel to Triton as INT32: anything outside [0, 2**31) would wrap into another, valid
# token (2**32 + 5 became 5) or fail deep in numpy, so it is refused here as a 400.
TokenId = Annotated[int, Field(ge=0, lt=2**31)]


def _null_is(default: Any) -> BeforeValidator:
    """OpenAI marks these fields nullable: null means the default, as in vLLM."""
    return BeforeValidator(lambda v: default if v is None else v)


NullableInt1 = Annotated[int, _null_is(1)]
NullableFalse = Annotated[bool, _null_is(False)]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", protected_namespaces=(), strict=True)


class _Open(BaseModel):
    model_config = ConfigDict(extra="allow", protected_namespaces=())


_SURROGATE = re.compile("[\ud800-\udfff]")


def lone_surrogate_at(value: Any) -> Optional[str]:
    """The path of the first string (or key) in a parsed JSON body that holds a lone UTF-16
    surrogate, else None. JSON's escapes allow one ("\\ud800" alone; a proper pair decodes to
    one character), and such text has no UTF-8 form: the tokenizer, the gRPC message and the
    logs would each fail on it deep inside, as a 500."""
    stack: list[tuple[str, Any]] = [("", value)]
    while stack:
        path, v = stack.pop()
        if isinstance(v, str):
            if not v.isascii() and _SURROGATE.search(v):
                return path or "the body"
        elif isinstance(v, dict):
            for k, item in v.items():
                key = str(k)
                if not key.isascii() and _SURROGATE.search(key):
                    return f"{path}.{key!r}" if path else repr(key)
                stack.append((f"{path}.{key}" if path else key, item))
        elif isinstance(v, list):
            stack.extend((f"{path}[{i}]", item) for i, item in enumerate(v))
    return None


class _Body(_Strict):
    """A whole request body: refused as a 400 if any of its text is not valid Unicode. Its own
    float fields refuse NaN and infinities (JSON has neither; Python's parser takes both)."""

    model_config = ConfigDict(extra="forbid", protected_namespaces=(), allow_inf_nan=False, strict=True)

    @model_validator(mode="before")
    @classmethod
    def _valid_unicode(cls, data: Any) -> Any:
        at = lone_surrogate_at(data)
        if at is not None:
            raise ValueError(f"invalid Unicode at {at}: a lone UTF-16 surrogate (an unpaired \\ud800-\\udfff "
                             "escape) has no UTF-8 form")
        return data


# ---------------------------------------------------------------------------------------------
# Shared pieces
# ---------------------------------------------------------------------------------------------


class StreamOptions(_Strict):
    include_usage: Optional[bool] = False
    continuous_usage_stats: Optional[bool] = False  # vLLM: usage on every chunk
    # OpenAI pads stream events with random "obfuscation" text; this server sends none, so only
    # false (or unset) is accepted (sampling.py).
    include_obfuscation: Optional[bool] = None


class StructuredOutputs(_Strict):
    """vLLM's `structured_outputs` (0.11 on; its guided_* fields' successor): one constraint and
    the JSON options. sampling.py maps it onto the same engine keys as guided_*."""

    json_: Optional[Union[str, dict[str, Any]]] = Field(None, alias="json")
    regex: Optional[str] = None
    choice: Optional[list[str]] = None
    grammar: Optional[str] = None
    json_object: Optional[bool] = None
    structural_tag: Optional[Union[str, dict[str, Any]]] = None
    whitespace_pattern: Optional[str] = None
    # vLLM's meaning: no whitespace in the JSON document (whitespace_pattern "").
    disable_any_whitespace: bool = False
    # vLLM reads it on its guidance backend only: a schema's objects get only their declared
    # properties unless they say additionalProperties. xgrammar, vLLM's default backend and the
    # engine's, compiles every schema so (strict mode) whatever the value, as vLLM does.
    disable_additional_properties: bool = False
    # vLLM 0.11's: do not fall back to another backend when this one fails. There is no other
    # backend here; a grammar that fails is the request's error either way.
    disable_fallback: bool = False


class FunctionDefinition(_Strict):
    # A call to a nameless function could not be told from text: the parsers need a name.
    name: str = Field(min_length=1)
    description: Optional[str] = None
    parameters: Optional[dict[str, Any]] = None
    strict: Optional[bool] = None

    @field_validator("parameters")
    @classmethod
    def _object_schema(cls, v: Optional[dict[str, Any]]) -> Optional[dict[str, Any]]:
        # A call's arguments are a JSON object (OpenAI refuses other schemas): the parsers read
        # nothing else as arguments, so a forced call under another schema would come back as text.
        if v is not None and "type" in v and v["type"] != "object":
            raise ValueError(f"a function's parameters must be a JSON Schema of type 'object', got type {v['type']!r}")
        return v


class ChatTool(_Strict):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class NamedFunction(_Strict):
    name: str


class NamedToolChoice(_Strict):
    type: Literal["function"] = "function"
    function: NamedFunction


ToolChoice = Union[Literal["none", "auto", "required"], NamedToolChoice]


def _is_tool_call(call: Any) -> bool:
    """OpenAI's shape of an assistant's tool call, all of it required as OpenAI requires it (the
    id ties the tool message's result to it; templates render the name and arguments)."""
    if not isinstance(call, dict) or call.get("type", "function") != "function":
        return False
    fn = call.get("function")
    return (isinstance(call.get("id"), str) and bool(call["id"]) and isinstance(fn, dict)
            and isinstance(fn.get("name"), str) and bool(fn["name"]) and isinstance(fn.get("arguments"), (str, dict)))


class ChatMessage(_Open):
    """An OpenAI chat message; role-specific fields (tool_calls, tool_call_id, name, ...) pass
    through to the chat template unchanged."""

    role: str
    content: Optional[Union[str, list[dict[str, Any]]]] = None
    # A participant's name (OpenAI's, a string); the chat template renders it where it reads it
    # (Qwen2.5's and Llama's do not, as in vLLM), so its type is all that is checked here.
    name: Optional[str] = None

    @field_validator("role")
    @classmethod
    def _known_role(cls, v: str) -> str:
        if v == "function":
            # OpenAI's deprecated role (with `functions`, refused too): chat templates render only
            # `tool` messages, so its content would be dropped from the prompt unseen.
            raise ValueError("the deprecated 'function' role is not supported: send a function's result "
                             "as a 'tool' message with its tool_call_id")
        if v not in ("system", "developer", "user", "assistant", "tool"):
            raise ValueError(f"unknown message role '{v}'")
        return v

    @model_validator(mode="after")
    def _content_where_required(self) -> "ChatMessage":
        # OpenAI: only an assistant message (its tool calls say what it did) may leave it out.
        if self.content is None and self.role in ("system", "developer", "user", "tool"):
            raise ValueError(f"a '{self.role}' message needs 'content'")
        if self.role == "assistant" and (self.model_extra or {}).get("tool_calls") is not None:
            calls = self.model_extra["tool_calls"]
            if not isinstance(calls, list) or not all(map(_is_tool_call, calls)):
                raise ValueError('an \'assistant\' message\'s tool_calls must be a list of {"id": string, "type": '
                                 '"function", "function": {"name": string, "arguments": JSON text}} objects')
        if self.role == "tool":
            # OpenAI requires it: it ties the result to its call, which templates that render
            # several results of one turn need (and a client that forgot it has a bug to hear about).
            call_id = (self.model_extra or {}).get("tool_call_id")
            if not isinstance(call_id, str) or not call_id:
                raise ValueError("a 'tool' message needs 'tool_call_id' (a string): the id of the assistant's "
                                 "tool call it answers")
        return self


StopType = Optional[Union[str, list[str]]]


class _SamplingFields(_Body):
    """Sampling parameters common to chat and completions (OpenAI + vLLM + SGLang extras)."""

    model: Optional[str] = None
    frequency_penalty: Optional[float] = None
    presence_penalty: Optional[float] = None
    logit_bias: Optional[dict[str, float]] = None
    max_tokens: Optional[int] = None
    n: NullableInt1 = 1
    seed: Optional[int] = None
    stop: StopType = None
    stream: NullableFalse = False
    stream_options: Optional[StreamOptions] = None
    temperature: Optional[float] = None
    top_p: Optional[float] = None
    user: Optional[str] = None  # end-user id: metadata, does not change generation
    response_format: Optional[dict[str, Any]] = None

    # vLLM extra sampling parameters
    best_of: Optional[int] = None
    use_beam_search: bool = False
    top_k: Optional[int] = None
    min_p: Optional[float] = None
    repetition_penalty: Optional[float] = None
    length_penalty: float = 1.0
    stop_token_ids: Optional[list[TokenId]] = None
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    min_tokens: int = 0
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    truncate_prompt_tokens: Optional[int] = None
    allowed_token_ids: Optional[list[TokenId]] = None
    bad_words: Optional[list[str]] = None
    prompt_logprobs: Optional[int] = None
    # vLLM extra parameters
    guided_json: Optional[Union[str, dict[str, Any]]] = None
    guided_regex: Optional[str] = None
    guided_choice: Optional[list[str]] = None
    guided_grammar: Optional[str] = None
    structural_tag: Optional[Union[str, dict[str, Any]]] = None
    guided_decoding_backend: Optional[str] = None
    guided_whitespace_pattern: Optional[str] = None
    priority: int = 0
    request_id: Optional[str] = None
    logits_processors: Optional[list[Any]] = None
    return_tokens_as_token_ids: Optional[bool] = None
    # vLLM's: requests share prefix-cache blocks only with requests under the same salt
    cache_salt: Optional[str] = None
    structured_outputs: Optional[StructuredOutputs] = None
    # vLLM's: the prompt's and each choice's token ids beside the text (prompt_token_ids and
    # token_ids; streamed, the prompt's on the first chunk and each chunk's own ids)
    return_token_ids: Optional[bool] = None
    # SGLang extra parameters
    stop_regex: Optional[Union[str, list[str]]] = None
    regex: Optional[str] = None
    ebnf: Optional[str] = None
    json_schema: Optional[Union[str, dict[str, Any]]] = None
    no_stop_trim: bool = False
    rid: Optional[str] = None
    lora_path: Optional[str] = None
    custom_logit_processor: Optional[str] = None
    custom_params: Optional[Any] = None
    return_hidden_states: bool = False

    @field_validator("n")
    @classmethod
    def _n_positive(cls, v: int) -> int:
        if v < 1:
            raise ValueError("n must be at least 1")
        return v

    @model_validator(mode="after")
    def _no_stop_trim_is_include_stop_str_in_output(self) -> "_SamplingFields":
        # SGLang's and vLLM's names for one flag: whatever reads vLLM's (beam search does)
        # must see SGLang's too, or no_stop_trim would be silently ignored there.
        if self.no_stop_trim:
            self.include_stop_str_in_output = True
        return self


# ---------------------------------------------------------------------------------------------
# Chat completions
# ---------------------------------------------------------------------------------------------


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage]
    max_completion_tokens: Optional[int] = None
    logprobs: NullableFalse = False
    top_logprobs: Optional[int] = None
    tools: Optional[list[ChatTool]] = None
    tool_choice: Optional[ToolChoice] = None
    parallel_tool_calls: Optional[bool] = None
    metadata: Optional[dict[str, str]] = None  # tags for stored completions: accepted, no effect on generation
    safety_identifier: Optional[str] = None  # end-user id (OpenAI's successor of `user`): no effect on generation
    prompt_cache_key: Optional[str] = None  # a cache-routing hint: prefix caching here is automatic
    prompt_cache_retention: Optional[str] = None  # "in_memory" (this server's cache) only

    @field_validator("metadata")
    @classmethod
    def _metadata_limits(cls, v: Optional[dict[str, str]]) -> Optional[dict[str, str]]:
        # OpenAI's: at most 16 pairs, keys of at most 64 characters, values of at most 512.
        if v is not None:
            if len(v) > 16:
                raise ValueError(f"metadata may hold at most 16 key-value pairs, got {len(v)}")
            for key, value in v.items():
                if len(key) > 64 or len(value) > 512:
                    raise ValueError(f"metadata keys are at most 64 characters and values at most 512 "
                                     f"(key {key[:70]!r})")
        return v

    # vLLM chat extras
    echo: bool = False
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False
    documents: Optional[list[dict[str, str]]] = None
    chat_template: Optional[str] = None
    chat_template_kwargs: Optional[dict[str, Any]] = None
    mm_processor_kwargs: Optional[dict[str, Any]] = None
    # Reasoning (with the server's --reasoning-parser): SGLang's separate_reasoning (false: the
    # markers stay in content) and stream_reasoning (false: the reasoning comes in one delta when
    # it ends), vLLM's include_reasoning (false: no reasoning_content at all).
    separate_reasoning: bool = True
    stream_reasoning: bool = True
    include_reasoning: bool = True
    # vLLM's: at most this many tokens of reasoning, then its closing marker is forced.
    thinking_token_budget: Optional[int] = Field(None, ge=0)
    # OpenAI's Predicted Outputs: {"type": "content", "content": text or text parts} (sampling.py)
    prediction: Optional[Any] = None
    # OpenAI's: a chat template variable, as vLLM passes it (refused by a template that does not read it)
    reasoning_effort: Optional[str] = None

    # OpenAI fields this server does not implement (refused when set; see sampling.py)
    functions: Optional[list[Any]] = None
    function_call: Optional[Any] = None
    audio: Optional[Any] = None
    modalities: Optional[list[str]] = None
    service_tier: Optional[str] = None
    store: Optional[bool] = None
    web_search_options: Optional[Any] = None
    verbosity: Optional[str] = None


# ---------------------------------------------------------------------------------------------
# Completions
# ---------------------------------------------------------------------------------------------

PromptType = Union[str, list[str], list[TokenId], list[list[TokenId]]]


class CompletionRequest(_SamplingFields):
    prompt: PromptType
    max_tokens: Optional[int] = 16
    echo: NullableFalse = False
    logprobs: Optional[int] = None
    suffix: Optional[str] = None
    add_special_tokens: bool = True


# ---------------------------------------------------------------------------------------------
# SGLang /generate
# ---------------------------------------------------------------------------------------------


class GenerateRequest(_Body):
    text: Optional[Union[str, list[str]]] = None
    input_ids: Optional[Union[list[TokenId], list[list[TokenId]]]] = None
    sampling_params: Optional[Union[dict[str, Any], list[dict[str, Any]]]] = None
    rid: Optional[Union[str, list[str]]] = None
    return_logprob: Optional[Union[bool, list[bool]]] = None
    logprob_start_len: Optional[Union[int, list[int]]] = None
    top_logprobs_num: Optional[Union[int, list[int]]] = None
    token_ids_logprob: Optional[Union[list[TokenId], list[list[TokenId]]]] = None
    return_text_in_logprobs: NullableFalse = False
    return_hidden_states: Optional[Union[bool, list[bool]]] = False
    stream: NullableFalse = False  # SGLang's dataclass takes null as its default
    lora_path: Optional[Any] = None
    custom_logit_processor: Optional[Any] = None
    # The prompt as embeddings: [num_tokens][hidden_size], or a batch of those.
    input_embeds: Optional[Union[list[list[float]], list[list[list[float]]]]] = None
    # known, not implemented: refused when set
    image_data: Optional[Any] = None
    audio_data: Optional[Any] = None
    video_data: Optional[Any] = None
    return_routed_experts: bool = False
    routed_experts_start_len: int = 0
    # SGLang's top-level priority (its order: higher first, by default): refused with a pointer
    # to the sampling parameter, which has vLLM's order (lower first).
    priority: Optional[int] = None


# ---------------------------------------------------------------------------------------------
# vLLM's tokenizer API: /tokenize, /detokenize
# ---------------------------------------------------------------------------------------------


class TokenizeRequest(_Body):
    """vLLM's TokenizeCompletionRequest (`prompt`) or TokenizeChatRequest (`messages`)."""

    model: Optional[str] = None
    prompt: Optional[str] = None
    messages: Optional[list[ChatMessage]] = None
    add_special_tokens: Optional[bool] = None  # vLLM: True for a prompt, False for messages
    return_token_strs: bool = False
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    tools: Optional[list[ChatTool]] = None
    chat_template_kwargs: Optional[dict[str, Any]] = None
    chat_template: Optional[str] = None  # only on a server that trusts request templates
    # known, not implemented: refused when set
    mm_processor_kwargs: Optional[dict[str, Any]] = None


class DetokenizeRequest(_Body):
    model: Optional[str] = None
    tokens: list[TokenId]


# ---------------------------------------------------------------------------------------------
# /parse_function_call (SGLang)
# ---------------------------------------------------------------------------------------------


class ParseFunctionCallRequest(_Body):
    text: str
    tool_call_parser: Optional[str] = None
    tools: list[ChatTool] = Field(default_factory=list)


class LoadLoraAdapterRequest(_Body):
    """SGLang's /load_lora_adapter and vLLM's /v1/load_lora_adapter."""

    lora_name: str = Field(min_length=1)
    lora_path: str = Field(min_length=1)


class UnloadLoraAdapterRequest(_Body):
    lora_name: str = Field(min_length=1)


class AbortRequest(_Body):
    """SGLang's POST /abort_request."""

    rid: str = ""
    abort_all: bool = False


class SeparateReasoningRequest(_Body):
    """SGLang's POST /separate_reasoning."""

    text: str
    reasoning_parser: Optional[str] = None


# ---------------------------------------------------------------------------------------------
# OpenAI's Responses API: POST /v1/responses (openai_frontend/responses.py)
# ---------------------------------------------------------------------------------------------


class ResponsesStreamOptions(_Strict):
    # OpenAI pads stream events with random "obfuscation" text; this server sends none, so only
    # false (or unset) is accepted, as on the chat route.
    include_obfuscation: Optional[bool] = None


class ResponsesTextFormat(_Strict):
    model_config = ConfigDict(extra="forbid", protected_namespaces=(), strict=True, populate_by_name=True)

    type: Literal["text", "json_object", "json_schema"]
    name: Optional[str] = None
    json_schema: Optional[dict[str, Any]] = Field(None, alias="schema")
    strict: Optional[bool] = None
    description: Optional[str] = None


class ResponsesText(_Strict):
    format: Optional[ResponsesTextFormat] = None
    verbosity: Optional[str] = None  # refused when set (responses.py)


class ResponsesReasoning(_Strict):
    effort: Optional[str] = None
    summary: Optional[str] = None  # refused when set (responses.py)
    generate_summary: Optional[str] = None  # the older name of summary, refused alike


class ResponsesRequest(_Body):
    """A Responses request. Input items, tools, `text` and `reasoning` are checked where they are
    turned into a chat request (responses.py), each refusal naming its place in the body."""

    model: Optional[str] = None
    input: Optional[Union[str, list[dict[str, Any]]]] = None
    instructions: Optional[str] = None
    previous_response_id: Optional[str] = None
    max_output_tokens: Optional[int] = Field(None, ge=1)
    temperature: Optional[float] = None
    top_p: Optional[float] = None
    top_logprobs: Optional[int] = Field(None, ge=0, le=20)
    include: Optional[list[str]] = None
    tools: Optional[list[dict[str, Any]]] = None
    tool_choice: Optional[Union[str, dict[str, Any]]] = None
    parallel_tool_calls: Optional[bool] = None
    max_tool_calls: Optional[int] = Field(None, ge=1)  # caps built-in tool calls: this server has none
    text: Optional[ResponsesText] = None
    reasoning: Optional[ResponsesReasoning] = None
    stream: NullableFalse = False
    stream_options: Optional[ResponsesStreamOptions] = None
    store: Optional[bool] = None  # None: true, as OpenAI's default
    metadata: Optional[dict[str, str]] = None
    truncation: Optional[Literal["auto", "disabled"]] = None
    user: Optional[str] = None
    safety_identifier: Optional[str] = None
    prompt_cache_key: Optional[str] = None
    prompt_cache_retention: Optional[str] = None
    service_tier: Optional[str] = None
    request_id: Optional[str] = None  # vLLM's: names the request (an X-Request-Id header wins)

    # OpenAI fields this server does not implement (refused when set, naming them)
    background: Optional[bool] = None
    conversation: Optional[Any] = None
    prompt: Optional[Any] = None
    context_management: Optional[Any] = None
    access_programs: Optional[Any] = None
    background_options: Optional[Any] = None
    image: Optional[Any] = None
    moderation: Optional[Any] = None
    prompt_cache_options: Optional[Any] = None

    @field_validator("metadata")
    @classmethod
    def _metadata_limits(cls, v: Optional[dict[str, str]]) -> Optional[dict[str, str]]:
        return ChatCompletionRequest._metadata_limits(v)


class ResponsesInputTokensRequest(_Body):
    """POST /v1/responses/input_tokens: the prompt-making part of a Responses request, counted."""

    model: Optional[str] = None
    input: Optional[Union[str, list[dict[str, Any]]]] = None
    instructions: Optional[str] = None
    previous_response_id: Optional[str] = None
    conversation: Optional[Any] = None
    tools: Optional[list[dict[str, Any]]] = None
    tool_choice: Optional[Union[str, dict[str, Any]]] = None
    parallel_tool_calls: Optional[bool] = None
    text: Optional[ResponsesText] = None
    reasoning: Optional[ResponsesReasoning] = None
    truncation: Optional[Literal["auto", "disabled"]] = None
    personality: Optional[str] = None  # refused when set (responses.py)


class EmbeddingRequest(_Body):
    """POST /v1/embeddings (OpenAI's): `input` is a text, texts, token ids or lists of them."""

    model: Optional[str] = None
    input: Union[str, list[str], list[int], list[list[int]]]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: Optional[int] = None
    user: Optional[str] = None


class ConversationCreateRequest(_Body):
    """POST /v1/conversations: its first items (as a response's input items), and metadata."""

    items: Optional[list[dict[str, Any]]] = Field(None, max_length=20)
    metadata: Optional[dict[str, str]] = None

    @field_validator("metadata")
    @classmethod
    def _metadata_limits(cls, v: Optional[dict[str, str]]) -> Optional[dict[str, str]]:
        return ChatCompletionRequest._metadata_limits(v)


class ConversationUpdateRequest(_Body):
    """POST /v1/conversations/{id}: its metadata, replaced."""

    metadata: dict[str, str]

    @field_validator("metadata")
    @classmethod
    def _metadata_limits(cls, v: dict[str, str]) -> dict[str, str]:
        return ChatCompletionRequest._metadata_limits(v)


class ConversationItemsRequest(_Body):
    """POST /v1/conversations/{id}/items: items to add at its end."""

    items: list[dict[str, Any]] = Field(..., min_length=1, max_length=20)


# ---------------------------------------------------------------------------------------------
# Responses (shapes; the handlers build them as dicts)
# ---------------------------------------------------------------------------------------------


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: Optional[str] = None
    code: Optional[str] = None


class ErrorResponse(BaseModel):
    error: ErrorInfo


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "triton-llm"
    root: Optional[str] = None
    parent: Optional[str] = None
    max_model_len: Optional[int] = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class UsageInfo(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0


class ToolCallFunction(BaseModel):
    name: str
    arguments: str


class ToolCall(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: ToolCallFunction


class ChatCompletionMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: Optional[str] = None
    tool_calls: Optional[list[ToolCall]] = None


class ChatCompletionChoice(BaseModel):
    index: int
    message: ChatCompletionMessage
    logprobs: Optional[dict[str, Any]] = None
    finish_reason: Optional[str] = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatCompletionChoice]
    usage: UsageInfo


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: Optional[dict[str, Any]] = None
    finish_reason: Optional[str] = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo


class GenerateResponse(BaseModel):
    text: str
    output_ids: list[int]
    meta_info: dict[str, Any]
