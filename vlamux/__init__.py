"""vlamux: multi-tenant post-training of Vision-Language-Action policies on one shared backbone."""

__version__ = "0.1.0"
