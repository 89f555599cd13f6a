"""kvatlas: where every cached KV chunk of an LLM serving fleet lives."""

__version__ = "0.1.0"
