"""Tokenisation, block keys and the global KV index."""
