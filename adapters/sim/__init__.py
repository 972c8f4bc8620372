"""The simulated vLLM engine: a sans-IO engine model and a server speaking vLLM's protocols."""
