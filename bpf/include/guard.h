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
#define GUARD_PORT_WORDS 1024      /* guard_ports: bitmap of 65536 ports */
#define GUARD_MAX_BUCKETS 131072   /* LRU of per-source token buckets */

/* guard_v4_summary: one bit per IPv4 /24 (2 MiB), set when some deny prefix
 * overlaps that /24. A source whose bit is clear skips the LPM lookup: with
 * thousands of prefixes the trie walk costs more than the rest of the program. */
#define GUARD_V4_SUMMARY_BITS 24
#define GUARD_V4_SUMMARY_WORDS (1 << (GUARD_V4_SUMMARY_BITS - 6))

/* One token = GUARD_TOKEN_SCALE units; a bucket refills `syn_rate` units per ns. */
#define GUARD_TOKEN_SCALE 1000000000ULL
#define GUARD_MAX_RATE 1000000          /* syn_rate and syn_burst limit (config checks it) */
#define GUARD_MAX_ELAPSED_NS 10000000000ULL /* refill window cap: 10 s */

/* Key of guard_deny_v4: prefix length in bits, then the address in network order. */
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
	__u64 stamp_ns; /* bpf_ktime_get_ns() of the last refill */
};

/* guard_settings[0]: run-time settings, updated in place on reload. */
struct guard_settings {
	__u32 syn_rate;  /* new connections per second per source; 0 = no rate limit */
	__u32 syn_burst; /* bucket capacity in connections (>= 1 when syn_rate > 0) */
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
