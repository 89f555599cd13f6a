"""vLLM 0.33's OpenAI request models, the part the simulated engine and the router read: the
same pydantic annotations (lax mode: ``"max_tokens": 5.0`` is 5, ``"stream": "true"`` is true)
and the same ``mode="before"`` checks, in vLLM's order, so a body is accepted, coerced and
refused field for field as vLLM's ``CompletionRequest`` and ``ChatCompletionRequest``
(``vllm/entrypoints/openai/{completion,chat_completion}/protocol.py``) do it.

Every field here carries vLLM's annotation (``tests/engine_sim/test_vllm_validation.py``
compares them); fields left out are accepted unread (``extra="allow"``, as vLLM's models are),
and so is a chat message's inner shape (vLLM's is a union of the ``openai`` package's types).
Loaded on first use (:mod:`kvatlas.vllm_requests`): pydantic stays out of a router's start.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

_INT64_MIN = -(2**63)
_INT64_MAX = 2**63 - 1
MAX_COMPLETION_PROMPTS = 1024
"""vLLM's ``VLLM_MAX_COMPLETION_PROMPTS`` default; a longer batch of prompts is refused."""
_MAX_CACHE_SALT_LENGTH = 128
_CACHE_SALT_FORBIDDEN_CHARS = frozenset("@/\\\0")

StopParam = str | Annotated[list[str], Field(max_length=4)] | None  # VLLM_MAX_STOP_STRINGS
TokenId = Annotated[int, Field(ge=0)]
ReasoningEffort = Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"]


class ValidatorRefusal(Exception):
    """vLLM's ``VLLMValidationError`` raised in a ``mode="before"`` check: not a
    ``ValueError``, so pydantic lets it through, and vLLM's handler answers it (400
    ``BadRequestError``, ``param``, the message with its extras)."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.message, self.param = message, param


def _check_cache_salt(data: Any) -> Any:
    """vLLM's ``validate_cache_salt``, run on the raw body before field validation."""
    if not isinstance(data, dict) or (salt := data.get("cache_salt")) is None:
        return data
    if not isinstance(salt, str) or not salt:
        raise ValidatorRefusal(
            "Parameter 'cache_salt' must be a non-empty string if provided.", "cache_salt"
        )
    if len(salt) > _MAX_CACHE_SALT_LENGTH or any(c in _CACHE_SALT_FORBIDDEN_CHARS for c in salt):
        raise ValidatorRefusal(
            "Parameter 'cache_salt' must be at most 128 characters and must "
            "not contain '@', '/', '\\\\', or NUL.",
            "cache_salt",
        )
    return data


def _check_stream_options(data: Any) -> Any:
    if isinstance(data, dict) and data.get("stream_options") and not data.get("stream"):
        raise ValidatorRefusal(
            "Stream options can only be defined when `stream=True`.", "stream_options"
        )
    return data


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="allow")

    include_usage: bool | None = False
    continuous_usage_stats: bool | None = False


