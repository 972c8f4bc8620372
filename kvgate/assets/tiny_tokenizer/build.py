"""Build the shipped tiny byte-level BPE tokenizer (vocab 4096) and its chat template.

Run from the repository root::

    python kvgate/assets/tiny_tokenizer/build.py

The training corpus is generated here from a seeded ``random.Random(0)`` and word
lists embedded in this file, and training runs single-threaded, so a rebuild
writes byte-identical ``tokenizer.json``, ``tokenizer_config.json`` and
``special_tokens_map.json`` next to this script.
"""

from __future__ import annotations

import os

# Must be set before `tokenizers` is imported: the Rust thread pool reads them at start-up.
os.environ["RAYON_NUM_THREADS"] = "1"
os.environ["RAYON_RS_NUM_CPUS"] = "1"
os.environ["TOKENIZERS_PARALLELISM"] = "false"

import json
import random
import sys
from collections.abc import Iterator
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

OUT_DIR = Path(__file__).resolve().parent

VOCAB_SIZE = 4096
MIN_FREQUENCY = 2
MODEL_MAX_LENGTH = 32768

BOS = "<|begin_of_text|>"
EOT = "<|end_of_text|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
SPECIAL_TOKENS = [BOS, EOT, IM_START, IM_END]  # ids 0..3, in this order

# ChatML-style template. Mirrors what real vLLM does with the same directory:
# * content may be a string, missing/None (vLLM turns None into "" / []), or a list of
#   text parts joined with "\n" (exactly what vLLM's "string" content format does, so the
#   output is the same whether vLLM detects "string" or "openai" content format);
# * tools are rendered canonically (name, description, parameters only, None/absent
#   fields skipped) so a raw request dict and vLLM's pydantic `model_dump()` (which adds
#   `description: null` and reorders keys) render identically;
# * tool-call arguments are rendered with `tojson` when they are a mapping (vLLM parses
#   the OpenAI JSON string into a dict before rendering) or verbatim when a string.
CHAT_TEMPLATE = (
    "{%- macro render_content(content) -%}\n"
    "{%- if content is not defined or content is none -%}\n"
    "{%- elif content is string -%}\n"
    "{{- content -}}\n"
    "{%- elif content is iterable and content is not mapping -%}\n"
    "{%- set ns = namespace(sep='') -%}\n"
    "{%- for part in content -%}\n"
    "{%- if part is string -%}\n"
    "{{- ns.sep ~ part -}}\n"
    "{%- set ns.sep = '\\n' -%}\n"
    "{%- elif part is mapping and part['type'] == 'text' -%}\n"
    "{%- if part['text'] is defined and part['text'] is not none -%}\n"
    "{{- ns.sep ~ part['text'] -}}\n"
    "{%- set ns.sep = '\\n' -%}\n"
    "{%- endif -%}\n"
    "{%- else -%}\n"
    "{{- raise_exception('Only text content parts are supported') -}}\n"
    "{%- endif -%}\n"
    "{%- endfor -%}\n"
    "{%- else -%}\n"
    "{{- raise_exception('Message content must be a string or a list of text parts') -}}\n"
    "{%- endif -%}\n"
    "{%- endmacro -%}\n"
    "{{- bos_token -}}\n"
    "{%- set system_roles = ['system', 'developer'] -%}\n"
    "{%- if tools -%}\n"
    "{{- '<|im_start|>system\\n' -}}\n"
    "{%- if messages and messages[0]['role'] in system_roles -%}\n"
    "{{- render_content(messages[0]['content']) ~ '\\n\\n' -}}\n"
    "{%- endif -%}\n"
    "{{- '# Tools\\n\\nYou may call one or more of the following functions, "
    "one JSON object per line:\\n' -}}\n"
    "{%- for tool in tools -%}\n"
    "{%- if tool is not mapping -%}\n"
    "{{- raise_exception('Each tool must be a JSON object') -}}\n"
    "{%- endif -%}\n"
    "{%- set fn = tool['function'] if tool['function'] is defined else tool -%}\n"
    "{%- if fn is not mapping or fn['name'] is not defined or fn['name'] is not string -%}\n"
    "{{- raise_exception('Each tool needs a function with a string name') -}}\n"
    "{%- endif -%}\n"
    '{{- \'{"type": "function", "function": {"name": \' ~ (fn[\'name\'] | tojson) -}}\n'
    "{%- if fn['description'] is defined and fn['description'] is not none -%}\n"
    "{{- ', \"description\": ' ~ (fn['description'] | tojson) -}}\n"
    "{%- endif -%}\n"
    "{%- if fn['parameters'] is defined and fn['parameters'] is not none -%}\n"
    "{{- ', \"parameters\": ' ~ (fn['parameters'] | tojson) -}}\n"
    "{%- endif -%}\n"
    "{{- '}}\\n' -}}\n"
    "{%- endfor -%}\n"
    "{{- '\\nTo call a function, reply with:\\n<tool_call>\\n"
    '{"name": <function-name>, "arguments": <arguments-json-object>}\\n'
    "</tool_call><|im_end|>\\n' -}}\n"
    "{%- endif -%}\n"
    "{%- for message in messages -%}\n"
    "{%- set role = message['role'] -%}\n"
    "{%- if role is not string or role not in ['system', 'developer', 'user', 'assistant', "
    "'tool'] -%}\n"
    "{{- raise_exception('Unsupported message role: ' ~ role) -}}\n"
    "{%- endif -%}\n"
    "{%- if role in system_roles -%}\n"
    "{%- if not (loop.first and tools) -%}\n"
    "{{- '<|im_start|>system\\n' ~ render_content(message['content']) ~ '<|im_end|>\\n' -}}\n"
    "{%- endif -%}\n"
    "{%- elif role == 'assistant' -%}\n"
    "{%- set text = render_content(message['content']) -%}\n"
    "{{- '<|im_start|>assistant\\n' ~ text -}}\n"
    "{%- if message['tool_calls'] is defined and message['tool_calls'] -%}\n"
    "{%- for call in message['tool_calls'] -%}\n"
    "{%- set fn = call['function'] if call['function'] is defined else call -%}\n"
    "{%- if fn is not mapping or fn['name'] is not defined or fn['name'] is not string -%}\n"
    "{{- raise_exception('Each tool call needs a function with a string name') -}}\n"
    "{%- endif -%}\n"
    "{%- if text or not loop.first -%}\n"
    "{{- '\\n' -}}\n"
    "{%- endif -%}\n"
    "{{- '<tool_call>\\n{\"name\": ' ~ (fn['name'] | tojson) ~ ', \"arguments\": ' -}}\n"
    "{%- if fn['arguments'] is not defined or fn['arguments'] is none -%}\n"
    "{{- '{}' -}}\n"
    "{%- elif fn['arguments'] is string -%}\n"
    "{{- fn['arguments'] -}}\n"
    "{%- else -%}\n"
    "{{- fn['arguments'] | tojson -}}\n"
    "{%- endif -%}\n"
    "{{- '}\\n</tool_call>' -}}\n"
    "{%- endfor -%}\n"
    "{%- endif -%}\n"
    "{{- '<|im_end|>\\n' -}}\n"
    "{%- else -%}\n"
    "{{- '<|im_start|>' ~ role ~ '\\n' ~ render_content(message['content']) ~ '<|im_end|>\\n' -}}\n"
    "{%- endif -%}\n"
    "{%- endfor -%}\n"
    "{%- if add_generation_prompt -%}\n"
    "{{- '<|im_start|>assistant\\n' -}}\n"
    "{%- endif -%}\n"
)

