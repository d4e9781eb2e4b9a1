"""Files users give commbench, read safely: bounded size, UTF-8 text, bounded YAML, one-line errors.

Every YAML file commbench reads (model files and presets, spec files, the calibration table) goes through
``load_yaml`` or ``load_yaml_mapping``; nothing else calls ``yaml.load``. The loader is PyYAML's pure-Python
safe loader with these limits, each refused as a one-line ``UsageError`` naming the file and the line:

- size: at most ``MAX_YAML_BYTES`` (1 MiB) are read, so a huge or endless file (``/dev/zero``) costs nothing;
- nodes: at most ``MAX_YAML_NODES`` nodes, each alias counted at the full size of what it names, checked
  while composing and before anything is built. Aliases stay allowed (a user may name a repeated value
  once), but a "billion laughs" document is refused after at most ``MAX_YAML_NODES`` steps, never expanded;
  an alias into its own anchor (a recursive document) is refused too. Nesting deeper than
  ``MAX_YAML_DEPTH`` is refused (the composer recurses: a 1 MiB ``[[[[...`` would overflow the stack);
- types: only plain text, numbers, booleans, null, lists and maps. Explicit tags (``!!python/object``,
  ``!!binary``, ``!custom``) are refused; dates and merge keys (``<<``) are read as plain text;
  integers outside the int64 range are refused (``float()`` of a 400-digit integer overflows); duplicate
  keys are refused rather than silently keeping the last;
- echo: an error quotes a value through ``shorten`` (at most ``ECHO_CHARS`` characters), never whole.
"""

from __future__ import annotations

import json
import os
import reprlib
import stat
import zlib
from collections.abc import Iterable
from typing import Any

import yaml
from yaml.composer import Composer
from yaml.constructor import ConstructorError, SafeConstructor
from yaml.events import AliasEvent
from yaml.nodes import MappingNode, Node, ScalarNode
from yaml.parser import Parser
from yaml.reader import Reader
from yaml.resolver import Resolver
from yaml.scanner import Scanner

from commbench.errors import UsageError

# commbench's YAML files are a few KiB (the largest shipped one, the calibration table, is 6 KiB): 1 MiB is
# 100x that, and small enough that even the slowest parse of it stays within seconds.
MAX_YAML_BYTES = 1 << 20
# Expanded nodes (every alias counted at the size of what it names): the calibration table has ~500, a model
# or spec file ~40. A billion-laughs document stops here, after at most this many steps.
MAX_YAML_NODES = 20_000
MAX_YAML_DEPTH = 32  # commbench's deepest schema (calibration: cases -> case -> value) is 3 levels
# The longest shipped value is ~100 characters (a source citation). The bound also caps what a message that
# quotes a whole value (rather than through shorten) can print.
MAX_SCALAR_CHARS = 512
ECHO_CHARS = 60  # the most of a user's value an error message quotes
_INT64_MAX = (1 << 63) - 1

_CORE = "tag:yaml.org,2002:"
_PLAIN_TAGS = {_CORE + name for name in ("str", "int", "float", "bool", "null", "seq", "map")}

_echo = reprlib.Repr()
_echo.maxlevel, _echo.maxlist, _echo.maxdict, _echo.maxtuple, _echo.maxset = 2, 4, 4, 4, 4
_echo.maxstring, _echo.maxother, _echo.maxlong = ECHO_CHARS, ECHO_CHARS, ECHO_CHARS


def shorten(value: object, limit: int = ECHO_CHARS) -> str:
    """``repr(value)`` cut to about ``limit`` characters, at a bounded cost for any value (a huge integer, a
    deep or self-referencing structure): what an error message may quote of a user's value."""
    if isinstance(value, int) and not isinstance(value, bool) and value.bit_length() > 200:
        # repr() of a 5000-digit int raises (sys.set_int_max_str_digits); the size is what matters anyway.
        return f"an integer of about {int(value.bit_length() * 0.30103)} digits"
    try:
        text = _echo.repr(value)
    except Exception:  # a hostile __repr__ must not replace the message being built
        text = f"<{type(value).__name__}>"
    return text if len(text) <= limit else text[: limit - 3] + "..."


