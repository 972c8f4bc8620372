"""Engine adapters: real vLLM and the simulated engine that speaks its protocols."""
