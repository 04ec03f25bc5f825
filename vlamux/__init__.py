"""vlamux: multi-tenant post-training of Vision-Language-Action policies on one shared backbone."""

__version__ = "0.1.0"


def __getattr__(name: str):
    # `vlamux.Client` without importing the SDK (and httpx) on every `import vlamux`.
    if name == "Client":
        from vlamux.sdk import Client

        return Client
    raise AttributeError(f"module 'vlamux' has no attribute {name!r}")