def kind_of(value: object) -> str:
    """A user-facing name of a YAML value's type: 'a list', 'a mapping', 'text', ..."""
    if isinstance(value, dict):
        return "a mapping"
    if isinstance(value, list):
        return "a list"
    if isinstance(value, str):
        return "text"
    if isinstance(value, bool):
        return "a boolean"
    if value is None:
        return "nothing (null)"
    return "a number" if isinstance(value, int | float) else type(value).__name__


def show_path(path: str | os.PathLike[str], limit: int = 3 * ECHO_CHARS) -> str:
    """A path as a message shows it: its last ``limit`` characters (the file name matters most)."""
    text = clip(os.fspath(path), limit=10 * limit)
    return text if len(text) <= limit else "..." + text[-(limit - 3) :]


def read_user_text(path: str | os.PathLike[str], what: str, max_bytes: int = MAX_YAML_BYTES) -> str:
    """The UTF-8 text of a regular file of at most ``max_bytes``; a one-line UsageError otherwise (missing,
    a folder or device, unreadable, too big, not UTF-8). ``what`` names the file, e.g. "model file"."""
    return decode_user_text(read_user_bytes(path, what, max_bytes), f"{what} {show_path(path)}")


def read_user_bytes(path: str | os.PathLike[str], what: str, max_bytes: int) -> bytes:
    """A regular file's bytes, at most ``max_bytes`` of them read (never blocks on a FIFO or reads a device
    without end); UsageError naming the file otherwise."""
    where = f"{what} {show_path(path)}"
    try:
        # O_NONBLOCK: opening a FIFO must not wait for a writer; it has no effect on a regular file.
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    except FileNotFoundError:
        raise UsageError(f"{where} not found; check the path") from None
    except PermissionError:
        raise UsageError(f"{where} cannot be read (permission denied); check its permissions") from None
    except OSError as exc:
        raise UsageError(f"{where} cannot be opened ({exc.strerror or type(exc).__name__})") from None
    except ValueError:  # a NUL character in the path
        raise UsageError(f"{where} is not a valid path; check it") from None
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        os.close(fd)
        if stat.S_ISDIR(mode):
            raise UsageError(f"{where} is a folder; pass a file")
        raise UsageError(f"{where} is not a regular file (a device, pipe or socket); pass a file")
    with os.fdopen(fd, "rb") as handle:
        try:
            data = handle.read(max_bytes + 1)  # one byte more tells "too big" without reading the rest
        except OSError as exc:
            raise UsageError(f"{where} cannot be read ({exc.strerror or type(exc).__name__})") from None
    if len(data) > max_bytes:
        raise UsageError(
            f"{where} is larger than {_size(max_bytes)}, the limit for this file; is it the right file?"
        )
    return data


def decode_user_text(data: bytes, where: str) -> str:
    """UTF-8 (a leading byte-order mark allowed) or a one-line UsageError naming the first bad byte."""
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        raise UsageError(
            f"{where} is not UTF-8 text (byte 0x{data[exc.start]:02x} at offset {exc.start}); "
            "save it as UTF-8"
        ) from None


# A JSON text's values (commas + 1) before it is parsed: json.loads builds an object per value, and 500 MiB of
# "{}," would take tens of GB. A torch.profiler trace of 512 MiB holds ~20-30M values.
MAX_JSON_VALUES = 32_000_000


def inflate_gzip(data: bytes, limit: int, where: str) -> bytes:
    """A gzip file's content (every member), refused past ``limit`` bytes before more is inflated (a gzip
    bomb stops there); UsageError naming the file for broken or cut data."""
    out: list[bytes] = []
    size = 0
    while data:
        inflater = zlib.decompressobj(wbits=31)
        try:
            out.append(inflater.decompress(data, limit + 1 - size))
        except zlib.error as exc:
            raise UsageError(f"{where}: broken gzip data ({clip(str(exc))})") from None
        size += len(out[-1])
        if size > limit:
            raise UsageError(f"{where}: more than {_size(limit)} once decompressed, the limit for this file")
        if not inflater.eof:
            raise UsageError(f"{where}: the gzip data is cut short (a truncated file?); copy it again")
        data = inflater.unused_data
    return b"".join(out)


