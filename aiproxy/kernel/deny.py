"""xdp_guard's deny list: CIDRs -> the maps bpf/xdp_guard.c looks a source up in.

The program never walks an LPM trie for IPv4 and only for crowded IPv6 /32s:

- IPv4: ``guard_v4_summary`` (a bit per /24 some prefix overlaps), ``guard_v4_full`` (a
  bit per /24 a prefix of /24 or shorter covers whole) and ``guard_v4_hosts`` (per /24
  that /25../32 prefixes touch: the 256 bits of the addresses they cover).
- IPv6: ``guard_v6_top`` per /32 that prefixes of /32 or longer sit in: "all denied",
  or its one or two prefixes inline, or the distinct lengths (33..128) to probe in
  ``guard_v6_exact`` (length + masked address), or, with more than GUARD_V6_MAX_LENS
  lengths, "binary search on the length": ``guard_v6_exact`` then also holds the
  markers that search needs (see guard.h), each saying whether a prefix covers it. ``guard_deny_v6_short`` is the LPM trie of prefixes
  shorter than /32, consulted (when ``guard_v6_short_on``) for sources whose /32 has no
  entry.
- ``guard_v4_slots`` / ``guard_v6_slots`` / ``guard_v6_eslots``: direct-mapped arrays in
  front of the hash maps (see guard.h): a key alone in its slot is answered from the array.
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
    GUARD_ESLOT_BITS,
    GUARD_ESLOT_MUL1,
    GUARD_ESLOT_MUL2,
    GUARD_ESLOT_WAYS,
    GUARD_SLOT_BITS,
    GUARD_SLOT_HASH_MUL,
    GUARD_SLOT_MULTI,
    GUARD_SLOT_ONE,
    GUARD_V6_ALL,
    GUARD_V6_DENY,
    GUARD_V6_INLINE,
    GUARD_V6_INLINE_MAX,
    GUARD_V6_MAX_LENS,
    GUARD_V6_SEARCH,
    GUARD_V6_SEARCH_HI,
    GUARD_V6_SEARCH_LO,
    GUARD_V6_TRIE,
    GuardV6Eent,
    GuardV6Eslot,
    GuardV6Pfx,
    GuardV6Top,
)

Network = ipaddress.IPv4Network | ipaddress.IPv6Network

V4_SUMMARY_BITS = 24  # bpf/include/guard.h: GUARD_V4_SUMMARY_BITS
V6_SHORT = 32  # GUARD_V6_SHORT: the IPv6 /32 level

DENY_MAPS = ("guard_deny_v4", "guard_deny_v6", "guard_v4_summary", "guard_v4_full",
             "guard_v4_hosts", "guard_v4_slots", "guard_v6_top", "guard_v6_slots",
             "guard_v6_exact", "guard_v6_eslots", "guard_deny_v6_short", "guard_v6_short_on")

ONE = (1).to_bytes(4, "little")
DENY = GUARD_V6_DENY.to_bytes(4, "little")
MARKER = bytes(4)


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
    v6_exact: dict[bytes, bytes] = field(default_factory=dict)  # key -> DENY or MARKER
    v4_slots: dict[int, bytes] = field(default_factory=dict)  # non-empty slots only
    v6_slots: dict[int, bytes] = field(default_factory=dict)
    v6_eslots: dict[int, bytes] = field(default_factory=dict)


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


M64 = (1 << 64) - 1


def eslots(entries: dict[bytes, bytes]) -> dict[int, bytes]:
    """guard_v6_exact entries => the busy guard_v6_eslots buckets (guard.h)."""
    by_slot: dict[int, list[tuple[int, int, int, int]]] = {}
    for key, value in entries.items():
        plen = int.from_bytes(key[:4], "little")
        hi, lo = int.from_bytes(key[4:12], "big"), int.from_bytes(key[12:20], "big")
        idx = (((hi ^ (lo * GUARD_ESLOT_MUL2 & M64) ^ plen) * GUARD_ESLOT_MUL1 & M64)
               >> (64 - GUARD_ESLOT_BITS))
        by_slot.setdefault(idx, []).append((hi, lo, plen, int.from_bytes(value, "little")))
    out = {}
    for i, keys in by_slot.items():
        if len(keys) > GUARD_ESLOT_WAYS:
            keys = [(0, 0, 0, 0)]
            state = GUARD_SLOT_MULTI
        else:
            state = GUARD_SLOT_ONE
        slot = GuardV6Eslot()
        for way, (hi, lo, plen, value) in enumerate(sorted(keys)):
            slot.e[way] = GuardV6Eent(hi, lo, plen, state, value)
        out[i] = bytes(slot)
    return out


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
TOP_SEARCH = top_value(GUARD_V6_SEARCH)


def search_markers(plen: int) -> list[int]:
    """The lengths where the binary search for ``plen`` goes longer (guard.h): a prefix
    of that length needs a marker at each."""
    lo, hi, out = GUARD_V6_SEARCH_LO, GUARD_V6_SEARCH_HI, []
    while lo <= hi:
        mid = (lo + hi) >> 1
        if mid == plen:
            return out
        if mid < plen:
            out.append(mid)
            lo = mid + 1
        else:
            hi = mid - 1
    raise ValueError(f"/{plen} is outside {GUARD_V6_SEARCH_LO}..{GUARD_V6_SEARCH_HI}")


def _mask(addr: int, plen: int) -> int:
    return addr >> (128 - plen) << (128 - plen)


def search_entries(group: Iterable[Network]) -> dict[bytes, bytes]:
    """guard_v6_exact entries of a /32 searched by length: its prefixes (DENY) and their
    markers, DENY when some prefix of the group contains the marker's whole range."""
    prefixes = {(n.prefixlen, int(n.network_address)) for n in group}
    lens = sorted({plen for plen, _ in prefixes})
    covered: dict[tuple[int, int], bool] = {}

    def is_covered(plen: int, addr: int) -> bool:
        # Walk the present lengths <= plen downwards; remember every answer on the way.
        chain, answer = [], False
        for shorter in reversed([x for x in lens if x <= plen]):
            key = (shorter, _mask(addr, shorter))
            if key in covered:
                answer = covered[key]
                break
            chain.append(key)
            if key in prefixes:
                answer = True
                break
        for key in chain:
            covered[key] = answer
        return answer

    out: dict[bytes, bytes] = {}
    for plen, addr in prefixes:
        out[prefix_key(plen, addr.to_bytes(16, "big"))] = DENY
        for m in search_markers(plen):
            key = prefix_key(m, _mask(addr, m).to_bytes(16, "big"))
            if key not in out:
                out[key] = DENY if is_covered(m, _mask(addr, m)) else MARKER
    return out


