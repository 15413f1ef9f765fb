"""Strict YAML for sweep files and `--set` values: `yaml.safe_load` plus the refusals that keep hostile input
cheap to reject.

Refused, each as one `YAMLRefused` line: aliases (nine levels of nine aliases are 9^9 nodes once anything copies
the data), duplicate mapping keys (YAML keeps the last one silently), nesting deeper than MAX_DEPTH (PyYAML's
composer recurses, so 5000 levels end in a RecursionError), files over MAX_BYTES, files that are not UTF-8 text or
not regular files (a FIFO or /dev/zero would block or never end). NaN and infinities are found after loading by
`tree_problem`, which names the key path.
"""

from __future__ import annotations

import math
import os
import stat
from typing import Any

import yaml

MAX_DEPTH = 32  # a sweep needs 4 (top level, axes, an axis, a list value)
MAX_BYTES = 1 << 20


class YAMLRefused(ValueError):
    """Input refused before or while composing. str() is "line N: reason" (or just the reason)."""


def _line(mark: Any) -> str:
    return f"line {mark.line + 1}: " if mark is not None else ""


class _StrictLoader(yaml.SafeLoader):
    def __init__(self, stream: str):
        super().__init__(stream)
        self._depth = 0

    def compose_node(self, parent, index):
        if self.check_event(yaml.AliasEvent):
            event = self.peek_event()
            raise YAMLRefused(f"{_line(event.start_mark)}YAML aliases (*{event.anchor}) are not allowed")
        self._depth += 1
        try:
            if self._depth > MAX_DEPTH:
                raise YAMLRefused(f"{_line(self.peek_event().start_mark)}nested deeper than {MAX_DEPTH} levels")
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1

    def construct_mapping(self, node, deep=False):
        if isinstance(node, yaml.MappingNode):
            first_line: dict[Any, int] = {}
            for key_node, _ in node.value:
                key = self.construct_object(key_node, deep=True)
                try:
                    if key in first_line:
                        raise YAMLRefused(f"{_line(key_node.start_mark)}duplicate key {key!r} "
                                          f"(first at line {first_line[key]})")
                    first_line[key] = key_node.start_mark.line + 1
                except TypeError:  # an unhashable key: the base constructor names it
                    pass
        return super().construct_mapping(node, deep=deep)


def loads(text: str) -> Any:
    """Parse one YAML document strictly (see the module docstring). Raises YAMLRefused or yaml.YAMLError."""
    loader = _StrictLoader(text)
    try:
        return loader.get_single_data()
    finally:
        loader.dispose()


def read_text(path: str | os.PathLike) -> str:
    """The text of a sweep file, or OSError / YAMLRefused with a short reason (no file name: the caller adds it)."""
    try:
        st = os.stat(path)
    except OSError as e:
        raise YAMLRefused(f"cannot read ({e.strerror})") from None
    if stat.S_ISDIR(st.st_mode):
        raise YAMLRefused("cannot read (is a directory)")
    if not stat.S_ISREG(st.st_mode):
        raise YAMLRefused("cannot read (not a regular file)")
    try:
        with open(path, "rb") as f:
            data = f.read(MAX_BYTES + 1)
    except OSError as e:
        raise YAMLRefused(f"cannot read ({e.strerror})") from None
    if len(data) > MAX_BYTES:
        raise YAMLRefused(f"larger than {MAX_BYTES >> 20} MiB; a sweep file is a few lines")
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        line = data.count(b"\n", 0, e.start) + 1
        raise YAMLRefused(f"line {line}: not UTF-8 text (byte 0x{data[e.start]:02x} at offset {e.start})") from None


def tree_problem(obj: Any, max_depth: int = MAX_DEPTH) -> tuple[str, str] | None:
    """(key path, reason) for the first NaN/inf float or over-deep nesting in plain YAML data, else None.
    Iterative, so data built in code (or by many `--set` path parts) cannot overflow the stack either."""
    stack: list[tuple[str, Any, int]] = [("", obj, 0)]
    while stack:
        path, value, depth = stack.pop()
        if depth > max_depth:
            return _short(path), f"nested deeper than {max_depth} levels"
        if isinstance(value, float) and not math.isfinite(value):
            return _short(path), f"{value} is not allowed (every number must be finite)"
        if isinstance(value, dict):
            items = [(f"{path}.{k}" if path else str(k), v) for k, v in value.items()]
        elif isinstance(value, (list, tuple)):
            items = [(f"{path}[{i}]", v) for i, v in enumerate(value)]
        else:
            continue
        stack.extend((p, v, depth + 1) for p, v in reversed(items))
    return None


def _short(path: str) -> str:
    return (path[:60] + "..." if len(path) > 60 else path) or "top level"
