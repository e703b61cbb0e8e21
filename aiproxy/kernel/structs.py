"""ctypes mirrors of the structs in bpf/include/*.h (the kernel/user contract).

Keep these in step with the C headers: tests/kernel/test_structs.py compiles the headers
and compares every size and field offset listed in MIRRORS.
"""

from __future__ import annotations

import ctypes

# -- bpf/include/guard.h ----------------------------------------------------------------
GUARD_TOKEN_SCALE = 1_000_000_000
GUARD_PASSED = 0
GUARD_DROPPED_DENY = 1
GUARD_DROPPED_RATELIMIT = 2
GUARD_DROPPED_MALFORMED = 3
GUARD_MALFORMED = 4
GUARD_NR_COUNTERS = 5
GUARD_COUNTER_NAMES = ("passed", "dropped_deny", "dropped_ratelimit", "dropped_malformed",
                       "malformed")


class GuardV4Key(ctypes.Structure):
    _fields_ = [("prefixlen", ctypes.c_uint32), ("addr", ctypes.c_uint8 * 4)]


class GuardV6Key(ctypes.Structure):
    _fields_ = [("prefixlen", ctypes.c_uint32), ("addr", ctypes.c_uint8 * 16)]


GUARD_V6_MAX_LENS = 6
GUARD_V6_INLINE_MAX = 2
GUARD_V6_ALL = 0x1
GUARD_V6_TRIE = 0x2
GUARD_V6_INLINE = 0x4
GUARD_V6_SEARCH = 0x8
GUARD_V6_SEARCH_LO = 33
GUARD_V6_SEARCH_HI = 128
GUARD_V6_SEARCH_STEPS = 7
GUARD_V6_DENY = 0x1
GUARD_SLOT_BITS = 16
GUARD_ESLOT_BITS = 16
GUARD_ESLOT_WAYS = 2
GUARD_ESLOT_MUL1 = 0x9E3779B97F4A7C15
GUARD_ESLOT_MUL2 = 0xC2B2AE3D27D4EB4F
GUARD_SLOT_HASH_MUL = 2654435761
GUARD_SLOT_EMPTY = 0
GUARD_SLOT_ONE = 1
GUARD_SLOT_MULTI = 2


class GuardV4Hosts(ctypes.Structure):
    _fields_ = [("bits", ctypes.c_uint64 * 4)]


class GuardV6Pfx(ctypes.Structure):
    _fields_ = [("hi", ctypes.c_uint64), ("lo", ctypes.c_uint64)]


class GuardV6Top(ctypes.Structure):
    _fields_ = [("n", ctypes.c_uint8), ("flags", ctypes.c_uint8),
                ("len", ctypes.c_uint8 * GUARD_V6_MAX_LENS),
                ("pfx", GuardV6Pfx * GUARD_V6_INLINE_MAX)]


class GuardV4Slot(ctypes.Structure):
    _fields_ = [("key", ctypes.c_uint32), ("state", ctypes.c_uint32),
                ("hosts", GuardV4Hosts)]


class GuardV6Slot(ctypes.Structure):
    _fields_ = [("key", ctypes.c_uint32), ("state", ctypes.c_uint32), ("top", GuardV6Top)]


class GuardV6Eent(ctypes.Structure):
    _fields_ = [("hi", ctypes.c_uint64), ("lo", ctypes.c_uint64), ("len", ctypes.c_uint32),
                ("state", ctypes.c_uint16), ("value", ctypes.c_uint16)]


class GuardV6Eslot(ctypes.Structure):
    _fields_ = [("e", GuardV6Eent * GUARD_ESLOT_WAYS)]


class GuardSrc(ctypes.Structure):
    _fields_ = [("addr", ctypes.c_uint8 * 16)]


class GuardBucket(ctypes.Structure):
    _fields_ = [("tokens", ctypes.c_uint64), ("stamp_ns", ctypes.c_uint64)]


class GuardSettings(ctypes.Structure):
    _fields_ = [("syn_rate", ctypes.c_uint32), ("syn_burst", ctypes.c_uint32),
                ("jiffy_ns", ctypes.c_uint32), ("_pad", ctypes.c_uint32)]


# -- bpf/include/classify.h -------------------------------------------------------------
CLASSIFY_MAX_CLASSES = 16
CLASS_SET_PRIORITY = 0x1
CLASS_SET_DSCP = 0x2
SIG_H2_PREFACE = 0
SIG_POST_V1 = 1
SIG_NR = 2
SIGNATURES = {"h2_preface": SIG_H2_PREFACE, "post_v1": SIG_POST_V1}


class ClassInfo(ctypes.Structure):
    _fields_ = [("priority", ctypes.c_uint32), ("dscp", ctypes.c_uint8),
                ("flags", ctypes.c_uint8), ("_pad", ctypes.c_uint16)]