# --------------------------------------------------------------------------- corpus


def _split(text: str) -> list[str]:
    return text.split()


WORDS = _split("""
the of and to in is that for it as was with be by on not he this are or his from at which
but have an they you were her she there been one all we their has would when if so no what
will more out up into do any your can said about other time some them only could new these
two may first then its over also after know such like just most where many well must even
because through back much before our good those how very still between should own each
people world year work make way day part system number state program case point group
problem fact place week company question service request model server token cache memory
block prefix agent tool call result value error message user assistant response function
data file path name type string list object array field key index node graph task step
plan query search answer context window length limit budget latency throughput queue
worker engine batch schedule route policy score load share hit miss evict store fetch read
write open close start stop begin end send receive update delete create check test build
run deploy config option setting default version release change issue report review
design simple small large fast slow high low long short next last early late full empty
always never often sometimes usually however therefore although while during within
without against among across along around above below under behind inside outside
water light sound color house city road river mountain forest garden market school
student teacher doctor friend family child parent mother father brother sister money
price cost order item product customer account payment invoice shipping address phone
email weather temperature forecast location country region language translate summary
document page section chapter title author note comment reply thread channel event
calendar meeting schedule minute hour month today tomorrow yesterday morning evening
""")

SYLLABLES = _split("""
ka ro mi ten sa lo ver an ti nu pe dor gal ish ment tion ly able ing ed er est re un pre
dis con pro com ex in im ca bo lu ze fi ha jo ku mo na pi qua ri so tu vi wa xe yo zu
bra cle dri flo gra pli sta tre spo thr ght ph ch sh st nd rt mp nk ll ss tt
""")

