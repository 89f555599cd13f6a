"""A chat template rendered as vLLM renders it (Hugging Face's ``apply_chat_template``
semantics): the router's view of an engine's prompt and the simulated engine's own prompt are
rendered by this one code.

The Jinja template runs in a sandbox with ``trim_blocks`` and ``lstrip_blocks``,
``loopcontrols``, the ``tojson`` filter without HTML escaping, ``raise_exception`` and
``strftime_now``; its variables are ``messages``, ``tools``, ``documents``,
``add_generation_prompt``, the tokenizer's special tokens (``bos_token`` …) overridden by
``chat_template_kwargs``. ``continue_final_message`` leaves the final message open (without
what the template writes after it), and excludes ``add_generation_prompt``. A template that
raises, or a request it cannot render, is the caller's error (:class:`InvalidInput`, 400), as
on the engine.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.sandbox

from kvatlas.errors import InvalidInput

_CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "


def _tojson(
    x: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: Sequence[str] | None = None,
    sort_keys: bool = False,
) -> str:
    seps = tuple(separators) if separators is not None else None
    return json.dumps(
        x, ensure_ascii=ensure_ascii, indent=indent, separators=seps,  # type: ignore[arg-type]
        sort_keys=sort_keys,
    )  # fmt: skip


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


class _GenerationBlock(jinja2.ext.Extension):
    """``{% generation %}…{% endgeneration %}`` renders its body, as Hugging Face's
    ``AssistantTracker`` does when no assistant mask is asked for (training templates use it)."""

    tags = {"generation"}  # noqa: RUF012 (jinja2 declares it an instance attribute)

    def parse(self, parser: Any) -> Any:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(["name:endgeneration"], drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render", []), [], [], body).set_lineno(
            lineno
        )

    def _render(self, caller: Any) -> str:
        return str(caller())


def compile_chat_template(source: str) -> jinja2.Template:
    """The template in Hugging Face's environment (see the module docstring)."""
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationBlock, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env.from_string(source)


class ChatTemplate:
    """One compiled template and the special tokens it is rendered with (``ValueError`` if it
    does not compile)."""

    def __init__(self, source: str, special_tokens: Mapping[str, str] | None = None) -> None:
        self.source = source
        self.special_tokens = dict(special_tokens or {})
        try:
            self._template = compile_chat_template(source)
        except jinja2.TemplateError as exc:
            raise ValueError(f"chat template does not compile: {exc}") from None

    def render(
        self,
        messages: list[dict[str, Any]],
        *,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        tools: list[Any] | None = None,
        documents: list[Any] | None = None,
        template_kwargs: Mapping[str, Any] | None = None,
    ) -> str:
        """The chat as the template writes it (``InvalidInput`` when the template refuses)."""
        if continue_final_message and add_generation_prompt:
            raise InvalidInput(
                "continue_final_message and add_generation_prompt exclude each other"
            )
        chat = messages
        final = ""
        if continue_final_message:
            chat = [dict(m) for m in messages]
            content = chat[-1].get("content")
            if not isinstance(content, str):
                raise InvalidInput("continue_final_message needs a final message with text content")
            final = content
            chat[-1]["content"] = content + _CONTINUE_TAG
        variables = {**self.special_tokens, **(template_kwargs or {})}
        try:
            rendered: str = self._template.render(
                messages=chat, tools=tools, documents=documents,
                add_generation_prompt=add_generation_prompt, **variables,
            )  # fmt: skip
        except jinja2.TemplateError as exc:
            raise InvalidInput(f"chat template: {exc}") from None
        except (TypeError, ValueError, KeyError, AttributeError) as exc:
            raise InvalidInput(f"chat template cannot render these messages: {exc}") from None
        if continue_final_message:
            tag = _CONTINUE_TAG.strip()
            if final.strip() not in rendered or tag not in rendered:
                raise InvalidInput("the chat template drops the final message to continue")
            at = rendered.rindex(tag)
            if rendered[at : at + len(_CONTINUE_TAG)] == _CONTINUE_TAG:
                rendered = rendered[:at]
            else:
                rendered = rendered[:at].rstrip()
        return rendered
