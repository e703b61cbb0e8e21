"""Response redaction: e-mail addresses, phone numbers, payment cards (Luhn), IBANs
(mod-97), PRC resident ID numbers (18 digits, ISO 7064 check character) and US SSNs,
masked in place keeping the last 4 letters/digits ("****-****-****-1234").

Masks replace ASCII letters and digits with "*", so a body keeps its length (and its
Content-Length) and JSON stays JSON: only the insides of JSON strings are searched
(never numbers or keys' syntax). An escape sequence is read as the character it stands
for (`\u0040` is "@", `\u00a0` a space), and one that stands for a masked character is
masked whole (`\u0034` becomes `******`). Text is read as a reader sees it: a
non-ASCII character whose NFKC form is ASCII as that form (a fullwidth "４" is "4", "＠"
is "@", a no-break space a space), an invisible one (zero-width space, soft hyphen, BOM,
...: Unicode's default-ignorable code points) as nothing; a masked character's bytes are
all masked ("４" becomes "***"), the rest of the text is left as it was.

Streams: a token stream's text arrives split over events (OpenAI-style deltas) or
lines (NDJSON, as Ollama streams), so the string values of content keys ("content",
"text", "delta", "arguments", Anthropic's "thinking" and "partial_json", ...) are read
as running text across them; other strings
are read one by one. There is one running text per channel: the values of the "index"
keys of the objects around a string (OpenAI's choices[].index with n>1, whose events
alternate between choices; Anthropic's content block index; a tool call's index), so
interleaved texts are each read whole. An event stream is read line by line: only the
values of data: fields are read, a value that starts with "{", "[" or '"' as JSON (a
bare JSON string is content), any other as plain text: the plain data of all events is
one more running text (the data: lines of one event joined with "\n", as a client
joins them). What could still become a match (a partial match at the end, or a match
that could grow) is held back from its first byte; everything before it goes out at
once. Nothing else waits.
"""

from __future__ import annotations

import unicodedata
from bisect import bisect_right
from functools import lru_cache
from operator import attrgetter
from typing import Any

import regex

# Anthropic streams thinking in thinking_delta events and a tool call's input, a JSON
# text cut anywhere, in input_json_delta's partial_json (as OpenAI's arguments).
CONTENT_KEYS = frozenset((b"content", b"text", b"delta", b"arguments", b"output_text",
                          b"reasoning_content", b"refusal", b"transcript", b"thinking",
                          b"partial_json"))
MAX_HOLD = 64 * 1024  # a bound on held bytes, whatever a pattern could still become
TAIL = 512  # longer than any match of the patterns below

