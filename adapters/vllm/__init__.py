"""Everything specific to vLLM engines: metrics parsing, HTTP forwarding details, KV transports."""
