/* xdp_guard map family: shared by bpf/xdp_guard.c and aiproxy/kernel/maps.py.
 *
 * Every struct here is mirrored by ctypes in aiproxy/kernel/structs.py;
 * tests/kernel/test_structs.py compiles this header and checks sizes and offsets.
 * Only fixed-width types, explicit padding, no bitfields.
 */
#ifndef AIPROXY_GUARD_H
#define AIPROXY_GUARD_H

#include <linux/types.h>

#define GUARD_MAX_DENY_V4 65536    /* LPM trie capacity (IPv4 deny prefixes) */
#define GUARD_MAX_DENY_V6 65536    /* LPM trie capacity (IPv6 deny prefixes) */
#define GUARD_MAX_V4_HOSTS 65536   /* /24s holding a /25../32 deny prefix */
#define GUARD_MAX_V6_TOPS 65536    /* /32s holding a /32../128 deny prefix */
#define GUARD_MAX_V6_EXACT 262144  /* (length, masked address): /33../128 prefixes, markers */
#define GUARD_V6_SHORT 32          /* prefixes shorter than this go to guard_deny_v6_short */
#define GUARD_PORT_WORDS 1024      /* guard_ports: bitmap of 65536 ports */
#define GUARD_MAX_BUCKETS 131072   /* LRU of per-source token buckets */

/* guard_v4_summary: one bit per IPv4 /24 (2 MiB), set when some deny prefix
 * overlaps that /24. A source whose bit is clear skips the LPM lookup: with
 * thousands of prefixes the trie walk costs more than the rest of the program. */
#define GUARD_V4_SUMMARY_BITS 24
#define GUARD_V4_SUMMARY_WORDS (1 << (GUARD_V4_SUMMARY_BITS - 6))

/* guard_v4_hosts[/24 in host order, i.e. saddr >> 8]: one bit per address of that /24
 * that a /25../32 deny prefix covers (bit b of word b / 64 for last octet b). */
struct guard_v4_hosts {
	__u64 bits[4];
};

/* guard_v6_top[first 4 bytes of the address, as read from the packet]: the deny
 * prefixes of length >= 32 under that /32, in one of four forms (flags):
 *  GUARD_V6_ALL     the whole /32 is denied (a /32 or a shorter prefix covers it);
 *  GUARD_V6_INLINE  the `n` (<= GUARD_V6_INLINE_MAX) prefixes are here: len[i] and
 *                   pfx[i] (the masked address as two host-order u64s);
 *  0                `n` (<= GUARD_V6_MAX_LENS) distinct lengths in len[], each probed
 *                   in guard_v6_exact with the source masked to it;
 *  GUARD_V6_SEARCH  more lengths than that: a binary search on the length (33..128,
 *                   GUARD_V6_SEARCH_STEPS probes at most) in guard_v6_exact, whose
 *                   entries under such a /32 are the prefixes and markers (below);
 *  GUARD_V6_TRIE    walk guard_deny_v6 (the full trie): only while user space
 *                   rewrites the /32's entries (the trie holds old and new then).
 *
 * Binary search on prefix lengths (Waldvogel et al., SIGCOMM '97): the probe at length
 * m = (lo + hi) / 2 of the range [lo, hi] (first [33, 128]) looks up the source masked
 * to m. A hit whose value is GUARD_V6_DENY means a prefix of length <= m contains the
 * source: denied. A hit without it is a marker (longer prefixes lie under it): search
 * [m + 1, hi]; a miss: search [lo, m - 1]. Every prefix of length L has a marker at
 * each m < L on the search path to L. */
#define GUARD_V6_MAX_LENS 6
#define GUARD_V6_INLINE_MAX 2
#define GUARD_V6_ALL 0x1
#define GUARD_V6_TRIE 0x2
#define GUARD_V6_INLINE 0x4
#define GUARD_V6_SEARCH 0x8
#define GUARD_V6_SEARCH_LO 33
#define GUARD_V6_SEARCH_HI 128
#define GUARD_V6_SEARCH_STEPS 7 /* ceil(log2(96 + 1)) */
#define GUARD_V6_DENY 0x1 /* guard_v6_exact value: some prefix covers this key */
struct guard_v6_pfx {
	__u64 hi;
	__u64 lo;
};

struct guard_v6_top {
	__u8 n;
	__u8 flags;
	__u8 len[GUARD_V6_MAX_LENS];
	struct guard_v6_pfx pfx[GUARD_V6_INLINE_MAX];
};