def read_maybe_gzip(path: str | os.PathLike[str], what: str, max_bytes: int) -> tuple[bytes, str]:
    """(a file's bytes, inflated when it is gzip by its magic bytes, each bounded by ``max_bytes``; the
    "<what> <path>" its errors name it by)."""
    where = f"{what} {show_path(path)}"
    data = read_user_bytes(path, what, max_bytes)
    if data[:2] == b"\x1f\x8b":
        data = inflate_gzip(data, max_bytes, where)
    return data, where


def check_json_values(data: bytes | str, where: str, limit: int = MAX_JSON_VALUES) -> None:
    """UsageError when a JSON text holds more than ``limit`` values (counted by its separators), before
    anything is parsed: the bytes bound alone does not bound the objects a parser builds."""
    separators = data.count(b"," if isinstance(data, bytes) else ",")
    if separators >= limit:
        raise UsageError(
            f"{where} holds more than {limit:,} JSON values, the limit for this file; is it the right file?"
        )


def _size(count: int) -> str:
    return f"{count >> 20} MiB" if count >= 1 << 20 and not count % (1 << 20) else f"{count} bytes"


class _Refused(Exception):
    """A limit of the bounded loader was hit at ``mark`` (a yaml Mark, or None)."""

    def __init__(self, problem: str, mark: Any = None) -> None:
        super().__init__(problem)
        self.problem, self.mark = problem, mark


def _out_of_range(text: str) -> str:
    return f"integer {shorten(text)} is out of range (at most 2^63 - 1); check the value"


class _PlainResolver(Resolver):
    """YAML 1.1 implicit types minus dates, merge keys and '=' (read as text): none is a commbench value."""


_PlainResolver.yaml_implicit_resolvers = {
    first: [(tag, regexp) for tag, regexp in resolvers if tag.startswith(_CORE) and tag in _PLAIN_TAGS]
    for first, resolvers in Resolver.yaml_implicit_resolvers.items()
}


