"""YAML and JSON documents a user writes (a gateway config, a profile, a workflow spec), read
with every mapping key given once.

PyYAML and `json` keep the last of two equal keys without a word, so a section repeated further
down a config (a second `tenants:`, an empty one) silently replaced the first: tenant keys then
stopped being asked for. Here a key given twice is an error naming it and both lines.
"""

from __future__ import annotations

import json
from collections.abc import Hashable
from typing import Any

import yaml
from yaml.constructor import ConstructorError
from yaml.nodes import MappingNode, ScalarNode

_MERGE = "tag:yaml.org,2002:merge"


class _OnceLoader(yaml.SafeLoader):
    """SafeLoader that refuses a mapping key written twice. Keys a merge (`<<: *base`) brings in
    may be overridden, as YAML allows; only the keys written in the mapping itself count."""

    def construct_mapping(self, node: MappingNode, deep: bool = False) -> dict[Hashable, Any]:
        seen: dict[Hashable, int] = {}
        for key_node, _ in node.value:
            if not isinstance(key_node, ScalarNode) or key_node.tag == _MERGE:
                continue
            key = self.construct_object(key_node, deep=deep)
            if not isinstance(key, Hashable):
                continue
            line = key_node.start_mark.line + 1
            if key in seen:
                raise ConstructorError(
                    None, None, f"key {key!r} is given twice (lines {seen[key]} and {line}); "
                    "the second would silently replace the first", key_node.start_mark)
            seen[key] = line
        return super().construct_mapping(node, deep)


def load_yaml(text: str) -> Any:
    """`yaml.safe_load`, refusing a key given twice in one mapping (a `yaml.YAMLError`), and
    a document nested deeper than the parser recurses (a `yaml.YAMLError` too)."""
    try:
        return yaml.load(text, Loader=_OnceLoader)
    except RecursionError:
        raise yaml.YAMLError(NESTED_TOO_DEEPLY) from None


def _once(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise ValueError(f"key {key!r} is given twice in one object; the second would "
                             "silently replace the first")
        out[key] = value
    return out


def load_json(text: str) -> Any:
    """`json.loads`, refusing a key given twice in one object (a ValueError; a
    `json.JSONDecodeError` for text that is no JSON), and a document nested deeper than the
    parser recurses (a ValueError)."""
    try:
        return json.loads(text, object_pairs_hook=_once)
    except RecursionError:
        raise ValueError(NESTED_TOO_DEEPLY) from None


NESTED_TOO_DEEPLY = "the document nests lists or mappings too deeply"