/* Direct-mapped slots in front of guard_v4_hosts and guard_v6_top: an array lookup is
 * inlined by the verifier, a hash lookup costs ~30 ns. A key (the /24 as in
 * guard_v4_hosts, the /32 as in guard_v6_top) has slot
 * (key * GUARD_SLOT_HASH_MUL) >> (32 - GUARD_SLOT_BITS). A slot is EMPTY when no key
 * of the map has it, ONE (with that key and its value) when exactly one has, MULTI
 * when several have: then the hash map decides. */
#define GUARD_SLOT_BITS 16
#define GUARD_SLOTS (1 << GUARD_SLOT_BITS)
#define GUARD_SLOT_HASH_MUL 2654435761u
#define GUARD_SLOT_EMPTY 0
#define GUARD_SLOT_ONE 1
#define GUARD_SLOT_MULTI 2

struct guard_v4_slot {
	__u32 key;
	__u32 state;
	struct guard_v4_hosts hosts;
};

struct guard_v6_slot {
	__u32 key;
	__u32 state;
	struct guard_v6_top top;
};

/* guard_v6_eslots: direct-mapped buckets of two in front of guard_v6_exact (a length
 * search probes up to 7 times: a hash lookup costs ~35 ns, an inlined array lookup a
 * few). Key (len, hi, lo: the masked address as host-order halves) has bucket
 * ((hi ^ lo * GUARD_ESLOT_MUL2 ^ len) * GUARD_ESLOT_MUL1) >> (64 - GUARD_ESLOT_BITS).
 * A bucket holds the one or two keys that have it (state GUARD_SLOT_ONE, value the
 * guard_v6_exact value); with more, e[0].state is GUARD_SLOT_MULTI and the hash decides. */
#define GUARD_ESLOT_BITS 16
#define GUARD_ESLOTS (1 << GUARD_ESLOT_BITS)
#define GUARD_ESLOT_WAYS 2
#define GUARD_ESLOT_MUL1 0x9E3779B97F4A7C15ULL
#define GUARD_ESLOT_MUL2 0xC2B2AE3D27D4EB4FULL
struct guard_v6_eent {
	__u64 hi;
	__u64 lo;
	__u32 len;
	__u16 state;
	__u16 value;
};

struct guard_v6_eslot {
	struct guard_v6_eent e[GUARD_ESLOT_WAYS];
};

/* One token = GUARD_TOKEN_SCALE units; a bucket refills `syn_rate` units per ns. */
#define GUARD_TOKEN_SCALE 1000000000ULL
#define GUARD_MAX_RATE 1000000          /* syn_rate and syn_burst limit (config checks it) */
#define GUARD_MAX_ELAPSED_NS 10000000000ULL /* refill window cap: 10 s */

/* Key of guard_deny_v4 (and guard_v6_exact): prefix length in bits, then the address
 * in network order (masked to the length). */
struct guard_v4_key {
	__u32 prefixlen;
	__u8 addr[4];
};

struct guard_v6_key {
	__u32 prefixlen;
	__u8 addr[16];
};

/* Key of guard_buckets: IPv4 sources as ::ffff:a.b.c.d, IPv6 sources masked to
 * the load-time prefix (cfg_v6_bucket_bytes). */
struct guard_src {
	__u8 addr[16];
};

struct guard_bucket {
	__u64 tokens;   /* in 1/GUARD_TOKEN_SCALE tokens */
	__u64 stamp_ns; /* clock of the last refill (see guard_settings.jiffy_ns) */
};

/* guard_settings[0]: run-time settings, updated in place on reload. */
struct guard_settings {
	__u32 syn_rate;  /* new connections per second per source; 0 = no rate limit */
	__u32 syn_burst; /* bucket capacity in connections (>= 1 when syn_rate > 0) */
	/* ns per jiffy (1e9 / CONFIG_HZ): the buckets' clock is jiffies * jiffy_ns, from
	 * bpf_jiffies64(), which the verifier inlines; 0 = bpf_ktime_get_coarse_ns(), a
	 * helper call that costs more than the rest of the SYN path in a VM. Both tick
	 * once per jiffy. */
	__u32 jiffy_ns;
	__u32 _pad;
};

/* Indexes of the per-CPU guard_counters array. passed, dropped_deny,
 * dropped_ratelimit and dropped_malformed partition all packets seen;
 * malformed counts unparseable packets whatever happened to them. */
enum guard_counter {
	GUARD_PASSED = 0,
	GUARD_DROPPED_DENY = 1,
	GUARD_DROPPED_RATELIMIT = 2,
	GUARD_DROPPED_MALFORMED = 3,
	GUARD_MALFORMED = 4,
	GUARD_NR_COUNTERS = 5,
};

#endif /* AIPROXY_GUARD_H */
