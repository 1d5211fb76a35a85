"""kvfs: a POSIX filesystem for LLM KV-cache blocks, backed by tiered node memory."""

__version__ = "0.1.0"
