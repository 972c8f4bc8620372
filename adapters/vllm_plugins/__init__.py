"""Plugins loaded by real vLLM engines (their own environment). kvgate imports only
kvgate_pace_caps.py, the plugin's vLLM-free reading of its caps, which the simulated engine
shares."""