ACCENTED = _split("""
café naïve résumé façade jalapeño über smörgåsbord crème brûlée piñata coöperate déjà
vu straße garçon señor fiancée mañana Zürich København São Paulo Kraków Ærø
""")

SCRIPTS = [
    "这是一个测试。",
    "你好，世界！",
    "缓存命中率很高。",
    "こんにちは、世界。",
    "キャッシュを再利用します。",
    "안녕하세요 세계",
    "Привет, мир!",
    "Кэш префиксов работает.",
    "Γειά σου κόσμε",
    "مرحبا بالعالم",
    "שלום עולם",
    "नमस्ते दुनिया",
    "🙂 👍 🚀 ✅ ❌ ⚠️ 🔥",
    "→ ← ↑ ↓ • … — – ° ± × ÷ ≤ ≥ ≠ ∞",
]

PY_KEYWORDS = [
    "def",
    "return",
    "if",
    "elif",
    "else",
    "for",
    "while",
    "in",
    "import",
    "from",
    "class",
    "self",
    "None",
    "True",
    "False",
    "async",
    "await",
    "with",
    "as",
    "try",
    "except",
    "raise",
    "lambda",
    "yield",
    "pass",
    "not",
    "and",
    "or",
    "is",
]
JSON_TYPES = ["string", "integer", "number", "boolean", "array", "object"]


def _pseudo_word(rng: random.Random) -> str:
    return "".join(rng.choice(SYLLABLES) for _ in range(rng.randint(1, 4)))


def _word(rng: random.Random) -> str:
    roll = rng.random()
    if roll < 0.80:
        return rng.choice(WORDS)
    if roll < 0.97:
        return _pseudo_word(rng)
    return rng.choice(ACCENTED)


def _number(rng: random.Random) -> str:
    roll = rng.random()
    if roll < 0.5:
        return str(rng.randint(0, 100))
    if roll < 0.8:
        return str(rng.randint(0, 100000))
    return f"{rng.random() * 1000:.2f}"


def _sentence(rng: random.Random) -> str:
    words = [_word(rng) for _ in range(rng.randint(4, 18))]
    if rng.random() < 0.3:
        words.insert(rng.randrange(len(words)), _number(rng))
    if rng.random() < 0.15:
        idx = rng.randrange(len(words))
        words[idx] = words[idx] + ","
    words[0] = words[0][:1].upper() + words[0][1:]
    return " ".join(words) + rng.choice([".", ".", ".", "?", "!", ":"])


def _paragraph(rng: random.Random) -> str:
    text = " ".join(_sentence(rng) for _ in range(rng.randint(2, 7)))
    if rng.random() < 0.1:
        text += " " + rng.choice(SCRIPTS)
    return text


def _identifier(rng: random.Random) -> str:
    parts = [rng.choice(WORDS) for _ in range(rng.randint(1, 3))]
    style = rng.random()
    if style < 0.6:
        return "_".join(parts)
    if style < 0.85:
        return parts[0] + "".join(p.capitalize() for p in parts[1:])
    return "".join(p.capitalize() for p in parts)


def _tool_def(rng: random.Random) -> str:
    props: dict[str, object] = {}
    for _ in range(rng.randint(1, 4)):
        prop: dict[str, object] = {"type": rng.choice(JSON_TYPES)}
        if rng.random() < 0.7:
            prop["description"] = _sentence(rng)
        if prop["type"] == "string" and rng.random() < 0.2:
            prop["enum"] = [rng.choice(WORDS) for _ in range(rng.randint(2, 4))]
        props[_identifier(rng)] = prop
    names = list(props)
    tool = {
        "type": "function",
        "function": {
            "name": _identifier(rng),
            "description": _sentence(rng),
            "parameters": {
                "type": "object",
                "properties": props,
                "required": names[: rng.randint(0, len(names))],
            },
        },
    }
    return json.dumps(tool, ensure_ascii=False)


def _tool_call(rng: random.Random) -> str:
    args = {_identifier(rng): rng.choice([_word(rng), _number(rng)]) for _ in range(3)}
    call = {"name": _identifier(rng), "arguments": args}
    return "<tool_call>\n" + json.dumps(call, ensure_ascii=False) + "\n</tool_call>"


