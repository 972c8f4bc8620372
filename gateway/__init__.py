"""The live service: aiohttp app, proxy, engine pool, KV-event ingestion, admin API."""
