"""Where a YAML file's mappings start: a ``SafeLoader`` that keeps line numbers and refuses duplicate keys.

``read_yaml(path)`` gives plain data whose mappings know their 1-based ``line``; ``Where`` names a place in
the file (path, line, scenario) for messages, and ``error(where, message)`` makes the ``UsageError``.
"""

from __future__ import annotations

import dataclasses

import yaml

from moeverify.errors import UsageError


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Where:
    """A place in a scenario file, for messages."""

    path: str
    line: int | None = None
    scenario: str | None = None

    def __str__(self) -> str:
        loc = self.path if self.line is None else f"{self.path}:{self.line}"
        return loc if self.scenario is None else f"{loc}: scenario {self.scenario}"

    def at(self, node: object, *, scenario: str | None = None) -> Where:
        line = getattr(node, "line", None)
        return Where(path=self.path, line=line or self.line, scenario=scenario or self.scenario)


def error(where: Where, message: str) -> UsageError:
    return UsageError(f"{where}: {message}")


class _LineDict(dict):
    """A mapping that remembers the 1-based line where it starts in its file."""

    line: int | None = None


class _Loader(yaml.SafeLoader):
    """``SafeLoader`` that records mapping lines and rejects duplicate keys."""


def _construct_mapping(loader: _Loader, node: yaml.MappingNode) -> _LineDict:
    loader.flatten_mapping(node)
    out = _LineDict()
    out.line = node.start_mark.line + 1
    for key_node, value_node in node.value:
        key = loader.construct_object(key_node, deep=True)
        if key in out:
            raise UsageError(f"{loader.name}:{key_node.start_mark.line + 1}: duplicate key {key!r}")
        out[key] = loader.construct_object(value_node, deep=True)
    return out


_Loader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_mapping)


def text_line(data: bytes, offset: int) -> int:
    """1-based line number of byte ``offset`` in ``data``."""
    return data.count(b"\n", 0, offset) + 1


def read_yaml(path: str) -> object:
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except OSError as exc:
        raise UsageError(f"{path}: cannot read scenario file ({exc.strerror or exc})") from None
    except UnicodeDecodeError as exc:
        at = text_line(exc.object, exc.start)
        raise UsageError(
            f"{path}:{at}: not UTF-8 text (byte 0x{exc.object[exc.start]:02x} at offset {exc.start}); "
            "scenario files are UTF-8 YAML"
        ) from None
    loader = None
    try:
        loader = _Loader(text)  # its reader refuses a control character (a NUL byte) here already
        loader.name = path
        return loader.get_single_data()
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        line = f":{mark.line + 1}" if mark is not None else ""
        raise UsageError(f"{path}{line}: malformed YAML: {exc.problem or exc.context}") from None
    except yaml.reader.ReaderError as exc:
        at = text_line(text.encode("utf-8"), len(text[: exc.position].encode("utf-8")))
        raise UsageError(
            f"{path}:{at}: not YAML text: character "
            f"{f'U+{exc.character:04X}' if isinstance(exc.character, int) else repr(exc.character)} at offset "
            f"{exc.position} ({exc.reason})"
        ) from None
    except yaml.YAMLError as exc:
        raise UsageError(f"{path}: malformed YAML: {exc}") from None
    except RecursionError:
        raise UsageError(f"{path}: malformed YAML: nested deeper than a scenario file can be read") from None
    finally:
        if loader is not None:
            loader.dispose()