def _code(rng: random.Random) -> str:
    name = _identifier(rng)
    args = ", ".join(_identifier(rng) for _ in range(rng.randint(0, 3)))
    lines = [f"def {name}({args}):", f'    """{_sentence(rng)}"""']
    for _ in range(rng.randint(2, 8)):
        indent = "    " * rng.randint(1, 3)
        kind = rng.random()
        if kind < 0.3:
            lines.append(f"{indent}{_identifier(rng)} = {_identifier(rng)}({_number(rng)})")
        elif kind < 0.5:
            lines.append(f"{indent}if {_identifier(rng)} is not None:")
        elif kind < 0.65:
            lines.append(f"{indent}for {_identifier(rng)} in {_identifier(rng)}:")
        elif kind < 0.8:
            lines.append(f"{indent}# {_sentence(rng)}")
        else:
            kw = rng.choice(PY_KEYWORDS)
            lines.append(f"{indent}{kw} {_identifier(rng)}.{_identifier(rng)}()")
    lines.append(f"    return {_identifier(rng)}")
    return "\n".join(lines) + "\n"


def _chat_turns(rng: random.Random) -> str:
    out = ["system\nYou are a helpful assistant. " + _paragraph(rng)]
    for _ in range(rng.randint(1, 3)):
        out.append("user\n" + _paragraph(rng))
        if rng.random() < 0.3:
            out.append("assistant\n" + _tool_call(rng))
            out.append("tool\n" + json.dumps({"result": _sentence(rng)}, ensure_ascii=False))
        out.append("assistant\n" + _paragraph(rng))
    return "\n".join(out)


def corpus(seed: int = 0, documents: int = 4000) -> Iterator[str]:
    """Yield the deterministic training documents (about 3 MB in total)."""
    rng = random.Random(seed)
    for _ in range(documents):
        kind = rng.random()
        if kind < 0.45:
            yield _paragraph(rng)
        elif kind < 0.65:
            yield _chat_turns(rng)
        elif kind < 0.82:
            yield "\n".join(_tool_def(rng) for _ in range(rng.randint(1, 4)))
        else:
            yield _code(rng)
    for line in SCRIPTS:
        for _ in range(4):
            yield line


def train() -> Tokenizer:
    """Train the byte-level BPE tokenizer on the generated corpus."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        min_frequency=MIN_FREQUENCY,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus(), trainer=trainer)
    for want_id, token in enumerate(SPECIAL_TOKENS):
        got = tok.token_to_id(token)
        if got != want_id:
            raise RuntimeError(f"special token {token!r} got id {got}, expected {want_id}")
    if tok.get_vocab_size() != VOCAB_SIZE:
        raise RuntimeError(f"vocab size {tok.get_vocab_size()} != {VOCAB_SIZE}; grow the corpus")
    # Llama-style: encode(add_special_tokens=True) prepends BOS, nothing else is added.
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A",
        pair=f"{BOS} $A {BOS}:1 $B:1",
        special_tokens=[(BOS, 0)],
    )
    return tok


def _dump(obj: object) -> str:
    return json.dumps(obj, indent=2, ensure_ascii=False) + "\n"


def main() -> None:
    """Train and write the tokenizer files next to this script."""
    tok = train()
    (OUT_DIR / "tokenizer.json").write_text(tok.to_str(pretty=True) + "\n", encoding="utf-8")
    # Note: no "add_bos_token" key. transformers 5 rebuilds the post-processor from
    # add_bos_token/add_eos_token when either key is present; without them the
    # TemplateProcessing in tokenizer.json is used as-is (transformers 4 does the same).
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS,
        "eos_token": IM_END,
        "pad_token": EOT,
        "model_max_length": MODEL_MAX_LENGTH,
        "clean_up_tokenization_spaces": False,
        "model_input_names": ["input_ids", "attention_mask"],
        "chat_template": CHAT_TEMPLATE,
    }
    (OUT_DIR / "tokenizer_config.json").write_text(_dump(config), encoding="utf-8")
    special_map = {"bos_token": BOS, "eos_token": IM_END, "pad_token": EOT}
    (OUT_DIR / "special_tokens_map.json").write_text(_dump(special_map), encoding="utf-8")
    size = (OUT_DIR / "tokenizer.json").stat().st_size
    print(f"wrote {OUT_DIR} (tokenizer.json {size} bytes)", file=sys.stderr)


if __name__ == "__main__":
    main()
