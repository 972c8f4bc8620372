"""kvgate: a KV-cache-aware, workflow-aware gateway for agentic LLM workloads on vLLM."""

__version__ = "0.1.0"