class _BoundedLoader(Reader, Scanner, Parser, Composer, SafeConstructor, _PlainResolver):
    """PyYAML's safe loader with the node, depth, tag, integer and duplicate-key limits of this module."""

    def __init__(self, text: str) -> None:
        Reader.__init__(self, text)
        Scanner.__init__(self)
        Parser.__init__(self)
        Composer.__init__(self)
        SafeConstructor.__init__(self)
        _PlainResolver.__init__(self)
        self.expanded_nodes = 0
        self.depth = 0
        self.sizes: dict[int, int] = {}  # id(node) -> its expanded size, once composed

    def _count(self, nodes: int, mark: Any) -> None:
        self.expanded_nodes += nodes
        if self.expanded_nodes > MAX_YAML_NODES:
            raise _Refused(
                f"more than {MAX_YAML_NODES} values (an alias *name counts as all it stands for); "
                "commbench's files hold a few dozen: is it the right file?",
                mark,
            )

    def compose_node(self, parent: Node | None, index: Any) -> Node:
        if self.check_event(AliasEvent):
            event = self.peek_event()
            target = self.anchors.get(event.anchor)
            if target is not None:
                size = self.sizes.get(id(target))
                if size is None:  # the anchor's node is still being composed: the alias is inside it
                    raise _Refused(f"alias *{shorten(event.anchor)[1:-1]} refers to itself", event.start_mark)
                self._count(size, event.start_mark)
            return super().compose_node(parent, index)  # an unknown alias: PyYAML's own error
        mark = self.peek_event().start_mark
        self.depth += 1
        if self.depth > MAX_YAML_DEPTH:
            raise _Refused(f"nested more than {MAX_YAML_DEPTH} levels deep", mark)
        before = self.expanded_nodes
        self._count(1, mark)
        node = super().compose_node(parent, index)
        self.depth -= 1
        if node.tag not in _PLAIN_TAGS:
            raise _Refused(
                f"tag {shorten(node.tag.replace(_CORE, '!!', 1))} is not accepted (only plain text, "
                "numbers, booleans, lists and maps); remove the tag",
                node.start_mark,
            )
        self.sizes[id(node)] = self.expanded_nodes - before
        return node

    def construct_scalar(self, node: ScalarNode) -> Any:
        if isinstance(node, ScalarNode) and len(node.value) > MAX_SCALAR_CHARS:  # checked here: names the key
            raise _Refused(f"a value longer than {MAX_SCALAR_CHARS} characters; shorten it", node.start_mark)
        return super().construct_scalar(node)

    def construct_yaml_int(self, node: ScalarNode) -> int:
        digits = node.value.lstrip("+-").replace("_", "")
        if len(digits) > 40:  # refuse before int() parses it (and before Python's 4300-digit limit)
            raise _Refused(_out_of_range(node.value), node.start_mark)
        value = super().construct_yaml_int(node)
        if abs(value) > _INT64_MAX:
            raise _Refused(_out_of_range(node.value), node.start_mark)
        return value

    def construct_mapping(self, node: MappingNode, deep: bool = False) -> dict[Any, Any]:
        if not isinstance(node, MappingNode):
            raise ConstructorError(
                None, None, f"expected a mapping node, but found {node.id}", node.start_mark
            )
        mapping: dict[Any, Any] = {}
        for key_node, value_node in node.value:
            key = self.construct_object(key_node, deep=deep)
            try:
                hash(key)
            except TypeError:
                raise _Refused(
                    "a list or mapping used as a key; keys are names", key_node.start_mark
                ) from None
            if key in mapping:
                raise _Refused(f"key {shorten(key)} appears twice; keep one", key_node.start_mark)
            try:
                mapping[key] = self.construct_object(value_node, deep=deep)
            except _Refused as exc:
                if isinstance(key, str) and not exc.problem.startswith("key "):  # name the key once
                    exc.problem = f"key {shorten(key)}: {exc.problem}"
                raise
        return mapping


# Constructors are looked up by tag in a class table, not by method name: register the bounded one.
_BoundedLoader.add_constructor(_CORE + "int", _BoundedLoader.construct_yaml_int)


def _line(mark: Any) -> str:
    return f" at line {mark.line + 1}" if mark is not None and getattr(mark, "line", None) is not None else ""


def load_yaml(text: str, origin: str) -> Any:
    """Parse one YAML document under the limits of this module; ``None`` for an empty document. Every
    problem is a one-line UsageError starting with ``origin`` (e.g. "model file my.yaml")."""
    if len(text) > MAX_YAML_BYTES:  # text given directly; files are bounded when read
        raise UsageError(f"{origin}: larger than {_size(MAX_YAML_BYTES)}, the limit for YAML input")
    loader = None
    try:
        loader = _BoundedLoader(text)  # the reader refuses control characters here already
        return loader.get_single_data()
    except _Refused as exc:
        raise UsageError(f"{origin}{_line(exc.mark)}: {exc.problem}") from None
    except yaml.reader.ReaderError as exc:
        raise UsageError(
            f"{origin}: bad YAML: character {_codepoint(exc.character)} at offset {exc.position} is "
            "not allowed in YAML text; remove it"
        ) from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None) or getattr(exc, "context_mark", None)
        # "while parsing a flow sequence, expected ',' or ']'": PyYAML's words quote at most a token.
        words = [getattr(exc, "context", None), getattr(exc, "problem", None) or "invalid YAML"]
        problem = clip(", ".join(word for word in words if word), limit=2 * ECHO_CHARS)
        raise UsageError(f"{origin}: bad YAML{_line(mark)} ({problem}); fix the file's syntax") from None
    # A scalar PyYAML's constructors cannot convert (RecursionError: cannot happen under MAX_YAML_DEPTH).
    except (ValueError, OverflowError, RecursionError) as exc:
        raise UsageError(f"{origin}: bad YAML value ({clip(str(exc))}); fix the value") from None
    finally:
        if loader is not None:
            loader.dispose()