class CompletionRequest(BaseModel):
    """vLLM's fields in vLLM's order (an error list, and the ``param`` of its first error,
    follow the order of the fields)."""

    model_config = ConfigDict(extra="allow")

    model: str | None = None
    prompt: list[TokenId] | list[list[TokenId]] | str | list[str] | None = None
    echo: bool | None = False
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    max_tokens: int | None = 16
    n: int = 1
    presence_penalty: float | None = None
    seed: int | None = Field(None, ge=_INT64_MIN, le=_INT64_MAX)
    stop: StopParam = []
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    suffix: str | None = None
    temperature: float | None = None
    top_p: float | None = None
    user: str | None = None
    use_beam_search: bool = False
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    watermarking: bool | None = None
    length_penalty: float = 1.0
    stop_token_ids: list[int] | None = []
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    min_tokens: int = 0
    skip_special_tokens: bool | None = None
    spaces_between_special_tokens: bool = True
    truncate_prompt_tokens: Annotated[int, Field(ge=-1, le=_INT64_MAX)] | None = None
    truncation_side: Literal["left", "right"] | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] = Field(default_factory=list)
    add_special_tokens: bool = True
    priority: int = Field(default=0, ge=_INT64_MIN, le=_INT64_MAX)
    request_id: str = ""
    """vLLM's default is a random id; ``""`` here, told from a given one by
    :func:`given_request_id`."""
    session_id: str | None = None
    return_tokens_as_token_ids: bool | None = None
    return_token_ids: bool | None = None
    return_weight_versions: bool = False
    routed_experts_prompt_start: int = Field(default=0, ge=0)
    return_token_offsets: bool | None = False
    mm_payload: Literal["tensors", "none"] = "tensors"
    cache_salt: str | None = Field(default=None, min_length=1, max_length=1024)
    kv_transfer_params: dict[str, Any] | None = None
    ec_transfer_params: dict[str, Any] | None = None
    vllm_xargs: dict[str, str | int | float | list[str | int | float]] | None = None
    stream_interval: Annotated[int, Field(ge=1)] | None = None

    # vLLM's checks of the raw body, in its order (the ones that refuse what is read here)
    @model_validator(mode="before")
    @classmethod
    def check_cache_salt_support(cls, data: Any) -> Any:
        return _check_cache_salt(data)

    @model_validator(mode="before")
    @classmethod
    def normalize_null_max_tokens(cls, data: Any) -> Any:
        if isinstance(data, dict) and data.get("max_tokens") is None:
            data = {**data, "max_tokens": 16}
        return data

    @model_validator(mode="before")
    @classmethod
    def validate_stream_options(cls, data: Any) -> Any:
        return _check_stream_options(data)

    @model_validator(mode="before")
    @classmethod
    def validate_prompt_and_prompt_embeds(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        prompt, embeds = data.get("prompt"), data.get("prompt_embeds")
        if (prompt is None or prompt == "") and (embeds is None or embeds == []):
            raise ValidatorRefusal(
                "Either prompt or prompt_embeds must be provided and non-empty.", "prompt"
            )
        return data

    @model_validator(mode="before")
    @classmethod
    def validate_prompt_list_length(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        prompt = data.get("prompt")
        if (
            isinstance(prompt, list)
            and prompt
            and not isinstance(prompt[0], int)  # vLLM's is_list_of: the first item
            and len(prompt) > MAX_COMPLETION_PROMPTS
        ):
            raise ValidatorRefusal(
                f"prompt list length {len(prompt)} exceeds the maximum allowed count of "
                f"{MAX_COMPLETION_PROMPTS}. To increase this limit, set the "
                "VLLM_MAX_COMPLETION_PROMPTS environment variable.",
                "prompt",
            )
        return data


class ChatRequest(BaseModel):
    model_config = ConfigDict(extra="allow")

    messages: list[Any]
    """Each message's shape is not checked here (vLLM's is a union of ``openai`` types)."""
    model: str | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    n: int | None = 1
    presence_penalty: float | None = None
    seed: int | None = Field(None, ge=_INT64_MIN, le=_INT64_MAX)
    stop: StopParam = []
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    temperature: float | None = None
    top_p: float | None = None
    reasoning_effort: ReasoningEffort | None = None
    include_reasoning: bool = True
    parallel_tool_calls: bool | None = True
    user: str | None = None
    use_beam_search: bool = False
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    watermarking: bool | None = None
    length_penalty: float = 1.0
    stop_token_ids: list[int] | None = []
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    min_tokens: int = 0
    skip_special_tokens: bool | None = None
    spaces_between_special_tokens: bool = True
    truncate_prompt_tokens: Annotated[int, Field(ge=-1, le=_INT64_MAX)] | None = None
    truncation_side: Literal["left", "right"] | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] = Field(default_factory=list)
    echo: bool = False
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False
    documents: list[dict[str, str]] | None = None
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    media_io_kwargs: dict[str, dict[str, Any]] | None = None
    mm_processor_kwargs: dict[str, Any] | None = None
    priority: int = Field(default=0, ge=_INT64_MIN, le=_INT64_MAX)
    request_id: str = ""
    session_id: str | None = None
    return_tokens_as_token_ids: bool | None = None
    return_token_ids: bool | None = None
    return_weight_versions: bool = False
    routed_experts_prompt_start: int = Field(default=0, ge=0)
    return_token_offsets: bool | None = False
    return_prompt_text: bool | None = None
    mm_payload: Literal["tensors", "none"] = "tensors"
    cache_salt: str | None = Field(default=None, min_length=1, max_length=1024)
    kv_transfer_params: dict[str, Any] | None = None
    ec_transfer_params: dict[str, Any] | None = None
    vllm_xargs: dict[str, str | int | float | list[str | int | float]] | None = None
    stream_interval: Annotated[int, Field(ge=1)] | None = None

    @model_validator(mode="before")
    @classmethod
    def check_cache_salt_support(cls, data: Any) -> Any:
        return _check_cache_salt(data)

    @model_validator(mode="before")
    @classmethod
    def validate_stream_options(cls, data: Any) -> Any:
        return _check_stream_options(data)

    @model_validator(mode="before")
    @classmethod
    def check_generation_prompt(cls, data: Any) -> Any:
        if (
            isinstance(data, dict)
            and data.get("continue_final_message")
            and data.get("add_generation_prompt")
        ):
            raise ValidatorRefusal(
                "Cannot set both `continue_final_message` and `add_generation_prompt` to True."
            )
        return data

    @model_validator(mode="before")
    @classmethod
    def check_system_message_content_type(cls, data: Any) -> Any:
        """vLLM's walks ``messages`` before they are validated: a value that is not iterable
        (``null``, a number) is its ``TypeError``, which its handler answers with a 400."""
        if isinstance(data, dict):
            for _ in data.get("messages", []):
                pass
        return data


def given_request_id(request: CompletionRequest | ChatRequest) -> str | None:
    """The body's ``request_id``, ``None`` when it has none (vLLM's default is a random id)."""
    return request.request_id if "request_id" in request.model_fields_set else None
