"""``kvatlas bench fleet``: routing stacks side by side on one trace (spec fleet-routing §4).

``stacks`` names what a user chooses between (a router policy, with or without the kvatlas
connector); ``results`` turns per-request records into the spec's JSON; ``virtual`` and
``live`` produce those records, one in a discrete-event simulation, one with real processes.
"""

from kvatlas.bench.fleet.command import add_arguments, run
from kvatlas.bench.fleet.results import FleetReport, RequestRecord, StackResult, summarize
from kvatlas.bench.fleet.stacks import DEFAULT_POLICIES, STACKS, Stack, parse_stacks

__all__ = [
    "DEFAULT_POLICIES",
    "STACKS",
    "FleetReport",
    "RequestRecord",
    "Stack",
    "StackResult",
    "add_arguments",
    "parse_stacks",
    "run",
    "summarize",
]
