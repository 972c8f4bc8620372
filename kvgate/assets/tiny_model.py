"""Build a tiny random Llama model directory that real vLLM can load (for the engine test tier).

The model is 2 layers of width 128 with random weights, so its output is gibberish, but vLLM
serves it for real: scheduling, batching, prefix caching, KV events and metrics all behave as
with a real model. The directory holds:

* ``config.json`` (``LlamaConfig``, bos/eos/pad ids taken from the shipped tokenizer),
* ``generation_config.json``,
* ``model.safetensors`` (float32, seeded ``numpy`` normal(0, 0.02) init, RMSNorm weights 1),
* a byte-identical *copy* of the shipped tokenizer files from ``kvgate/assets/tiny_tokenizer``,
  so the gateway (``kvindex.tokenizer.Tokenizer.load()``) and the engine tokenise and render
  chats identically.

Weights are written with ``numpy`` + ``safetensors`` (both already required by
``transformers``), so building needs no ``torch`` and kvgate's dependencies stay torch-free.
Building is deterministic (fixed seed) and idempotent: a complete directory (its marker file
names the current fingerprint) is left untouched. Run as a script::

    python -m kvgate.assets.tiny_model OUT_DIR
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

from kvgate.assets.tiny_tokenizer import TOKENIZER_DIR

__all__ = [
    "MARKER_NAME",
    "MODEL_FILES",
    "TOKENIZER_FILES",
    "build_tiny_model",
    "is_complete",
    "tiny_model_fingerprint",
]

TOKENIZER_FILES: tuple[str, ...] = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
)
MODEL_FILES: tuple[str, ...] = ("config.json", "generation_config.json", "model.safetensors")
MARKER_NAME = ".kvgate-tiny-model.json"
"""Written last; holds the fingerprint of the builder and tokenizer the directory came from."""

SEED = 20240601
HIDDEN_SIZE = 128
INTERMEDIATE_SIZE = 256
NUM_LAYERS = 2
NUM_HEADS = 4
NUM_KV_HEADS = 2
VOCAB_SIZE = 4096
MAX_POSITIONS = 4096
INIT_STD = 0.02


def tiny_model_fingerprint() -> str:
    """SHA-256 over this builder's source and the shipped tokenizer files (hex)."""
    h = hashlib.sha256()
    h.update(Path(__file__).read_bytes())
    for name in TOKENIZER_FILES:
        h.update(name.encode())
        h.update(b"\0")
        h.update((TOKENIZER_DIR / name).read_bytes())
    return h.hexdigest()


def is_complete(out_dir: Path, fingerprint: str | None = None) -> bool:
    """True when ``out_dir`` holds a finished build with the current (or given) fingerprint."""
    marker = Path(out_dir) / MARKER_NAME
    try:
        recorded = json.loads(marker.read_text()).get("fingerprint")
    except (OSError, ValueError, AttributeError):
        return False
    if recorded != (fingerprint or tiny_model_fingerprint()):
        return False
    return all((Path(out_dir) / name).is_file() for name in (*MODEL_FILES, *TOKENIZER_FILES))


def _special_ids() -> dict[str, int]:
    """bos/eos/pad ids of the shipped tokenizer, read from its files (no transformers load)."""
    special = json.loads((TOKENIZER_DIR / "special_tokens_map.json").read_text())
    vocab: dict[str, int] = {
        tok["content"]: int(tok["id"])
        for tok in json.loads((TOKENIZER_DIR / "tokenizer.json").read_text())["added_tokens"]
    }

    def token_id(key: str) -> int:
        value = special[key]
        content = value["content"] if isinstance(value, dict) else value
        return vocab[content]

    return {
        "bos_token_id": token_id("bos_token"),
        "eos_token_id": token_id("eos_token"),
        "pad_token_id": token_id("pad_token"),
    }


