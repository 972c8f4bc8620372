"""The shipped tiny byte-level BPE tokenizer (vocab 4096, ChatML chat template).

Load it with ``kvindex.tokenizer.Tokenizer.load()`` (or ``AutoTokenizer.from_pretrained``
on ``TOKENIZER_DIR``). Rebuild with ``python kvgate/assets/tiny_tokenizer/build.py``.
"""

from pathlib import Path

TOKENIZER_DIR: Path = Path(__file__).resolve().parent
"""Folder with ``tokenizer.json``, ``tokenizer_config.json`` and ``special_tokens_map.json``."""

__all__ = ["TOKENIZER_DIR"]
