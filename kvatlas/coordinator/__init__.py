"""The coordinator service: HTTP API, CLI, instances, auth, metrics, snapshots, transports.

Layers, each importing only those below it (docs/coordinator.md):

- ``server`` runs it (CLI, in-process ``BackgroundServer``); ``app`` wires the ASGI app;
- ``routes/`` one module per resource, thin: role check, ``query``, service, ``wire``;
  ``asgi`` answers the blend lookup below the framework (``blend_lookup``, the same handler);
- ``query`` validates requests (422 / 413); ``wire`` maps replies to JSON and back;
- ``service`` (directory, instances, snapshots, background threads; independent of HTTP),
  ``stream_consumer`` (Redis Streams), ``views`` (what the service reports), ``instances``,
  ``auth``, ``metrics``, ``config``, ``schemas``.

This package re-exports nothing: ``kvatlas coordinator --help`` imports only ``config``, and
must not load the web stack. Import ``kvatlas.coordinator.server.BackgroundServer``,
``kvatlas.coordinator.config.CoordinatorConfig`` and ``kvatlas.coordinator.wire``.
"""
