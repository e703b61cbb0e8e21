"""`aiproxy audit verify|query`: check the hash chain, and ask questions of audit files.

query is schema-on-read: each record is flattened to dotted names (identity.sub,
timings_ms.total); a field a record lacks is null; a field seen with values of more
than one type (numbers in some records, strings in others) is compared as a string
everywhere, so a drifting schema never makes a filter silently skip records.
"""

from __future__ import annotations

import json
import re
import sys
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from typing import Any, TextIO

from aiproxy.governance.audit import GENESIS, ROTATED_SUFFIX, line_hash

# -- verify -------------------------------------------------------------------------------------


def _first_seq(path: str) -> int:
    with open(path, "rb") as fh:
        for line in fh:
            try:
                return int(json.loads(line)["seq"])
            except (ValueError, KeyError, TypeError):
                return 1 << 62
    return 1 << 62


_HEX64 = re.compile(r"[0-9a-fA-F]{64}")


def chain_of(path: str) -> str:
    """The live file whose chain `path` is part of: itself, or what it was rotated from
    (PATH.YYYYmmddTHHMMSS.ffffffZ, or logrotate's PATH.N and PATH-YYYYmmdd). Each
    worker's PATH.wN is a chain of its own."""
    return ROTATED_SUFFIX.sub("", path)


def verify(paths: list[str], out: TextIO = sys.stdout, partial: bool = False,
           anchors: list[str] | tuple[str, ...] = ()) -> int:
    """0 when every record chains to the one before it (each chain's files in seq
    order), unless `partial` each chain starts at its first record, and each of
    `anchors` (head hashes kept elsewhere) is the hash of a record in the chains.
    ValueError for an anchor that is no SHA-256 hex digest."""
    missing = set()
    for anchor in anchors:
        if not _HEX64.fullmatch(anchor):
            raise ValueError(f"anchor {anchor!r} is not a SHA-256 hash (64 hex digits)")
        missing.add(anchor.lower())
    chains: dict[str, list[str]] = {}
    for path in paths:
        chains.setdefault(chain_of(path), []).append(path)
    problems = count = 0
    heads = []
    for name, files in chains.items():
        n_problems, n_records, head = _verify_chain(files, out, partial, missing)
        problems += n_problems
        count += n_records
        heads.append((name, len(files), n_records, head))
    for anchor in sorted(missing):
        print(f"anchor {anchor} not found: records were cut off the end of the log (or "
              "it was rewritten)", file=out)
        problems += 1
    if problems:
        print(f"FAILED: {problems} problem(s) in {count} records", file=out)
        return 1
    for name, n_files, n_records, head in heads:
        where = f"{name}: " if len(heads) > 1 else ""
        print(f"{where}ok: {n_records} records in {n_files} file(s); head {head}", file=out)
    return 0


def _verify_chain(paths: list[str], out: TextIO, partial: bool,
                  anchors: set[str]) -> tuple[int, int, str]:
    """(problems, records, head hash) of one chain; found hashes leave `anchors`."""
    files = sorted(paths, key=_first_seq)
    prev = None
    expect_seq = None
    problems = 0
    count = 0
    for fi, path in enumerate(files):
        with open(path, "rb") as fh:
            data = fh.read()
        lines = data.split(b"\n")
        tail = lines.pop()  # b"" when the file ends with a newline
        for n, line in enumerate(lines, 1):
            where = f"{path}:{n}"
            try:
                rec = json.loads(line)
                seq, rec_prev = int(rec["seq"]), rec["prev"]
            except (ValueError, KeyError, TypeError):
                print(f"{where}: not an audit record", file=out)
                problems += 1
                prev = line_hash(line)
                continue
            if prev is None:
                if rec_prev != GENESIS:
                    print(f"{where}: chain starts at seq {seq}, after a record not given "
                          "(earlier files missing?"
                          + (")" if partial else "; --partial accepts that)"), file=out)
                    problems += not partial
            elif rec_prev != prev:
                print(f"{where}: seq {seq}: prev hash does not match the record before it "
                      "(a record was edited, removed or reordered)", file=out)
                problems += 1
            if expect_seq is not None and seq != expect_seq:
                print(f"{where}: seq {seq}, expected {expect_seq}", file=out)
                problems += 1
            expect_seq = seq + 1
            prev = line_hash(line)
            anchors.discard(prev)
            count += 1
        if tail:
            last_file = fi == len(files) - 1
            print(f"{path}: incomplete last line ({len(tail)} bytes)"
                  + (": a write cut short by a crash, never acknowledged" if last_file
                     else ""), file=out)
            if not last_file:
                problems += 1
    return problems, count, prev or GENESIS


# -- query --------------------------------------------------------------------------------------

_OPS = ("!=", ">=", "<=", "=", ">", "<", "~")
_WHERE = re.compile(r"\s*([^!<>=~\s]+)\s*(!=|>=|<=|=|>|<|~)\s*(.*?)\s*$")
_DURATION = re.compile(r"(\d+(?:\.\d+)?)([smhd])")


