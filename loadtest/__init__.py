"""Benchmarks that print figures: offline (engine in-process) and serving (HTTP, any OpenAI-compatible server)."""