class ClassStats(ctypes.Structure):
    _fields_ = [("packets", ctypes.c_uint64), ("bytes", ctypes.c_uint64)]


# -- bpf/include/splice.h ---------------------------------------------------------------


class SplicePeer(ctypes.Structure):
    _fields_ = [("peer", ctypes.c_uint64), ("bytes", ctypes.c_uint64),
                ("segs", ctypes.c_uint64), ("passed", ctypes.c_uint64)]


# C struct name -> (header, mirror); checked by tests/kernel/test_structs.py
MIRRORS: dict[str, tuple[str, type[ctypes.Structure]]] = {
    "guard_v4_key": ("guard.h", GuardV4Key),
    "guard_v6_key": ("guard.h", GuardV6Key),
    "guard_v4_hosts": ("guard.h", GuardV4Hosts),
    "guard_v6_pfx": ("guard.h", GuardV6Pfx),
    "guard_v6_top": ("guard.h", GuardV6Top),
    "guard_v4_slot": ("guard.h", GuardV4Slot),
    "guard_v6_slot": ("guard.h", GuardV6Slot),
    "guard_v6_eent": ("guard.h", GuardV6Eent),
    "guard_v6_eslot": ("guard.h", GuardV6Eslot),
    "guard_src": ("guard.h", GuardSrc),
    "guard_bucket": ("guard.h", GuardBucket),
    "guard_settings": ("guard.h", GuardSettings),
    "class_info": ("classify.h", ClassInfo),
    "class_stats": ("classify.h", ClassStats),
    "splice_peer": ("splice.h", SplicePeer),
}

# Constants mirrored from the headers, also checked by the test.
CONSTANTS: dict[str, tuple[str, int]] = {
    "GUARD_TOKEN_SCALE": ("guard.h", GUARD_TOKEN_SCALE),
    "GUARD_NR_COUNTERS": ("guard.h", GUARD_NR_COUNTERS),
    "GUARD_DROPPED_DENY": ("guard.h", GUARD_DROPPED_DENY),
    "GUARD_DROPPED_RATELIMIT": ("guard.h", GUARD_DROPPED_RATELIMIT),
    "GUARD_DROPPED_MALFORMED": ("guard.h", GUARD_DROPPED_MALFORMED),
    "GUARD_MALFORMED": ("guard.h", GUARD_MALFORMED),
    "GUARD_V6_MAX_LENS": ("guard.h", GUARD_V6_MAX_LENS),
    "GUARD_V6_ALL": ("guard.h", GUARD_V6_ALL),
    "GUARD_V6_TRIE": ("guard.h", GUARD_V6_TRIE),
    "GUARD_V6_INLINE": ("guard.h", GUARD_V6_INLINE),
    "GUARD_V6_INLINE_MAX": ("guard.h", GUARD_V6_INLINE_MAX),
    "GUARD_V6_SEARCH": ("guard.h", GUARD_V6_SEARCH),
    "GUARD_V6_SEARCH_LO": ("guard.h", GUARD_V6_SEARCH_LO),
    "GUARD_V6_SEARCH_HI": ("guard.h", GUARD_V6_SEARCH_HI),
    "GUARD_V6_SEARCH_STEPS": ("guard.h", GUARD_V6_SEARCH_STEPS),
    "GUARD_V6_DENY": ("guard.h", GUARD_V6_DENY),
    "GUARD_SLOT_BITS": ("guard.h", GUARD_SLOT_BITS),
    "GUARD_SLOT_HASH_MUL": ("guard.h", GUARD_SLOT_HASH_MUL),
    "GUARD_SLOT_ONE": ("guard.h", GUARD_SLOT_ONE),
    "GUARD_ESLOT_BITS": ("guard.h", GUARD_ESLOT_BITS),
    "GUARD_ESLOT_WAYS": ("guard.h", GUARD_ESLOT_WAYS),
    "GUARD_ESLOT_MUL1": ("guard.h", GUARD_ESLOT_MUL1),
    "GUARD_ESLOT_MUL2": ("guard.h", GUARD_ESLOT_MUL2),
    "GUARD_SLOT_MULTI": ("guard.h", GUARD_SLOT_MULTI),
    "CLASSIFY_MAX_CLASSES": ("classify.h", CLASSIFY_MAX_CLASSES),
    "CLASS_SET_PRIORITY": ("classify.h", CLASS_SET_PRIORITY),
    "CLASS_SET_DSCP": ("classify.h", CLASS_SET_DSCP),
    "SIG_H2_PREFACE": ("classify.h", SIG_H2_PREFACE),
    "SIG_POST_V1": ("classify.h", SIG_POST_V1),
    "SIG_NR": ("classify.h", SIG_NR),
}
