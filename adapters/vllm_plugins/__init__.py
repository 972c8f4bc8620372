"""Plugins loaded by real vLLM engines (their own environment; nothing in kvgate imports them)."""
