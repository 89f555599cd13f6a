"""``kvatlas demo``: the embedded fleet playing a RAG workload (``fleet.run_fleet_demo``,
docs/node.md "Demo"); ``--keys`` shows multimodal-safe keys (``keys.run_demo``, docs/keys.md).

Exports nothing: the CLI imports each demo module when it runs it.
"""

__all__: list[str] = []
