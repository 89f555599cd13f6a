"""``kvatlas router``: an OpenAI-compatible gateway that sends each request to the engine with
the lowest predicted time to first token, from what the fleet's directory says each engine can
reuse (docs/router.md). It sits above the client layer: it reaches the coordinator only
through :mod:`kvatlas.client`, and imports neither the directory nor numba."""

from kvatlas.chat_template import compile_chat_template
from kvatlas.router.app import ENGINE_HEADER, Router
from kvatlas.router.config import POLICIES, RouterConfig, parse_engines
from kvatlas.router.openai_body import RouteRequest, parse_request
from kvatlas.router.policies import Candidate, CostModel, Coverage, EngineLoad, Policy, Ranked
from kvatlas.router.replies import openai_error
from kvatlas.router.server import build_router, create_app, run_router
from kvatlas.router.tokenizer import PromptTokenizer

__all__ = [
    "ENGINE_HEADER",
    "POLICIES",
    "Candidate",
    "CostModel",
    "Coverage",
    "EngineLoad",
    "Policy",
    "PromptTokenizer",
    "Ranked",
    "RouteRequest",
    "Router",
    "RouterConfig",
    "build_router",
    "compile_chat_template",
    "create_app",
    "openai_error",
    "parse_engines",
    "parse_request",
    "run_router",
]
