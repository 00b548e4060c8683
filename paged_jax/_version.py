"""The package's version, in a module of its own so that the CLI reads it without the
facade (``paged_jax/__init__``) and without JAX."""

__version__ = "0.1.0"
