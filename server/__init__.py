"""Harpoon's HTTP edge: the OpenAI-compatible API, streaming, metrics, and the link to the engine process."""
