"""What a ``--policies`` name means: a router policy in front of engines with or without the
kvatlas connector (spec fleet-routing §4, "A policy names a whole stack")."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final

from kvatlas.errors import InvalidInput


@dataclass(frozen=True, slots=True)
class Stack:
    name: str
    policy: str
    """The router policy (kvatlas.router.policies.Policy's name)."""
    connector: bool
    """Engines reuse KV through kvatlas nodes (L1/L2, peers, fragments); else vLLM alone
    (its GPU prefix cache and CPU offload)."""


STACKS: Final = {
    s.name: s
    for s in (
        Stack("kvatlas", "kvatlas", True),
        Stack("prefix", "prefix", False),
        Stack("least-loaded", "least-loaded", False),
        Stack("round-robin", "round-robin", False),
        Stack("random", "random", False),
        Stack("kvatlas-noconnector", "kvatlas", False),
        Stack("prefix+connector", "prefix", True),
    )
}
DEFAULT_POLICIES: Final = (
    "kvatlas,prefix,least-loaded,round-robin,kvatlas-noconnector,prefix+connector"
)


def parse_stacks(text: str) -> list[Stack]:
    """``kvatlas,prefix,...`` → the stacks in that order; unknown or repeated names refused."""
    names = [n.strip() for n in text.split(",") if n.strip()]
    if not names:
        raise InvalidInput("--policies names no policy")
    unknown = [n for n in names if n not in STACKS]
    if unknown:
        raise InvalidInput(f"unknown policies {unknown}; known: {', '.join(STACKS)}")
    if len(set(names)) != len(names):
        raise InvalidInput(f"--policies repeats a name: {names}")
    return [STACKS[n] for n in names]
