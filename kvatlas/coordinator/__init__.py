"""The coordinator service: HTTP API, CLI, instances, auth, metrics, snapshots, transports."""
