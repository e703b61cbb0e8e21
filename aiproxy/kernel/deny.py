"""xdp_guard's deny list: CIDRs -> the maps bpf/xdp_guard.c looks a source up in.

The program never walks an LPM trie for IPv4 and only for crowded IPv6 /32s:

- IPv4: ``guard_v4_summary`` (a bit per /24 some prefix overlaps), ``guard_v4_full`` (a
  bit per /24 a prefix of /24 or shorter covers whole) and ``guard_v4_hosts`` (per /24
  that /25../32 prefixes touch: the 256 bits of the addresses they cover).
- IPv6: ``guard_v6_top`` per /32 that prefixes of /32 or longer sit in: "all denied",
  or its one or two prefixes inline, or the distinct lengths (33..128) to probe in
  ``guard_v6_exact`` (length + masked address), or "walk the trie" when there are more
  than GUARD_V6_MAX_LENS lengths. ``guard_deny_v6_short`` is the LPM trie of prefixes
  shorter than /32, consulted (when ``guard_v6_short_on``) for sources whose /32 has no
  entry.
- ``guard_v4_slots`` / ``guard_v6_slots``: direct-mapped arrays in front of the two hash
  maps (see guard.h): a key alone in its slot is answered from the array.
- ``guard_deny_v4`` / ``guard_deny_v6``: LPM tries holding every configured prefix,
  the record the other maps are derived from on the next sync (so a separate process,
  `aiproxy bpf attach`, can update pinned maps) and the IPv6 crowded-/32 fallback.

Every IPv4 and IPv6 prefix keeps exact CIDR semantics: a source is denied iff some
configured prefix contains it.
"""

from __future__ import annotations

import ctypes
import ipaddress
from collections.abc import Iterable
from dataclasses import dataclass, field

from .libbpf import Map
from .structs import (
    GUARD_SLOT_BITS,
    GUARD_SLOT_HASH_MUL,
    GUARD_SLOT_MULTI,
    GUARD_SLOT_ONE,
    GUARD_V6_ALL,
    GUARD_V6_INLINE,
    GUARD_V6_INLINE_MAX,
    GUARD_V6_MAX_LENS,
    GUARD_V6_TRIE,
    GuardV6Pfx,
    GuardV6Top,
)

Network = ipaddress.IPv4Network | ipaddress.IPv6Network

V4_SUMMARY_BITS = 24  # bpf/include/guard.h: GUARD_V4_SUMMARY_BITS
V6_SHORT = 32  # GUARD_V6_SHORT: the IPv6 /32 level

DENY_MAPS = ("guard_deny_v4", "guard_deny_v6", "guard_v4_summary", "guard_v4_full",
             "guard_v4_hosts", "guard_v4_slots", "guard_v6_top", "guard_v6_slots",
             "guard_v6_exact", "guard_deny_v6_short", "guard_v6_short_on")

ONE = (1).to_bytes(4, "little")


def _u32(value: int) -> bytes:
    return value.to_bytes(4, "little")


def prefix_key(prefixlen: int, packed: bytes) -> bytes:
    """Key of the LPM tries and of guard_v6_exact: u32 length, address bytes."""
    return _u32(prefixlen) + packed


def key_network(key: bytes) -> Network:
    plen = int.from_bytes(key[:4], "little")
    return ipaddress.ip_network((bytes(key[4:]), plen))


def summary_words(nets: Iterable[ipaddress.IPv4Network]) -> dict[int, int]:
    """Word index -> bits, one bit per /24 a prefix overlaps."""
    words: dict[int, int] = {}
    shift = 32 - V4_SUMMARY_BITS
    for net in nets:
        first = int(net.network_address) >> shift
        last = int(net.broadcast_address) >> shift
        for word in range(first >> 6, (last >> 6) + 1):
            lo = max(first, word << 6) & 63
            hi = min(last, (word << 6) | 63) & 63
            words[word] = words.get(word, 0) | (((1 << (hi - lo + 1)) - 1) << lo)
    return words