def outermost(nets: Iterable[Network]) -> list[Network]:
    """The prefixes no other one contains (the same addresses are denied): fewer entries
    and lengths to probe, and a search that stops at the first covering prefix."""
    out: list[Network] = []
    end = -1
    for n in sorted(nets, key=lambda n: (n.network_address, n.prefixlen)):
        if int(n.broadcast_address) > end:  # CIDR blocks nest or are disjoint
            out.append(n)
            end = int(n.broadcast_address)
    return out


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
        group = outermost(group)
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
            out.v6_top[key] = TOP_SEARCH
            out.v6_exact.update(search_entries(group))
        else:
            out.v6_top[key] = top_value(0, ((plen, 0) for plen in lens))
            out.v6_exact.update((prefix_key(n.prefixlen, n.network_address.packed), DENY)
                                for n in group)
    out.v4_slots = slots({top: _hosts_value(bits) for top, bits in out.hosts.items()})
    out.v6_slots = slots({int.from_bytes(key, "little"): value
                          for key, value in out.v6_top.items()})
    out.v6_eslots = eslots(out.v6_exact)
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
    have_exact = {key: exact_m.lookup(key) for key in list(exact_m.keys())}
    eslots_m = maps["guard_v6_eslots"]
    union_exact = {**have_exact, **new.v6_exact}
    up_eslots = eslots(union_exact)
    have_eslots = _read_slots(eslots_m, set(eslots(have_exact)) | set(up_eslots))
    have_short = set(short_m.keys())
    # /32s answered from the trie (which holds old and new) while their entries change:
    # a length search over half-rewritten markers could miss, and an old entry kept for
    # a /32 that leaves could hide a new prefix shorter than /32.
    changed = {key[4:8] for key in set(have_exact) ^ set(new.v6_exact)}
    changed |= {key[4:8] for key, value in new.v6_exact.items()
                if have_exact.get(key, value) != value}
    transit = {key for key in have_top | set(new.v6_top)
               if key not in new.v6_top
               or (TOP_SEARCH in (old.v6_top.get(key), new.v6_top[key])
                   and (key in changed or old.v6_top.get(key) != new.v6_top[key]))}
    up_top = {key: TOP_TRIE for key in transit}
    for key, entry in new.v6_top.items():
        if key not in transit:
            up_top[key] = _top_union(old.v6_top.get(key) if key in have_top else None, entry)

    # Up: records, probe targets, bits, then the entries that point at them, then the
    # slots in front of them.
    added = _add_keys(trie4, new.trie4, have4) + _add_keys(trie6, new.trie6, have6)
    _add_keys(short_m, new.v6_short, have_short)
    for key in transit:
        top_m.update(key, TOP_TRIE)
    # The slots copy entries: the transit ones must say TRIE before any probe target
    # changes; the others keep what they hold until their entries are written below.
    pre_slots = slots({int.from_bytes(key, "little"): TOP_TRIE if key in transit
                       else old.v6_top.get(key, TOP_TRIE) for key in have_top | transit})
    _write_slots(maps["guard_v6_slots"], pre_slots, have_slots["guard_v6_slots"])
    for key, value in new.v6_exact.items():
        if have_exact.get(key) != value:
            exact_m.update(key, value)
    _write_slots(eslots_m, up_eslots, have_eslots)
    for top, bits in new.hosts.items():
        union = have_hosts.get(top, 0) | bits
        if union != have_hosts.get(top, 0):
            hosts_m.update(_u32(top), _hosts_value(union))
    for name, words in (("guard_v4_summary", new.summary), ("guard_v4_full", new.full)):
        _write_words(maps[name], _or_words(have_words[name], words), have_words[name])
    if new.v6_short:
        maps["guard_v6_short_on"].update(_u32(0), (1).to_bytes(8, "little"))
    for key, entry in up_top.items():
        if key not in transit:
            top_m.update(key, entry)
    # Straight to the new v4 slots: what a slot answers from is either its own new
    # value or a hash map holding old and new by now. The v6 slots copy the entries
    # of this step (they, too, answer from the trie in transit).
    _write_slots(maps["guard_v4_slots"], new.v4_slots, have_slots["guard_v4_slots"])
    up_slots = slots({int.from_bytes(key, "little"): value for key, value in up_top.items()})
    _write_slots(maps["guard_v6_slots"], up_slots, pre_slots)

    # Down: entries first, then what they pointed at, records last.
    for key in set(have_exact) - set(new.v6_exact):
        if key[4:8] in transit:
            exact_m.delete(key)
            del union_exact[key]
    mid_eslots = eslots(union_exact)
    _write_slots(eslots_m, mid_eslots, up_eslots)
    for key, entry in new.v6_top.items():
        if up_top[key] != entry:
            top_m.update(key, entry)
    _write_slots(maps["guard_v6_slots"], new.v6_slots, up_slots)
    for key in have_top - set(new.v6_top):
        top_m.delete(key)
    _lower_words(maps["guard_v4_full"], have_words["guard_v4_full"], new.full)
    for top, bits in new.hosts.items():
        if have_hosts.get(top, 0) | bits != bits:
            hosts_m.update(_u32(top), _hosts_value(bits))
    for top in set(have_hosts) - set(new.hosts):
        hosts_m.delete(_u32(top))
    for key in set(have_exact) - set(new.v6_exact):
        if key[4:8] not in transit:
            exact_m.delete(key)
    _write_slots(eslots_m, new.v6_eslots, mid_eslots)
    _drop_keys(short_m, new.v6_short, have_short)
    _lower_words(maps["guard_v4_summary"], have_words["guard_v4_summary"], new.summary)
    if not new.v6_short:
        maps["guard_v6_short_on"].update(_u32(0), bytes(8))
    removed = _drop_keys(trie4, new.trie4, have4) + _drop_keys(trie6, new.trie6, have6)
    return {"deny_v4": len(new.trie4), "deny_v6": len(new.trie6), "deny_changed": added,
            "deny_removed": removed}