def _random_weights() -> dict[str, Any]:
    """Llama state dict (HF tensor names) as float32 numpy arrays, seeded."""
    import numpy as np

    rng = np.random.default_rng(SEED)
    head_dim = HIDDEN_SIZE // NUM_HEADS
    kv_dim = NUM_KV_HEADS * head_dim

    def normal(*shape: int) -> Any:
        return np.ascontiguousarray(
            rng.standard_normal(shape, dtype=np.float32) * np.float32(INIT_STD)
        )

    def ones(n: int) -> Any:
        return np.ones((n,), dtype=np.float32)

    tensors: dict[str, Any] = {"model.embed_tokens.weight": normal(VOCAB_SIZE, HIDDEN_SIZE)}
    for i in range(NUM_LAYERS):
        p = f"model.layers.{i}."
        tensors[p + "self_attn.q_proj.weight"] = normal(HIDDEN_SIZE, HIDDEN_SIZE)
        tensors[p + "self_attn.k_proj.weight"] = normal(kv_dim, HIDDEN_SIZE)
        tensors[p + "self_attn.v_proj.weight"] = normal(kv_dim, HIDDEN_SIZE)
        tensors[p + "self_attn.o_proj.weight"] = normal(HIDDEN_SIZE, HIDDEN_SIZE)
        tensors[p + "mlp.gate_proj.weight"] = normal(INTERMEDIATE_SIZE, HIDDEN_SIZE)
        tensors[p + "mlp.up_proj.weight"] = normal(INTERMEDIATE_SIZE, HIDDEN_SIZE)
        tensors[p + "mlp.down_proj.weight"] = normal(HIDDEN_SIZE, INTERMEDIATE_SIZE)
        tensors[p + "input_layernorm.weight"] = ones(HIDDEN_SIZE)
        tensors[p + "post_attention_layernorm.weight"] = ones(HIDDEN_SIZE)
    tensors["model.norm.weight"] = ones(HIDDEN_SIZE)
    tensors["lm_head.weight"] = normal(VOCAB_SIZE, HIDDEN_SIZE)
    return tensors


def _write_model(tmp: Path, fingerprint: str) -> None:
    # Silence transformers' "PyTorch was not found" banner (set before its first import).
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    from safetensors.numpy import save_file
    from transformers import LlamaConfig

    ids = _special_ids()
    config = LlamaConfig(
        architectures=["LlamaForCausalLM"],
        hidden_size=HIDDEN_SIZE,
        intermediate_size=INTERMEDIATE_SIZE,
        num_hidden_layers=NUM_LAYERS,
        num_attention_heads=NUM_HEADS,
        num_key_value_heads=NUM_KV_HEADS,
        vocab_size=VOCAB_SIZE,
        max_position_embeddings=MAX_POSITIONS,
        initializer_range=INIT_STD,
        tie_word_embeddings=False,
        dtype="float32",
        bos_token_id=ids["bos_token_id"],
        eos_token_id=ids["eos_token_id"],
        pad_token_id=ids["pad_token_id"],
    )
    config.save_pretrained(tmp)
    # Written directly (what GenerationConfig.save_pretrained writes, minus the version stamp).
    (tmp / "generation_config.json").write_text(json.dumps(ids, indent=2, sort_keys=True) + "\n")
    save_file(_random_weights(), str(tmp / "model.safetensors"), metadata={"format": "pt"})
    for name in TOKENIZER_FILES:
        shutil.copyfile(TOKENIZER_DIR / name, tmp / name)
    (tmp / MARKER_NAME).write_text(json.dumps({"fingerprint": fingerprint, "seed": SEED}) + "\n")


def build_tiny_model(out_dir: Path) -> Path:
    """Build (or reuse) the tiny model in ``out_dir`` and return ``out_dir``.

    Files are written to a temporary sibling directory and moved into place one by one with
    ``os.replace``, the marker last, so an interrupted build is never mistaken for a complete
    one and concurrent builders (which write identical bytes) cannot corrupt each other.
    """
    out_dir = Path(out_dir).expanduser()
    fingerprint = tiny_model_fingerprint()
    if is_complete(out_dir, fingerprint):
        return out_dir
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=f".{out_dir.name}.build-", dir=out_dir.parent) as t:
        tmp = Path(t)
        _write_model(tmp, fingerprint)
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / MARKER_NAME).unlink(missing_ok=True)
        for name in (*MODEL_FILES, *TOKENIZER_FILES, MARKER_NAME):
            (tmp / name).chmod(0o644)
            os.replace(tmp / name, out_dir / name)
    if not is_complete(out_dir, fingerprint):
        raise RuntimeError(f"tiny model build in {out_dir} did not complete")
    return out_dir


def main(argv: list[str] | None = None) -> int:
    """``python -m kvgate.assets.tiny_model OUT_DIR``: build and print the directory."""
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python -m kvgate.assets.tiny_model OUT_DIR", file=sys.stderr)
        return 2
    print(build_tiny_model(Path(args[0])))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