def _bit(words: dict[int, int], index: int) -> bool:
    return bool(words.get(index >> 6, 0) >> (index & 63) & 1)


@dataclass
class DenyLayout:
    """What the deny maps hold for one set of prefixes."""

    trie4: set[bytes] = field(default_factory=set)
    trie6: set[bytes] = field(default_factory=set)
    summary: dict[int, int] = field(default_factory=dict)
    full: dict[int, int] = field(default_factory=dict)
    hosts: dict[int, int] = field(default_factory=dict)  # /24 -> 256-bit int
    v6_short: set[bytes] = field(default_factory=set)
    v6_top: dict[bytes, bytes] = field(default_factory=dict)  # /32 -> guard_v6_top
    v6_exact: set[bytes] = field(default_factory=set)
    v4_slots: dict[int, bytes] = field(default_factory=dict)  # non-empty slots only
    v6_slots: dict[int, bytes] = field(default_factory=dict)


def slot_of(key: int) -> int:
    """The slot of a u32 key (guard.h: GUARD_SLOT_HASH_MUL, GUARD_SLOT_BITS)."""
    return ((key * GUARD_SLOT_HASH_MUL) & 0xFFFFFFFF) >> (32 - GUARD_SLOT_BITS)


def slots(entries: dict[int, bytes]) -> dict[int, bytes]:
    """u32 key -> value  =>  slot -> slot value (key, state, value) of the busy slots."""
    by_slot: dict[int, list[int]] = {}
    for key in entries:
        by_slot.setdefault(slot_of(key), []).append(key)
    return {i: (_u32(keys[0]) + _u32(GUARD_SLOT_ONE) + entries[keys[0]] if len(keys) == 1
                else _u32(0) + _u32(GUARD_SLOT_MULTI) + bytes(len(entries[keys[0]])))
            for i, keys in by_slot.items()}


def top_value(flags: int, prefixes: Iterable[tuple[int, int]] = ()) -> bytes:
    """A guard_v6_top value; ``prefixes`` are (length, address as int) for INLINE,
    (length, 0) for the probed lengths."""
    prefixes = sorted(prefixes)
    lens = (ctypes.c_uint8 * GUARD_V6_MAX_LENS)(*(plen for plen, _ in prefixes))
    pfx = (GuardV6Pfx * GUARD_V6_INLINE_MAX)()
    if flags & GUARD_V6_INLINE:
        for i, (_, addr) in enumerate(prefixes):
            pfx[i] = GuardV6Pfx(addr >> 64, addr & 0xFFFFFFFFFFFFFFFF)
    return bytes(GuardV6Top(len(prefixes), flags, lens, pfx))


TOP_ALL = top_value(GUARD_V6_ALL)
TOP_TRIE = top_value(GUARD_V6_TRIE)


