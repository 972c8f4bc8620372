"""vLLM's dev endpoints (served with VLLM_SERVER_DEV_MODE=1), as their answers read."""

from __future__ import annotations

import json


def reset_done(answer: bytes) -> bool:
    """Whether a 200 to `POST /reset_prefix_cache` says the cache was emptied: vLLM answers
    `{"success": false}` while blocks are held (older releases answered an empty 200)."""
    if not answer.strip():
        return True
    try:
        doc = json.loads(answer)
    except ValueError:
        return False
    return isinstance(doc, dict) and doc.get("success") is True
