"""Map configuration key paths to 1-based line numbers in TOML source.

tomllib reports no positions, so this scans the text once: table headers, array-of-tables
headers (indexed by occurrence), dotted and quoted keys, inline tables, multi-line arrays and
strings, and comments. It assumes text that tomllib already accepted; on anything it cannot
follow it keeps what it found so far, and lookups fall back to the nearest known parent.
"""

from __future__ import annotations

import bisect
import json
import re
import tomllib

KeyPath = tuple[str | int, ...]

_BARE_KEY = re.compile(r"[A-Za-z0-9_-]+")
_SCALAR = re.compile(r"[^,\]}\r\n#]*")


def format_path(path: KeyPath) -> str:
    """``("routes", 1, "match", "path")`` -> ``routes[1].match.path``."""
    out: list[str] = []
    for part in path:
        if isinstance(part, int):
            out.append(f"[{part}]")
            continue
        key = part if _BARE_KEY.fullmatch(part) else json.dumps(part, ensure_ascii=False)
        out.append(f".{key}" if out else key)
    return "".join(out)


class Locator:
    def __init__(self, text: str) -> None:
        scanner = _Scanner(text)
        try:
            scanner.run()
        except (_ScanError, IndexError, ValueError, tomllib.TOMLDecodeError):
            pass
        self._lines = scanner.lines
        self._statements = scanner.statements

    def statement(self, line: int) -> KeyPath | None:
        """The key or table whose statement starts on `line`, if one does."""
        return self._statements.get(line)

    def line(self, path: KeyPath) -> int:
        """Line of ``path``, else of its nearest recorded parent, else 1."""
        for end in range(len(path), 0, -1):
            found = self._lines.get(path[:end])
            if found is not None:
                return found
        return 1


class _ScanError(Exception):
    pass


class _Scanner:
    def __init__(self, text: str) -> None:
        self.text = text
        self.pos = 0
        self.newlines = [m.start() for m in re.finditer("\n", text)]
        self.lines: dict[KeyPath, int] = {}
        self.statements: dict[int, KeyPath] = {}  # line -> the key or table it starts
        self.table_arrays: dict[KeyPath, int] = {}

    def lineno(self) -> int:
        return bisect.bisect_left(self.newlines, self.pos) + 1

    def run(self) -> None:
        table: KeyPath = ()
        while True:
            self.skip_space(newlines=True)
            if self.pos >= len(self.text):
                return
            if self.text.startswith("[[", self.pos):
                table = self.header(2)
            elif self.text[self.pos] == "[":
                table = self.header(1)
            else:
                self.key_value(table)

    def header(self, brackets: int) -> KeyPath:
        line = self.lineno()
        self.pos += brackets
        keys = self.read_key()
        self.pos += brackets
        path: KeyPath = ()
        for key in keys[:-1]:
            path = self.descend(path, key, line)
        path += (keys[-1],)
        self.lines.setdefault(path, line)
        if brackets == 1:
            self.lines[path] = line
            self.statements.setdefault(line, path)
            return path
        index = self.table_arrays.get(path, 0)
        self.table_arrays[path] = index + 1
        path += (index,)
        self.lines[path] = line
        self.statements.setdefault(line, path)
        return path

    def descend(self, path: KeyPath, key: str, line: int) -> KeyPath:
        path += (key,)
        self.lines.setdefault(path, line)
        count = self.table_arrays.get(path)
        return path + (count - 1,) if count else path

    def key_value(self, table: KeyPath) -> None:
        line = self.lineno()
        keys = self.read_key()
        path = table
        for key in keys[:-1]:
            path += (key,)
            self.lines.setdefault(path, line)
        path += (keys[-1],)
        self.lines[path] = line
        self.statements.setdefault(line, path)
        if self.text[self.pos] != "=":
            raise _ScanError
        self.pos += 1
        self.skip_space(newlines=False)
        self.value(path)

    def read_key(self) -> list[str]:
        keys: list[str] = []
        text = self.text
        while True:
            self.skip_space(newlines=False)
            start = self.pos
            if text[start] == '"':
                self.pos = self.basic_string_end(start)
                keys.append(tomllib.loads("k = " + text[start : self.pos])["k"])
            elif text[start] == "'":
                self.pos = text.index("'", start + 1) + 1
                keys.append(text[start + 1 : self.pos - 1])
            else:
                match = _BARE_KEY.match(text, start)
                if match is None:
                    raise _ScanError
                keys.append(match.group())
                self.pos = match.end()
            self.skip_space(newlines=False)
            if text[self.pos] != ".":
                return keys
            self.pos += 1

    def value(self, path: KeyPath) -> None:
        text, start = self.text, self.pos
        if text.startswith('"""', start):
            self.pos = self.multiline_end(start, '"""')
        elif text.startswith("'''", start):
            self.pos = self.multiline_end(start, "'''")
        elif text[start] == '"':
            self.pos = self.basic_string_end(start)
        elif text[start] == "'":
            self.pos = text.index("'", start + 1) + 1
        elif text[start] == "[":
            self.array(path)
        elif text[start] == "{":
            self.inline_table(path)
        else:
            self.pos = _SCALAR.match(text, start).end()
        if self.pos == start:
            raise _ScanError

    def array(self, path: KeyPath) -> None:
        self.pos += 1
        index = 0
        while True:
            self.skip_space(newlines=True)
            if self.text[self.pos] == "]":
                self.pos += 1
                return
            item = path + (index,)
            self.lines[item] = self.lineno()
            self.value(item)
            self.skip_space(newlines=True)
            if self.text[self.pos] == ",":
                self.pos += 1
            index += 1

    def inline_table(self, path: KeyPath) -> None:
        self.pos += 1
        while True:
            self.skip_space(newlines=True)
            char = self.text[self.pos]
            if char == "}":
                self.pos += 1
                return
            if char == ",":
                self.pos += 1
                continue
            self.key_value(path)

    def basic_string_end(self, start: int) -> int:
        text, i = self.text, start + 1
        while True:
            char = text[i]
            if char == "\\":
                i += 2
            elif char == '"':
                return i + 1
            elif char == "\n":
                raise _ScanError
            else:
                i += 1

    def multiline_end(self, start: int, quotes: str) -> int:
        text, i = self.text, start + 3
        while True:
            if quotes == '"""' and text[i] == "\\":
                i += 2
            elif text.startswith(quotes, i):
                end = i + 3
                while end < len(text) and end - i < 5 and text[end] == quotes[0]:
                    end += 1
                return end
            else:
                i += 1

    def skip_space(self, *, newlines: bool) -> None:
        text, size = self.text, len(self.text)
        while self.pos < size:
            char = text[self.pos]
            if char in " \t" or (newlines and char in "\r\n"):
                self.pos += 1
            elif char == "#":
                end = text.find("\n", self.pos)
                self.pos = size if end < 0 else end
            else:
                return
