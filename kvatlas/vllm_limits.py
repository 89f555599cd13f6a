"""vLLM 0.33's refusals of a request's length on an engine of ``context`` tokens
(``--max-model-len``), worded as its ``VLLMValidationError`` handler sends them: the simulated
engine refuses by them, and the router refuses by them what every engine it could send the
request to would refuse (docs/router.md, docs/engine-sim.md).

vLLM refuses an output limit over the whole context (``TokenizeParams``) and a prompt over it
(its renderer's length check); a limit past what the prompt leaves is cut to it
(``get_max_tokens``), and a cut limit below 1 is refused (``SamplingParams``); then a prompt of
no tokens (its input processor).
"""

from __future__ import annotations

from kvatlas.errors import InvalidInput


def validation_error(message: str, param: str, value: int) -> InvalidInput:
    """vLLM's ``VLLMValidationError`` as its handler writes it (``str`` adds the extras)."""
    return InvalidInput(f"{message} (parameter={param}, value={value})", param=param)


def over_context(
    context: int, prompt_tokens: int, asked: int | None, name: str
) -> InvalidInput | None:
    """The refusal of an output limit ``asked`` (the request's field ``name``: ``max_tokens``
    or ``max_completion_tokens``) over the whole context, or of a prompt over it; ``None``
    when neither is."""
    if asked is not None and asked > context:
        return validation_error(f"{name}={asked} cannot be greater than max_model_len="
                                f"{context}. Please request fewer output tokens.", name, asked)  # fmt: skip
    if prompt_tokens > context:
        return validation_error(
            f"This model's maximum context length is {context} tokens. However, your prompt "
            f"contains {prompt_tokens} input tokens, which exceeds this limit even without any "
            "output tokens. Please reduce the length of the input prompt.",
            "input_tokens", prompt_tokens,
        )  # fmt: skip
    return None


def too_few_output_tokens(limit: int) -> InvalidInput:
    """The refusal of an output limit, once cut to the context the prompt leaves, below 1."""
    return validation_error(f"max_tokens must be at least 1, got {limit}.", "max_tokens", limit)


def empty_prompt() -> InvalidInput:
    """The refusal of a prompt of no tokens (its request models accept ``[]``): the input
    processor's ``_validate_prompt_len``, a ``VLLMValidationError`` without a parameter."""
    return InvalidInput("The decoder prompt cannot be empty")