def flatten(value: Any, prefix: str = "", out: dict[str, Any] | None = None) -> dict[str, Any]:
    out = {} if out is None else out
    if isinstance(value, dict):
        for k, v in value.items():
            flatten(v, f"{prefix}.{k}" if prefix else str(k), out)
    else:
        out[prefix] = value
    return out


def _kind(v: Any) -> str:
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "bool"
    if isinstance(v, int | float):
        return "number"
    return "string" if isinstance(v, str) else "other"


def _text(v: Any) -> str:
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, list | dict):
        return json.dumps(v, separators=(",", ":"))
    return str(v)


def parse_since(text: str, now: datetime | None = None) -> datetime:
    now = now or datetime.now(UTC)
    m = _DURATION.fullmatch(text)
    if m is not None:
        n, unit = float(m.group(1)), m.group(2)
        return now - timedelta(seconds=n * {"s": 1, "m": 60, "h": 3600, "d": 86400}[unit])
    t = datetime.fromisoformat(text.replace("Z", "+00:00"))
    return t if t.tzinfo else t.replace(tzinfo=UTC)


def read_records(paths: list[str]) -> Iterator[dict[str, Any]]:
    for path in paths:
        with open(path, "rb") as fh:
            for line in fh:
                if not line.endswith(b"\n"):
                    break  # an incomplete last line
                try:
                    rec = json.loads(line)
                except ValueError:
                    continue
                if isinstance(rec, dict):
                    yield flatten(rec)


class Condition:
    def __init__(self, text: str) -> None:
        m = _WHERE.fullmatch(text)
        if m is None:
            raise ValueError(f"cannot read --where '{text}' (FIELD OP VALUE, OP one of "
                             f"{' '.join(_OPS)})")
        self.field, self.op, self.raw = m.groups()
        try:
            self.regex = re.compile(self.raw) if self.op == "~" else None
        except re.error as exc:
            raise ValueError(f"--where '{text}': bad regular expression: {exc}") from None

    def holds(self, rec: dict[str, Any], as_string: bool) -> bool:
        v = rec.get(self.field)
        if self.regex is not None:
            return v is not None and self.regex.search(_text(v)) is not None
        if self.raw == "null" and self.op in ("=", "!="):
            return (v is None) == (self.op == "=")
        if v is None:
            return self.op == "!="
        if not as_string and _kind(v) == "number":
            try:
                want: Any = float(self.raw)
                have: Any = float(v)
            except ValueError:
                have, want = _text(v), self.raw
        elif not as_string and _kind(v) == "bool" and self.raw in ("true", "false"):
            have, want = v, self.raw == "true"
        else:
            have, want = _text(v), self.raw
        try:
            return {"=": have == want, "!=": have != want, ">": have > want, "<": have < want,
                    ">=": have >= want, "<=": have <= want}[self.op]
        except TypeError:
            return False


def query(paths: list[str], where: list[str], group_by: list[str], since: str | None,
          fields: list[str] | None, fmt: str, out: TextIO = sys.stdout) -> int:
    conditions = [Condition(w) for w in where]
    try:
        cutoff = parse_since(since) if since else None
    except ValueError:
        raise ValueError(f"--since '{since}': expected a duration (15m, 1h, 2d) or an ISO "
                         "time") from None
    # Pass 1: the types each field was seen with (schema-on-read).
    kinds: dict[str, set[str]] = {}
    for rec in read_records(paths):
        for k, v in rec.items():
            if v is not None:
                kinds.setdefault(k, set()).add(_kind(v))
    mixed = {k for k, s in kinds.items() if len(s) > 1}
    rows: list[dict[str, Any]] = []
    groups: dict[tuple, int] = {}
    for rec in read_records(paths):
        if cutoff is not None:
            try:
                t = parse_since(str(rec.get("time")))
            except ValueError:
                continue
            if t < cutoff:
                continue
        if not all(c.holds(rec, c.field in mixed) for c in conditions):
            continue
        if group_by:
            key = tuple(_text(rec.get(g)) if g in mixed else rec.get(g) for g in group_by)
            key = tuple(_text(k) if isinstance(k, list | dict) else k for k in key)
            groups[key] = groups.get(key, 0) + 1
        else:
            cols = fields or ["time", "identity.sub", "method", "path", "route", "model",
                              "status", "decision.rule"]
            rows.append({c: rec.get(c) for c in cols})
    if group_by:
        rows = [{**dict(zip(group_by, key, strict=True)), "count": n}
                for key, n in sorted(groups.items(), key=lambda kv: (-kv[1], _text(kv[0])))]
    if fmt == "json":
        for row in rows:
            out.write(json.dumps(row, separators=(",", ":"), default=str) + "\n")
        return 0
    if not rows:
        print("(no records)", file=out)
        return 0
    cols = list(rows[0])
    cells = [[_text(r[c]) for c in cols] for r in rows]
    widths = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(cols)]
    print("  ".join(c.ljust(w) for c, w in zip(cols, widths, strict=True)).rstrip(), file=out)
    for row in cells:
        print("  ".join(v.ljust(w) for v, w in zip(row, widths, strict=True)).rstrip(), file=out)
    return 0