# Each detector: a pattern (bounded, so a partial match cannot run forever) and a check.
PATTERNS: dict[str, bytes] = {
    "card": rb"(?<![\w])(?:\d[ -]?){12,18}\d(?![\w])",
    "iban": rb"(?<![\w])[A-Z]{2}\d{2}(?:[ ]?[A-Z0-9]){11,30}(?![\w])",
    "prc_id": rb"(?<![\w])\d{17}[\dXx](?![\w])",
    "us_ssn": rb"(?<![\w-])(?!000|666|9\d\d)\d{3}-(?!00)\d{2}-(?!0000)\d{4}(?![\w-])",
    "email": rb"(?<![\w.%+-])[A-Za-z0-9._%+-]{1,64}@[A-Za-z0-9-]{1,63}(?:\.[A-Za-z0-9-]{1,63})"
             rb"{0,4}\.[A-Za-z]{2,24}(?![\w])",
    "phone": rb"(?<![\w+])(?:\+\d{1,3}[ .-]?)?(?:\(\d{1,4}\)[ .-]?)?\d{2,4}(?:[ .-]?\d{2,4})"
             rb"{1,4}(?![\w])",
}
ORDER = ("card", "iban", "prc_id", "us_ssn", "email", "phone")
_ALNUM = frozenset(b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789")
_ESCAPE = regex.compile(rb"\\(?:u[0-9a-fA-F]{4}|[^u])")
_ESCAPE_START = regex.compile(rb"\\(?:u[0-9a-fA-F]{0,3})?")  # what more bytes may complete
_SIMPLE_ESCAPES = {ord("n"): b"\n", ord("t"): b"\t", ord("r"): b"\r", ord("b"): b" ",
                   ord("f"): b" ", ord("/"): b"/", ord("\\"): b"\\", ord('"'): b'"'}
_SSE_FIELDS = (b"data:", b"event:", b"id:", b"retry:", b":")  # how an event stream starts
_PRC_WEIGHTS = (7, 9, 10, 5, 8, 4, 2, 1, 6, 3, 7, 9, 10, 5, 8, 4, 2)
_NON_ASCII = regex.compile(rb"[\x80-\xff]+")

# Unicode's Default_Ignorable_Code_Point set (DerivedCoreProperties.txt): invisible
# characters (zero-width, bidi controls, variation selectors, tags, fillers, ...) that a
# reader (or a model's tokenizer) reads past.
_IGNORABLE = ((0x00AD, 0x00AD), (0x034F, 0x034F), (0x061C, 0x061C), (0x115F, 0x1160),
              (0x17B4, 0x17B5), (0x180B, 0x180F), (0x200B, 0x200F), (0x202A, 0x202E),
              (0x2060, 0x206F), (0x3164, 0x3164), (0xFE00, 0xFE0F), (0xFEFF, 0xFEFF),
              (0xFFA0, 0xFFA0), (0xFFF0, 0xFFF8), (0x1BCA0, 0x1BCA3), (0x1D173, 0x1D17A),
              (0xE0000, 0xE0FFF))
INVISIBLE = dict.fromkeys(cp for lo, hi in _IGNORABLE for cp in range(lo, hi + 1))


@lru_cache(maxsize=4096)
def fold(ch: str) -> bytes | None:
    """What a non-ASCII character reads as: nothing (invisible), its NFKC form where
    that is ASCII (fullwidth "４" is "4", a no-break space a space), else None (itself:
    no pattern matches it)."""
    if ord(ch) in INVISIBLE:
        return b""
    norm = unicodedata.normalize("NFKC", ch)
    return norm.encode("ascii") if norm.isascii() else None


def _unescape(seq: bytes) -> bytes:
    """What a JSON escape reads as here: its ASCII character, a non-ASCII one folded
    (fold), else NUL (matches nothing)."""
    if seq[1] == 0x75:  # \uXXXX
        cp = int(seq[2:6], 16)
        if cp < 0x80:
            return bytes((cp,))
        folded = fold(chr(cp))
        return b"\x00" if folded is None else folded
    return _SIMPLE_ESCAPES.get(seq[1], b"\x00")


def luhn(digits: bytes) -> bool:
    total = 0
    for i, ch in enumerate(reversed(digits)):
        d = ch - 48
        if i % 2:
            d = d * 2 - 9 if d > 4 else d * 2
        total += d
    return total % 10 == 0


def iban_ok(text: bytes) -> bool:
    s = text.replace(b" ", b"")
    if not 15 <= len(s) <= 34:
        return False
    s = s[4:] + s[:4]
    n = "".join(str(c - 55) if c >= 65 else chr(c) for c in s)
    return int(n) % 97 == 1


def prc_id_ok(text: bytes) -> bool:
    total = sum((c - 48) * w for c, w in zip(text[:17], _PRC_WEIGHTS, strict=True))
    return b"10X98765432"[total % 11] == text[17:18].upper()[0]


def _digits(text: bytes) -> bytes:
    return bytes(c for c in text if 48 <= c <= 57)


CHECKS = {
    "card": lambda t: 13 <= len(_digits(t)) <= 19 and luhn(_digits(t)),
    "iban": iban_ok,
    "prc_id": prc_id_ok,
    "us_ssn": lambda t: True,
    "email": lambda t: True,
    "phone": lambda t: 10 <= len(_digits(t)) <= 15,
}


def compile_detector(kinds: tuple[str, ...]) -> tuple[Any, tuple[str, ...]]:
    names = tuple(k for k in ORDER if k in kinds)
    combined = b"|".join(b"(?P<%s>%s)" % (k.encode(), PATTERNS[k]) for k in names)
    return regex.compile(combined), names


_SINGLE = {k: regex.compile(PATTERNS[k]) for k in ORDER}
_STARTS = regex.compile(rb"(?<![A-Za-z0-9_])(?=[A-Za-z0-9_+(])")  # where a match can begin


def classify(text: bytes, names: tuple[str, ...], first: str) -> str | None:
    """The type a candidate really is: the alternative that matched, if its check
    passes, else another type that matches the same text and passes its check."""
    if CHECKS[first](text):
        return first
    for k in names:
        if k != first and _SINGLE[k].fullmatch(text) and CHECKS[k](text):
            return k
    return None


# Where a JSON string value is read as running text (stream modes): its channel is the
# "index" values of the objects around it, so choices (OpenAI n>1), content blocks
# (Anthropic) and tool calls are each their own text. Plain-text data: lines are one more.
MAX_INDEXES = 8  # "index" keys kept per nesting (more is no real stream)
MAX_CHANNELS = 64  # channels whose last character is remembered
TEXT_CHANNEL = None
VIRTUAL_NL = -1  # a segment (pos, VIRTUAL_NL): the "\n" that joins two data: lines
# SSE line states
LINE, FIELD, VALUE, PAYLOAD, JSON, TEXT, SKIP = range(7)
_STATE = ("in_str", "content", "last_str", "colon", "depth", "indexes", "num", "key",
          "line", "field", "cr", "pending")
_GET_STATE = attrgetter(*_STATE)


class Redactor:
    """One response body. mode: "json" (every string by itself), "ndjson" (content
    strings as running texts across lines), "sse" (an event stream: the same across
    events for data: lines holding JSON; data: lines holding anything else are text),
    "text" (the whole body is text), "auto" (one of json, sse and text, as the first
    bytes tell: a response with no Content-Type)."""

    __slots__ = ("pattern", "names", "mode", "buf", "counts", "ctx", *_STATE)

    def __init__(self, detector: tuple[Any, tuple[str, ...]], mode: str) -> None:
        self.pattern, self.names = detector
        self.mode = mode
        self.buf = b""
        self.in_str = mode == "text"
        self.content = mode == "text"
        self.last_str: bytes | None = None  # the last closed string (a key, if ':' follows)
        self.colon = False
        self.depth = 0  # JSON nesting
        self.indexes: tuple[tuple[int, bytes], ...] = ()  # (depth, value) of "index" keys
        self.num: bytes | None = None  # an "index" value being read
        self.key: Any = ()  # the channel of the open content string
        self.line = LINE
        self.field = b""  # an SSE field name being read
        self.cr = False  # the last line ended with CR: an LF next is part of it
        self.pending = False  # a data: line of this event ended: the next one adds "\n"
        self.ctx: dict[Any, bytes] = {}  # channel -> its last character sent
        self.counts: dict[str, int] = {}

    def feed(self, data: bytes) -> bytes:
        if self.mode == "auto" and not self._sniff(self.buf + data, False):
            return b""
        return self._run(self.buf + data, False)

    def end(self) -> bytes:
        if self.mode == "auto":
            self._sniff(self.buf, True)
        return self._run(self.buf, True) if self.buf else b""

    def _sniff(self, data: bytes, final: bool) -> bool:
        """Mode "auto" (a response with no Content-Type): the mode its first bytes
        tell, JSON, an event stream or text; False (data held) while they cannot yet."""
        start = data.lstrip(b" \t\r\n")
        mode = "json" if start[:1] in (b"{", b"[", b'"') else "text"
        for field in _SSE_FIELDS:
            if start.startswith(field):
                mode = "sse"
            elif field.startswith(start) and not final:
                self.buf = data
                return False
        self.mode = mode
        self.in_str = self.content = mode == "text"
        return True

    # -- scanning ---------------------------------------------------------------------------

    def _strings(self, buf: bytes) -> tuple[dict[Any, list[tuple[int, int]]],
                                            list[list[tuple[int, int]]], int | None]:
        """(content segments by channel, other strings' segments, position of an escape
        cut short at the end). Updates the scanner state to the end of buf."""
        n = len(buf)
        if self.mode == "text":
            return {TEXT_CHANNEL: [(0, n)]}, [], None
        content: dict[Any, list[tuple[int, int]]] = {}
        others: list[list[tuple[int, int]]] = []
        if self.mode != "sse":
            return content, others, self._json(buf, 0, n, content, others)
        i = 0
        while i < n:
            if self.cr:
                self.cr = False
                if buf[i] == 0x0A:
                    i += 1
                    continue
            eol = buf.find(b"\n", i)
            if eol < 0:
                eol = n
            cr = buf.find(b"\r", i, eol)  # a CR alone ends a line too
            if cr >= 0:
                eol = cr
            line = self.line
            if line == LINE or line == FIELD:
                if line == LINE and eol == i:  # a blank line ends the event
                    self.pending = False
                c = buf.find(b":", i, eol)
                if c < 0:
                    self.field = (self.field + buf[i:eol])[:8]
                    line = FIELD if eol > i else LINE
                else:
                    name = self.field + buf[i:c]
                    self.field = b""
                    line = SKIP
                    if name == b"data":
                        line = VALUE
                        if self.pending:  # data: lines of one event join with "\n"
                            content.setdefault(TEXT_CHANNEL, []).append((c, VIRTUAL_NL))
                            self.pending = False
                    i = c + 1
            if line == VALUE and i < eol:
                line = PAYLOAD
                if buf[i] == 0x20:  # the one space after "data:" is syntax
                    i += 1
            if line == PAYLOAD:
                j = i
                while j < eol and buf[j] in b" \t":
                    j += 1
                if j > i:
                    content.setdefault(TEXT_CHANNEL, []).append((i, j))
                i = j
                if j < eol:
                    line = JSON if buf[j] in b'{["' else TEXT
                    if line == JSON:
                        self._reset_json()
            self.line = line
            if line == JSON:
                cut = self._json(buf, i, eol, content, others)
                if cut is not None:
                    return content, others, cut
            elif line == TEXT and eol > i:
                content.setdefault(TEXT_CHANNEL, []).append((i, eol))
            if eol >= n:
                break
            if line != LINE and line != FIELD and line != SKIP:
                self.pending = True
            self._reset_json()
            self.line = LINE
            self.field = b""
            i = eol + 1
            if buf[eol] == 0x0D:
                if i < n and buf[i] == 0x0A:
                    i += 1
                elif i >= n:
                    self.cr = True
        return content, others, None

    def _reset_json(self) -> None:
        self.in_str = self.content = self.colon = False
        self.last_str = self.num = None
        self.depth = 0
        self.indexes = ()

    def _json(self, buf: bytes, i: int, n: int, content: dict[Any, list[tuple[int, int]]],
              others: list[list[tuple[int, int]]]) -> int | None:
        """Scan JSON from i to n (the end of buf, or of an SSE line) into content and
        others; the position of an escape cut short by the end of buf."""
        in_str, is_content = self.in_str, self.content
        last_str, colon, key = self.last_str, self.colon, self.key
        depth, indexes, num = self.depth, self.indexes, self.num
        start = i
        cut = None
        joined = self.mode != "json"
        while i < n:
            if in_str:
                q = buf.find(b'"', i, n)
                b = buf.find(b"\\", i, q if q >= 0 else n)
                if b >= 0:
                    if b + 1 >= n or (buf[b + 1] == 0x75 and b + 6 > n):
                        cut = b
                        break
                    i = b + (6 if buf[b + 1] == 0x75 else 2)
                    continue
                if q < 0:
                    break
                seg = (start, q)
                (content.setdefault(key, []).append(seg) if is_content
                 else others.append([seg]))
                last_str = buf[start:q] if q - start <= 32 else None
                colon = False
                in_str = False
                i = q + 1
            elif num is not None:  # the digits of an "index" value
                j = i
                while j < n and 0x30 <= buf[j] <= 0x39:
                    j += 1
                num += buf[i:j]
                i = j
                if i >= n:
                    break
                # Entries are by rising depth: only the last can be this object's.
                if indexes and indexes[-1][0] == depth:
                    indexes = indexes[:-1]
                if len(indexes) < MAX_INDEXES and len(num) <= 20:
                    indexes = (*indexes, (depth, num))
                num = None
            else:
                while i < n and buf[i] in b" \t\r\n":
                    i += 1
                if i >= n:
                    break
                c = buf[i]
                if c == 0x22:  # a string starts: a content value if `"content":` came before
                    is_content = joined and ((colon and last_str in CONTENT_KEYS)
                                             or depth == 0)
                    if is_content:
                        key = tuple(v for _, v in indexes) if indexes else ()
                    in_str = True
                    start = i + 1
                elif c == 0x3A:  # ':'
                    colon = last_str is not None
                else:
                    if joined:
                        if c == 0x7B or c == 0x5B:  # '{' '['
                            depth += 1
                        elif c == 0x7D or c == 0x5D:  # '}' ']'
                            if indexes and indexes[-1][0] == depth:
                                indexes = indexes[:-1]
                            depth = max(0, depth - 1)
                        elif colon and last_str == b"index" and 0x30 <= c <= 0x39:
                            num = b""
                            colon = False
                            continue
                    colon = False
                    if c != 0x5B:  # '[' keeps the key ("content": [...] parts are texts)
                        last_str = None if c in b",{}" else last_str
                i += 1
        if in_str:
            seg = (start, cut if cut is not None else n)
            (content.setdefault(key, []).append(seg) if is_content
             else others.append([seg]))
        self.in_str, self.content = in_str, is_content
        self.last_str, self.colon, self.key = last_str, colon, key
        self.depth, self.indexes, self.num = depth, indexes, num
        return cut if n == len(buf) else None

    def _run(self, buf: bytes, final: bool) -> bytes:
        state = _GET_STATE(self)
        content, others, cut = self._strings(buf)
        out = bytearray(buf)
        n = len(buf)
        hold = n if (final or cut is None) else cut
        channels = []
        for key, segs in content.items():
            h, text, runs = self._scan(buf, out, segs, self.mode != "json" and not final,
                                       self.ctx.get(key, b""))
            hold = min(hold, h)
            channels.append((key, text, runs))
        for segs in others:
            open_ = segs[-1][1] == n or (cut is not None and segs[-1][1] == cut)
            hold = min(hold, self._scan(buf, out, segs, open_ and not final, b"")[0])
        if not final and n - hold > MAX_HOLD:
            hold = n - MAX_HOLD
        for key, text, runs in channels:
            self._remember(key, text, runs, hold)
        if hold >= n:
            self.buf = b""
            return bytes(out)
        # Rescan from the hold point next time: restore the scanner state there (inside
        # the string the hold point is in).
        self.buf = bytes(out[hold:])
        for name, value in zip(_STATE, state, strict=True):
            setattr(self, name, value)
        self._strings(buf[:hold])  # replays the state up to the hold point
        return bytes(out[:hold])

    def _remember(self, key: Any, text: bytes, runs: list[tuple[int, int, int, bool]],
                  hold: int) -> None:
        """Keep the channel's last character sent (before hold): a rescan that starts
        inside the channel's text reads it as what came before (for lookbehinds)."""
        for j in range(len(runs) - 1, -1, -1):
            vs, bs, be, atomic = runs[j]
            if bs < hold:
                # An atomic run's text ends where the next run's starts.
                at = ((runs[j + 1][0] if j + 1 < len(runs) else len(text)) - 1 if atomic
                      else vs + min(be, hold) - bs - 1)
                last = text[at:at + 1]
                ctx = self.ctx
                ctx.pop(key, None)
                ctx[key] = last
                if len(ctx) > MAX_CHANNELS:
                    del ctx[next(iter(ctx))]
                return

    def _scan(self, buf: bytes, out: bytearray, segs: list[tuple[int, int]], open_: bool,
              ctx: bytes) -> tuple[int, bytes, list[tuple[int, int, int, bool]]]:
        """Mask the complete matches of one channel (ctx: the character before its
        text, already sent); (the buffer position to hold from, its text, its runs)."""
        pieces = [ctx]
        # Runs of the text searched: (text offset, buffer start, buffer end, atomic). A
        # plain run maps byte for byte; an atomic one (an escape, a folded character)
        # stands for its whole sequence, whatever text it reads as.
        runs: list[tuple[int, int, int, bool]] = []
        base = v = len(ctx)
        n = cut = len(buf)  # cut: where a character cut short by the end of buf starts
        for s, e in segs:
            if e == VIRTUAL_NL:
                pieces.append(b"\n")
                runs.append((v, s, s, True))
                v += 1
                continue
            i = s
            if buf.find(b"\\", s, e) >= 0:
                for m in _ESCAPE.finditer(buf, s, e):
                    ms, me = m.span()
                    if ms > i:
                        v, cut = _plain(buf, i, ms, pieces, runs, v, cut)
                    folded = _unescape(m.group())
                    if folded:
                        pieces.append(folded)
                        runs.append((v, ms, me, True))
                        v += len(folded)
                    i = me
                if open_ and e == n:
                    # An escape the end of buf cuts short (`\`, `\u`, `\u00`; JSON
                    # strings hold theirs in _strings): left out of the text and held,
                    # as a character cut short is.
                    k = buf.rfind(b"\\", max(i, e - 5), e)
                    if k >= 0 and _ESCAPE_START.fullmatch(buf, k, e):
                        e = cut = k
            if e > i:
                v, cut = _plain(buf, i, e, pieces, runs, v, cut)
        text = b"".join(pieces)
        if len(text) == base:
            return (cut if open_ else len(buf)), text, runs
        starts = [r[0] for r in runs]

        def run_of(vi: int) -> tuple[int, int, int, bool]:
            return runs[max(0, bisect_right(starts, vi) - 1)]

        def pos(vi: int) -> int:
            vs, bs, _, atomic = run_of(vi)
            return bs if atomic else bs + vi - vs

        end = len(text)
        hold_v = end
        if open_:
            # The earliest start of anything the coming bytes could still make (or grow)
            # a match of: a position where the rest of the text is a viable prefix of a
            # pattern. Patterns are bounded, so only the last TAIL bytes need a look.
            for m in _STARTS.finditer(text, max(base, end - TAIL)):
                p = m.start()
                if any(_SINGLE[k].fullmatch(text, p, partial=True) for k in self.names):
                    hold_v = p
                    break
        for m in self.pattern.finditer(text, base):
            if m.end() > hold_v:
                hold_v = min(hold_v, m.start())
                break
            kind = classify(m.group(), self.names, m.lastgroup)
            if kind is None:
                continue
            self.counts[kind] = self.counts.get(kind, 0) + 1
            alnum = [i for i in range(m.start(), m.end()) if text[i] in _ALNUM]
            for i in alnum[:-4]:
                vs, bs, be, atomic = run_of(i)
                if atomic:
                    out[bs:be] = b"*" * (be - bs)
                else:
                    out[bs + i - vs] = 0x2A  # "*"
        held = len(buf) if hold_v >= end else pos(hold_v)
        return (min(held, cut) if open_ else held), text, runs


def _plain(buf: bytes, i: int, e: int, pieces: list[bytes],
           runs: list[tuple[int, int, int, bool]], v: int, cut: int) -> tuple[int, int]:
    """Add buf[i:e], unescaped bytes, to the text at offset v: ASCII byte for byte, a
    non-ASCII character as fold reads it. (The text's new end, and cut: the start of a
    character the end of buf cuts short, which is left out of the text.)"""
    m = _NON_ASCII.search(buf, i, e)
    if m is None:  # ASCII: already NFKC, nothing invisible
        pieces.append(buf[i:e])
        runs.append((v, i, e, False))
        return v + e - i, cut
    n = len(buf)
    p = i  # start of the bytes not yet added
    while m is not None:
        k, me = m.span()
        while k < me:
            b0 = buf[k]
            size = 2 if 0xC2 <= b0 <= 0xDF else 3 if 0xE0 <= b0 <= 0xEF else \
                4 if 0xF0 <= b0 <= 0xF4 else 1
            if k + size > me and me == n:
                cut = k  # the rest of the character is still to come
                e = k
                break
            try:
                folded = fold(buf[k:k + size].decode("utf-8"))
            except UnicodeDecodeError:
                folded, size = None, 1  # not UTF-8: a byte that matches nothing
            if folded is not None:
                if k > p:
                    pieces.append(buf[p:k])
                    runs.append((v, p, k, False))
                    v += k - p
                if folded:
                    pieces.append(folded)
                    runs.append((v, k, k + size, True))
                    v += len(folded)
                p = k + size
            k += size
        m = _NON_ASCII.search(buf, me, e) if me < e else None
    if e > p:
        pieces.append(buf[p:e])
        runs.append((v, p, e, False))
        v += e - p
    return v, cut


def redact_text(data: bytes, kinds: tuple[str, ...] = ORDER, mode: str = "text"
                ) -> tuple[bytes, dict[str, int]]:
    r = Redactor(compile_detector(kinds), mode)
    out = r.feed(data) + r.end()
    return out, r.counts