def load_package_yaml(package: str, name: str) -> Any:
    """A YAML file shipped inside ``package`` (package data such as the fabric model's published figures,
    never a path a user names): PyYAML's safe loader, in C where built, ``{}`` when the file is not shipped.
    The one YAML parse outside the bounded loader: shipped files are reviewed with the code, and the
    largest (published.yaml, ~20,000 values) would take seconds under the bounded pure-Python loader."""
    from importlib import resources

    file = resources.files(package).joinpath(name)
    if not file.is_file():
        return {}
    loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
    return yaml.load(file.read_text(encoding="utf-8"), Loader=loader) or {}  # noqa: S506 (a safe loader)


def load_json(
    path: str | os.PathLike[str], what: str, max_bytes: int, hint: str, prefix: str = ""
) -> tuple[Any, str]:
    """(the parsed JSON of a user's file, the "<what> <path>" its errors name it by): read bounded and as
    UTF-8; a file that does not parse is a one-line UsageError, ``prefix`` first and ``hint`` (what to do)
    last."""
    where = f"{what} {show_path(path)}"
    text = decode_user_text(read_user_bytes(path, what, max_bytes), where)
    try:
        return json.loads(text), where
    except json.JSONDecodeError as exc:
        problem = f"not valid JSON ({exc.msg} at line {exc.lineno} column {exc.colno})"
    except (ValueError, RecursionError) as exc:  # a 5000-digit number, nesting deeper than Python's stack
        problem = clip(str(exc) or type(exc).__name__)
    raise UsageError(f"{prefix}{where}: {problem}; {hint}")


def _codepoint(character: int | str) -> str:
    """U+0000 for PyYAML's ReaderError.character (an int for text input, a str for bytes)."""
    return f"U+{character:04X}" if isinstance(character, int) else clip(repr(character))


def clip(text: str, limit: int = ECHO_CHARS) -> str:
    """Plain text cut to ``limit`` characters, control characters escaped: one line, bounded."""
    shown = "".join(char if char.isprintable() else repr(char)[1:-1] for char in text[: limit + 1])
    return shown if len(shown) <= limit else shown[: limit - 3] + "..."


def describe_keys(keys: Iterable[object], limit: int = 8) -> str:
    """Up to ``limit`` key names, each shortened, joined by commas ('... (N more)' after that)."""
    names = [
        key if isinstance(key, str) and key.isprintable() and len(key) <= ECHO_CHARS else shorten(key)
        for key in keys
    ]
    shown = ", ".join(names[:limit])
    return shown + (f", ... ({len(names) - limit} more)" if len(names) > limit else "")


def load_yaml_mapping(text: str, origin: str, keys: Iterable[str]) -> dict[str, Any]:
    """A YAML document that must be a flat mapping of ``keys`` (a subset) to single values (text, numbers,
    booleans, null): the shape of model and spec files. UsageError naming ``origin`` and the key otherwise."""
    accepted = list(keys)
    data = load_yaml(text, origin)
    if data is None:
        raise UsageError(
            f"{origin}: is empty; write one 'key: value' line per setting ({describe_keys(accepted, 4)})"
        )
    if not isinstance(data, dict):
        raise UsageError(
            f"{origin}: expected a mapping of keys to values ({describe_keys(accepted, 4)}), "
            f"got {kind_of(data)}"
        )
    unknown = [key for key in data if key not in accepted]
    if unknown:
        raise UsageError(
            f"{origin}: unknown key(s) {describe_keys(unknown)}; accepted: {', '.join(accepted)}"
        )
    for key, value in data.items():
        if isinstance(value, dict | list):
            raise UsageError(
                f"{origin}: {key} must be a single value, got {kind_of(value)} {shorten(value)}; "
                f"write '{key}: VALUE'"
            )
    return data