def layout(nets: Iterable[Network]) -> DenyLayout:
    out = DenyLayout()
    v4 = [n for n in nets if n.version == 4]
    v6 = [n for n in nets if n.version == 6]
    for n in v4:
        out.trie4.add(prefix_key(n.prefixlen, n.network_address.packed))
    out.summary = summary_words(v4)
    out.full = summary_words(n for n in v4 if n.prefixlen <= V4_SUMMARY_BITS)
    for n in v4:
        if n.prefixlen <= V4_SUMMARY_BITS:
            continue
        addr = int(n.network_address)
        top = addr >> 8
        if _bit(out.full, top):
            continue  # the whole /24 is denied already
        first = addr & 255
        out.hosts[top] = out.hosts.get(top, 0) | (((1 << (1 << (32 - n.prefixlen))) - 1)
                                                  << first)

    short_by_len: dict[int, set[int]] = {}
    by_top: dict[int, list[Network]] = {}
    for n in v6:
        out.trie6.add(prefix_key(n.prefixlen, n.network_address.packed))
        if n.prefixlen < V6_SHORT:
            out.v6_short.add(prefix_key(n.prefixlen, n.network_address.packed))
            short_by_len.setdefault(n.prefixlen, set()).add(int(n.network_address) >> 96)
        else:
            by_top.setdefault(int(n.network_address) >> 96, []).append(n)
    for top, group in by_top.items():
        lens = {n.prefixlen for n in group}
        covered = V6_SHORT in lens or any(
            (top >> (32 - plen) << (32 - plen)) in tops for plen, tops in short_by_len.items())
        key = top.to_bytes(4, "big")
        if covered:
            out.v6_top[key] = TOP_ALL
        elif len(group) <= GUARD_V6_INLINE_MAX:
            out.v6_top[key] = top_value(GUARD_V6_INLINE, ((n.prefixlen, int(n.network_address))
                                                          for n in group))
        elif len(lens) > GUARD_V6_MAX_LENS:
            out.v6_top[key] = TOP_TRIE
        else:
            out.v6_top[key] = top_value(0, ((plen, 0) for plen in lens))
            out.v6_exact.update(prefix_key(n.prefixlen, n.network_address.packed)
                                for n in group)
    out.v4_slots = slots({top: _hosts_value(bits) for top, bits in out.hosts.items()})
    out.v6_slots = slots({int.from_bytes(key, "little"): value
                          for key, value in out.v6_top.items()})
    return out


def _top_union(a: bytes | None, b: bytes) -> bytes:
    """An entry at least as strict as both (while both sets of maps are in place)."""
    if a is None or a == b:
        return b
    if TOP_ALL in (a, b):
        return TOP_ALL
    return TOP_TRIE  # the record trie holds the union during an update


def _hosts_value(bits: int) -> bytes:
    return bits.to_bytes(32, "little")  # word w = bits w*64..w*64+63, little-endian u64s


def _write_slots(m: Map, want: dict[int, bytes], have: dict[int, bytes]) -> None:
    for i in set(want) | set(have):
        value = want.get(i)
        if value != have.get(i):
            m.update(_u32(i), value if value is not None else bytes(m.value_size))


def _read_words(m: Map, indexes: Iterable[int]) -> dict[int, int]:
    out = {}
    for i in indexes:
        value = int.from_bytes(m.lookup(_u32(i)) or b"", "little")
        if value:
            out[i] = value
    return out


def _read_slots(m: Map, indexes: Iterable[int]) -> dict[int, bytes]:
    out = {}
    for i in indexes:
        raw = m.lookup(_u32(i))
        if raw and any(raw):
            out[i] = raw
    return out


def _write_words(m: Map, words: dict[int, int], old: dict[int, int]) -> None:
    for i, bits in words.items():
        if old.get(i, 0) != bits:
            m.update(_u32(i), bits.to_bytes(8, "little"))


def _or_words(a: dict[int, int], b: dict[int, int]) -> dict[int, int]:
    return {i: a.get(i, 0) | b.get(i, 0) for i in set(a) | set(b)}


def _lower_words(m: Map, old: dict[int, int], new: dict[int, int]) -> None:
    for i in set(old) | set(new):
        union = old.get(i, 0) | new.get(i, 0)
        if new.get(i, 0) != union:
            m.update(_u32(i), new.get(i, 0).to_bytes(8, "little"))


def _add_keys(m: Map, keys: set[bytes], have: set[bytes]) -> int:
    for key in keys - have:
        m.update(key, ONE)
    return len(keys - have)


def _drop_keys(m: Map, keys: set[bytes], have: set[bytes]) -> int:
    for key in have - keys:
        m.delete(key)
    return len(have - keys)


