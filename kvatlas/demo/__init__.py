"""``kvatlas demo``: the embedded fleet playing a RAG workload (``--keys``: multimodal keys)."""
