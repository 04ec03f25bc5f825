"""The tenant-facing service: HTTP API (`app`), the service host behind it (`host`), the wire format
(`wire`, shared with the SDK). Importing this package imports neither FastAPI nor torch."""