def apply(maps: dict[str, Map], nets: Iterable[Network]) -> dict[str, int]:
    """Make the deny maps hold exactly ``nets``.

    The maps first move to the union of the old and the new state (the slots straight
    to the new one, once what they defer to holds both), then down to the new one, in
    an order where the program's answer is never less strict than the new set (and,
    for prefixes in both, the old one): a change takes effect at once, without a moment
    where a kept prefix lets a packet through.
    """
    nets = list(nets)
    new = layout(nets)
    trie4, trie6 = maps["guard_deny_v4"], maps["guard_deny_v6"]
    have4, have6 = set(trie4.keys()), set(trie6.keys())
    old = layout([key_network(k) for k in have4 | have6])
    # Every map diffs against what it holds (maps pinned by another version, or fresh
    # next to a reused record, get filled too); the arrays only at the indexes the old
    # or the new prefixes touch (2 x 256k words, 2 x 64k slots in all).
    have_words = {name: _read_words(maps[name], set(o) | set(n)) for name, o, n in (
        ("guard_v4_summary", old.summary, new.summary),
        ("guard_v4_full", old.full, new.full))}
    have_slots = {name: _read_slots(maps[name], set(o) | set(n)) for name, o, n in (
        ("guard_v4_slots", old.v4_slots, new.v4_slots),
        ("guard_v6_slots", old.v6_slots, new.v6_slots))}
    hosts_m, top_m = maps["guard_v4_hosts"], maps["guard_v6_top"]
    exact_m, short_m = maps["guard_v6_exact"], maps["guard_deny_v6_short"]
    have_hosts = {int.from_bytes(k, "little"): int.from_bytes(hosts_m.lookup(k) or b"",
                                                              "little")
                  for k in list(hosts_m.keys())}
    have_top = set(top_m.keys())
    have_exact, have_short = set(exact_m.keys()), set(short_m.keys())

    # Up: records, probe targets, bits, then the entries that point at them, then the
    # slots in front of them.
    added = _add_keys(trie4, new.trie4, have4) + _add_keys(trie6, new.trie6, have6)
    _add_keys(short_m, new.v6_short, have_short)
    _add_keys(exact_m, new.v6_exact, have_exact)
    for top, bits in new.hosts.items():
        union = have_hosts.get(top, 0) | bits
        if union != have_hosts.get(top, 0):
            hosts_m.update(_u32(top), _hosts_value(union))
    for name, words in (("guard_v4_summary", new.summary), ("guard_v4_full", new.full)):
        _write_words(maps[name], _or_words(have_words[name], words), have_words[name])
    if new.v6_short:
        maps["guard_v6_short_on"].update(_u32(0), (1).to_bytes(8, "little"))
    for key, entry in new.v6_top.items():
        union = _top_union(old.v6_top.get(key) if key in have_top else None, entry)
        top_m.update(key, union)
    for name, n in (("guard_v4_slots", new.v4_slots), ("guard_v6_slots", new.v6_slots)):
        # Straight to the new slots: what a slot answers from is either its own new
        # value or a hash map holding old and new by now.
        _write_slots(maps[name], n, have_slots[name])

    # Down: entries first, then what they pointed at, records last.
    for key, entry in new.v6_top.items():
        if key in have_top and _top_union(old.v6_top.get(key), entry) != entry:
            top_m.update(key, entry)
    for key in have_top - set(new.v6_top):
        top_m.delete(key)
    _lower_words(maps["guard_v4_full"], have_words["guard_v4_full"], new.full)
    for top, bits in new.hosts.items():
        if have_hosts.get(top, 0) | bits != bits:
            hosts_m.update(_u32(top), _hosts_value(bits))
    for top in set(have_hosts) - set(new.hosts):
        hosts_m.delete(_u32(top))
    _drop_keys(exact_m, new.v6_exact, have_exact)
    _drop_keys(short_m, new.v6_short, have_short)
    _lower_words(maps["guard_v4_summary"], have_words["guard_v4_summary"], new.summary)
    if not new.v6_short:
        maps["guard_v6_short_on"].update(_u32(0), bytes(8))
    removed = _drop_keys(trie4, new.trie4, have4) + _drop_keys(trie6, new.trie6, have6)
    return {"deny_v4": len(new.trie4), "deny_v6": len(new.trie6), "deny_changed": added,
            "deny_removed": removed}
