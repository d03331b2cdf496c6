"""YAML of plain data read in bounded time and memory: limits on size, nesting and aliases."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

# Far above what a config needs (1 kB, about 60 values, 2 levels), so that a hostile file is
# refused in bounded time and memory: an alias bomb expands to billions of values, and PyYAML's
# scanner slows quadratically with nesting.
MAX_BYTES = 64 << 10
MAX_NODES = 10_000  # values, counting each alias as what it expands to
MAX_DEPTH = 32


class YAMLRefused(ValueError):
    """A document that is not valid YAML, or exceeds a limit; the message is one line."""


def problem(e: yaml.YAMLError, text: str = "") -> str:
    """A YAML error in `text` in one line: what is wrong, and where."""
    if isinstance(e, yaml.reader.ReaderError) and isinstance(e.character, int):
        line = text.count("\n", 0, e.position) + 1
        column = e.position - (text.rfind("\n", 0, e.position) + 1) + 1
        if 0xDC80 <= e.character <= 0xDCFF:  # a byte that is not UTF-8, in an argument
            what = f"a byte that is not UTF-8 (0x{e.character - 0xDC00:02x})"
        else:
            what = f"a character YAML does not allow (U+{e.character:04X})"
        return f"{what} (line {line}, column {column})"
    mark = getattr(e, "problem_mark", None)
    what = getattr(e, "problem", None)
    if what and mark is not None:
        return f"{what} (line {mark.line + 1}, column {mark.column + 1})"
    return " ".join(str(e).split())


class BoundedLoader(yaml.SafeLoader):
    """PyYAML's safe loader, stopped as soon as a document nests deeper than MAX_DEPTH or holds
    more than MAX_NODES values."""

    def __init__(self, stream: str):
        super().__init__(stream)
        self.nodes = self.depth = 0

    def fetch_flow_collection_start(self, token_class) -> None:
        if self.flow_level >= MAX_DEPTH:  # checked as scanned: the scanner reads far ahead
            raise YAMLRefused(f"nested more than {MAX_DEPTH} deep")
        super().fetch_flow_collection_start(token_class)

    def compose_node(self, parent, index) -> yaml.Node:
        self.nodes, self.depth = self.nodes + 1, self.depth + 1
        try:
            if self.nodes > MAX_NODES:
                raise YAMLRefused(f"more than {MAX_NODES:,} values")
            if self.depth > MAX_DEPTH:
                raise YAMLRefused(f"nested more than {MAX_DEPTH} deep")
            return super().compose_node(parent, index)
        finally:
            self.depth -= 1


def expanded_nodes(root: yaml.Node) -> int:
    """The values of a YAML document once its aliases are expanded, up to MAX_NODES + 1.

    An alias is the node it names, shared: counting with a memo takes time linear in the
    document, where expanding takes time exponential in it.
    """
    size: dict[int, int] = {}  # id of a node whose subtree is counted -> its expanded size
    open_: set[int] = set()  # nodes whose subtrees are being counted: the path from the root
    stack = [(root, False)]
    while stack:
        node, children_counted = stack.pop()
        children = [] if isinstance(node, yaml.ScalarNode) else node.value
        if isinstance(node, yaml.MappingNode):
            children = [part for pair in children for part in pair]
        if children_counted:
            size[id(node)] = min(MAX_NODES + 1, 1 + sum(size[id(c)] for c in children))
            open_.discard(id(node))
        elif id(node) in open_:
            raise YAMLRefused("an alias refers to a node that contains it")
        elif id(node) not in size:
            open_.add(id(node))
            stack.append((node, True))
            stack.extend((child, False) for child in children if id(child) not in size)
    return size[id(root)]


def parse(text: str, where: str) -> Any:
    """One YAML document of plain data, or None for an empty one; errors start with `where`."""
    loader = None
    try:
        loader = BoundedLoader(text)  # its reader checks the whole text for forbidden characters
        node = loader.get_single_node()
        if node is None:
            return None
        if expanded_nodes(node) > MAX_NODES:
            raise YAMLRefused(
                f"more than {MAX_NODES:,} values once aliases are expanded (an alias bomb?)"
            )
        return loader.construct_document(node)
    except yaml.YAMLError as e:
        raise YAMLRefused(f"{where}: not valid YAML: {problem(e, text)}") from None
    except YAMLRefused as e:
        raise YAMLRefused(f"{where}: {e}") from None
    finally:
        if loader is not None:
            loader.dispose()


def read(path: Path) -> Any:
    """The YAML document of a file of at most MAX_BYTES of UTF-8, or None for an empty one.

    Raises OSError when the file cannot be read, YAMLRefused naming `path` otherwise.
    """
    with path.open("rb") as f:
        data = f.read(MAX_BYTES + 1)
    if len(data) > MAX_BYTES:
        raise YAMLRefused(f"{path}: larger than {MAX_BYTES >> 10} KiB; not a config")
    try:
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        line = data[: e.start].count(b"\n") + 1
        raise YAMLRefused(f"{path}:{line}: not valid UTF-8") from None
    return parse(text, str(path))
