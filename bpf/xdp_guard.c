// SPDX-License-Identifier: GPL-2.0
/* xdp_guard: the cheapest decisions, taken before the kernel builds an skb.
 *
 *  1. Source deny list, exact CIDR semantics, without an LPM walk on the hot path:
 *     IPv4: guard_v4_summary has one bit per /24 that some prefix overlaps (clear:
 *     pass), guard_v4_full one bit per /24 a prefix of /24 or shorter covers whole
 *     (set: deny), and guard_v4_hosts, for a /24 that /25../32 prefixes touch, the
 *     256 bits of its addresses they cover, found through guard_v4_slots (an array
 *     in front of the hash). Three array lookups, a hash one only on slot clashes.
 *     IPv6: guard_v6_slots (an array in front of the guard_v6_top hash) lets most
 *     sources pass after one array lookup; guard_v6_top[first /32] says "all
 *     denied", or holds the one or two prefixes there, or which lengths (33..128)
 *     to probe in the guard_v6_exact hash with the source masked to each; a /32
 *     with too many distinct lengths is searched there by a binary search on the
 *     length (at most 7 probes), the guard_deny_v6 trie walked only while user
 *     space rewrites that /32. A source
 *     whose /32 has no entry is looked up in guard_deny_v6_short (prefixes shorter
 *     than /32) when that holds any.
 *     guard_deny_v4 / guard_deny_v6 are the LPM tries of every configured prefix:
 *     the record user space keeps the other maps in step with (and the answer for
 *     an IPv6 /32 while it is rewritten). Applies to every IP packet of a denied source,
 *     fragments included.
 *  2. New-connection rate limit: a TCP SYN without ACK to a port in guard_ports
 *     takes a token from the source's bucket (guard_buckets, LRU); no token, drop.
 *     Rate and burst live in guard_settings[0] and can change at run time.
 *  3. Everything else: XDP_PASS. Established flows are never looked at beyond the
 *     deny list, non-first fragments never have their (absent) L4 header read.
 *
 * Malformed packets (too short for the headers they announce) are passed by
 * default: the kernel's IP stack validates and drops them anyway, and XDP is not
 * the place to be stricter than the stack. cfg_drop_malformed = 1 drops them.
 * Either way they are counted in GUARD_MALFORMED.
 */
#include <linux/bpf.h>
#include <bpf/bpf_helpers.h>
#include <bpf/bpf_endian.h>

#include "parse.h"
#include "guard.h"

/* Load-time settings (rodata, frozen at load). */
const volatile __u8 cfg_drop_malformed = 0;
/* Leading bytes of an IPv6 source that identify a bucket: 16 = per /128,
 * 8 = per /64 (one bucket per customer prefix). */
const volatile __u8 cfg_v6_bucket_bytes = 16;

struct {
	__uint(type, BPF_MAP_TYPE_LPM_TRIE);
	__type(key, struct guard_v4_key);
	__type(value, __u32);
	__uint(max_entries, GUARD_MAX_DENY_V4);
	__uint(map_flags, BPF_F_NO_PREALLOC);
} guard_deny_v4 SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__type(key, __u32);
	__type(value, __u64);
	__uint(max_entries, GUARD_V4_SUMMARY_WORDS);
} guard_v4_summary SEC(".maps");

/* One bit per /24 that a deny prefix of /24 or shorter covers entirely: a source
 * there is denied without looking further. */
struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__type(key, __u32);
	__type(value, __u64);
	__uint(max_entries, GUARD_V4_SUMMARY_WORDS);
} guard_v4_full SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__type(key, __u32);
	__type(value, struct guard_v4_hosts);
	__uint(max_entries, GUARD_MAX_V4_HOSTS);
} guard_v4_hosts SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__type(key, __u32);
	__type(value, struct guard_v4_slot);
	__uint(max_entries, GUARD_SLOTS);
} guard_v4_slots SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_LPM_TRIE);
	__type(key, struct guard_v6_key);
	__type(value, __u32);
	__uint(max_entries, GUARD_MAX_DENY_V6);
	__uint(map_flags, BPF_F_NO_PREALLOC);
} guard_deny_v6 SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_LPM_TRIE);
	__type(key, struct guard_v6_key);
	__type(value, __u32);
	__uint(max_entries, GUARD_MAX_DENY_V6);
	__uint(map_flags, BPF_F_NO_PREALLOC);
} guard_deny_v6_short SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__type(key, __u32);
	__type(value, struct guard_v6_slot);
	__uint(max_entries, GUARD_SLOTS);
} guard_v6_slots SEC(".maps");

/* [0] nonzero when guard_deny_v6_short holds prefixes. */
struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__type(key, __u32);
	__type(value, __u64);
	__uint(max_entries, 1);
} guard_v6_short_on SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__type(key, __u32);
	__type(value, struct guard_v6_top);
	__uint(max_entries, GUARD_MAX_V6_TOPS);
} guard_v6_top SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__type(key, struct guard_v6_key);
	__type(value, __u32);
	__uint(max_entries, GUARD_MAX_V6_EXACT);
	__uint(map_flags, BPF_F_NO_PREALLOC); /* sized for markers; memory only as used */
} guard_v6_exact SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__type(key, __u32);
	__type(value, struct guard_v6_eslot);
	__uint(max_entries, GUARD_ESLOTS);
} guard_v6_eslots SEC(".maps");

/* Rate-limited destination ports: a 65536-bit bitmap (port p is bit p % 64 of word
 * p / 64). An array lookup is inlined by the verifier; a hash lookup is not free. */
struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__type(key, __u32);
	__type(value, __u64);
	__uint(max_entries, GUARD_PORT_WORDS);
} guard_ports SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_LRU_HASH);
	__type(key, struct guard_src);
	__type(value, struct guard_bucket);
	__uint(max_entries, GUARD_MAX_BUCKETS);
} guard_buckets SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__type(key, __u32);
	__type(value, struct guard_settings);
	__uint(max_entries, 1);
} guard_settings SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__type(key, __u32);
	__type(value, __u64);
	__uint(max_entries, GUARD_NR_COUNTERS);
} guard_counters SEC(".maps");

static __always_inline void count(__u32 idx)
{
	__u64 *c = bpf_map_lookup_elem(&guard_counters, &idx);

	if (c)
		*c += 1;
}

static __always_inline int verdict(__u32 idx, int action)
{
	count(idx);
	return action;
}

static __always_inline int denied_v4(struct iphdr *ip)
{
	__u32 saddr = bpf_ntohl(ip->saddr);
	__u32 top = saddr >> (32 - GUARD_V4_SUMMARY_BITS);
	__u32 word = top >> 6;
	struct guard_v4_hosts *h = NULL;
	struct guard_v4_slot *slot;
	__u64 *bits = bpf_map_lookup_elem(&guard_v4_summary, &word);
	__u32 b, idx;

	if (!bits || !(*bits & (1ULL << (top & 63))))
		return 0;
	bits = bpf_map_lookup_elem(&guard_v4_full, &word);
	if (bits && (*bits & (1ULL << (top & 63))))
		return 1;
	idx = (top * GUARD_SLOT_HASH_MUL) >> (32 - GUARD_SLOT_BITS);
	slot = bpf_map_lookup_elem(&guard_v4_slots, &idx);
	if (!slot)
		return 0;
	if (slot->state == GUARD_SLOT_ONE && slot->key == top)
		h = &slot->hosts;
	else if (slot->state == GUARD_SLOT_MULTI)
		h = bpf_map_lookup_elem(&guard_v4_hosts, &top);
	if (!h)
		return 0;
	b = saddr & 255;
	return (h->bits[b >> 6] >> (b & 63)) & 1;
}

static __always_inline __u64 mask_hi(__u64 hi, __u32 len)
{
	return len >= 64 ? hi : hi & (~0ULL << (64 - len));
}

static __always_inline __u64 mask_lo(__u64 lo, __u32 len)
{
	return len >= 128 ? lo : len <= 64 ? 0 : lo & (~0ULL << (128 - len));
}

/* guard_v6_exact's value for the source masked to len (-1: no entry), from its bucket
 * in guard_v6_eslots unless that overflowed. */
static __always_inline int probe_v6(struct guard_v6_key *k, __u64 hi, __u64 lo, __u32 len)
{
	__u64 mh = mask_hi(hi, len), ml = mask_lo(lo, len);
	__u32 idx = ((mh ^ ml * GUARD_ESLOT_MUL2 ^ len) * GUARD_ESLOT_MUL1) >> (64 - GUARD_ESLOT_BITS);
	struct guard_v6_eslot *slot = bpf_map_lookup_elem(&guard_v6_eslots, &idx);
	__u32 *v;

	if (!slot)
		return -1;
	if (slot->e[0].state != GUARD_SLOT_MULTI) {
		if (slot->e[0].state == GUARD_SLOT_ONE && slot->e[0].len == len &&
		    slot->e[0].hi == mh && slot->e[0].lo == ml)
			return slot->e[0].value;
		if (slot->e[1].state == GUARD_SLOT_ONE && slot->e[1].len == len &&
		    slot->e[1].hi == mh && slot->e[1].lo == ml)
			return slot->e[1].value;
		return -1;
	}
	k->prefixlen = len;
	mh = bpf_cpu_to_be64(mh);
	ml = bpf_cpu_to_be64(ml);
	__builtin_memcpy(&k->addr[0], &mh, 8);
	__builtin_memcpy(&k->addr[8], &ml, 8);
	v = bpf_map_lookup_elem(&guard_v6_exact, k);
	return v ? *v : -1;
}

/* Binary search on the length for a crowded /32 (guard.h: GUARD_V6_SEARCH). */
static __always_inline int search_v6(struct guard_v6_key *k, __u64 hi, __u64 lo)
{
	__u32 lo_len = GUARD_V6_SEARCH_LO, hi_len = GUARD_V6_SEARCH_HI;
	int i, v;

	/* A bounded loop, not unrolled: the verifier walks its 7 rounds. */
	for (i = 0; i < GUARD_V6_SEARCH_STEPS && lo_len <= hi_len; i++) {
		__u32 mid = (lo_len + hi_len) >> 1;

		v = probe_v6(k, hi, lo, mid);
		if (v < 0) {
			hi_len = mid - 1;
		} else if (v & GUARD_V6_DENY) {
			return 1;
		} else {
			lo_len = mid + 1;
		}
	}
	return 0;
}

/* A global function: the verifier checks it once, on its own, instead of once per
 * parse path of every caller (which took seconds to load). Source address as two
 * host-order halves. */
__attribute__((noinline)) int guard_denied_v6(__u64 hi, __u64 lo)
{
	struct guard_v6_key k = { .prefixlen = 128 };
	struct guard_v6_top *t;
	struct guard_v6_slot *slot;
	__u64 be_hi = bpf_cpu_to_be64(hi), be_lo = bpf_cpu_to_be64(lo), *on;
	__u32 top, idx, zero = 0;
	int i;

	__builtin_memcpy(&k.addr[0], &be_hi, 8);
	__builtin_memcpy(&k.addr[8], &be_lo, 8);
	__builtin_memcpy(&top, &k.addr[0], 4);
	idx = (top * GUARD_SLOT_HASH_MUL) >> (32 - GUARD_SLOT_BITS);
	slot = bpf_map_lookup_elem(&guard_v6_slots, &idx);
	t = NULL;
	if (slot && slot->state == GUARD_SLOT_ONE && slot->key == top)
		t = &slot->top;
	else if (slot && slot->state == GUARD_SLOT_MULTI)
		t = bpf_map_lookup_elem(&guard_v6_top, &top);
	if (!t) {
		on = bpf_map_lookup_elem(&guard_v6_short_on, &zero);
		if (!on || !*on)
			return 0;
		return bpf_map_lookup_elem(&guard_deny_v6_short, &k) != NULL;
	}
	if (t->flags & GUARD_V6_ALL)
		return 1;
	if (t->flags & GUARD_V6_TRIE)
		return bpf_map_lookup_elem(&guard_deny_v6, &k) != NULL;
	if (t->flags & GUARD_V6_SEARCH)
		return search_v6(&k, hi, lo);
	if (t->flags & GUARD_V6_INLINE) {
#pragma unroll
		for (i = 0; i < GUARD_V6_INLINE_MAX; i++) {
			__u32 len;

			if (i >= t->n)
				break;
			len = t->len[i];
			if (mask_hi(hi, len) == t->pfx[i].hi && mask_lo(lo, len) == t->pfx[i].lo)
				return 1;
		}
		return 0;
	}
#pragma unroll
	for (i = 0; i < GUARD_V6_MAX_LENS; i++) {
		__u32 len;
		int v;

		if (i >= t->n)
			break;
		len = t->len[i];
		if (len <= GUARD_V6_SHORT || len > 128)
			continue;
		v = probe_v6(&k, hi, lo, len);
		if (v > 0 && (v & GUARD_V6_DENY))
			return 1;
	}
	return 0;
}

static __always_inline int denied(struct pkt *p)
{
	if (p->ip4)
		return denied_v4(p->ip4);
	if (p->ip6) {
		__u64 hi, lo;

		__builtin_memcpy(&hi, &p->ip6->saddr.in6_u.u6_addr8[0], 8);
		__builtin_memcpy(&lo, &p->ip6->saddr.in6_u.u6_addr8[8], 8);
		return guard_denied_v6(bpf_be64_to_cpu(hi), bpf_be64_to_cpu(lo));
	}
	return 0;
}

/* 1 = allowed (a token was taken), 0 = over the limit. */
static __always_inline int take_token(struct pkt *p)
{
	__u32 zero = 0;
	struct guard_settings *s = bpf_map_lookup_elem(&guard_settings, &zero);
	struct guard_src src = {};
	struct guard_bucket *b;
	__u64 now, cap, tokens, elapsed;
	__u32 rate;

	if (!s || s->syn_rate == 0)
		return 1;
	rate = s->syn_rate < GUARD_MAX_RATE ? s->syn_rate : GUARD_MAX_RATE;
	cap = s->syn_burst < GUARD_MAX_RATE ? s->syn_burst : GUARD_MAX_RATE;
	cap = (cap ? cap : 1) * GUARD_TOKEN_SCALE;

	if (p->ip4) {
		src.addr[10] = 0xff;
		src.addr[11] = 0xff;
		__builtin_memcpy(&src.addr[12], &p->ip4->saddr, 4);
	} else if (p->ip6) {
		__builtin_memcpy(src.addr, &p->ip6->saddr, 16);
		if (cfg_v6_bucket_bytes <= 8)
			__builtin_memset(&src.addr[8], 0, 8);
	}

	/* Jiffies resolution is enough for a bucket refilled by elapsed time. */
	now = s->jiffy_ns ? bpf_jiffies64() * s->jiffy_ns : bpf_ktime_get_coarse_ns();
	b = bpf_map_lookup_elem(&guard_buckets, &src);
	if (!b) {
		struct guard_bucket fresh = { .tokens = cap - GUARD_TOKEN_SCALE, .stamp_ns = now };

		bpf_map_update_elem(&guard_buckets, &src, &fresh, BPF_ANY);
		return 1;
	}
	/* Refill: `rate` units per ns, capped at `cap`. elapsed is capped first so the
	 * product cannot overflow (rate <= 1e6/s: 1e10 ns * 1e6 < 2^64). Racing CPUs may
	 * lose an update; the limit is approximate under contention, never unbounded. */
	tokens = b->tokens;
	elapsed = now > b->stamp_ns ? now - b->stamp_ns : 0;
	if (elapsed > GUARD_MAX_ELAPSED_NS)
		elapsed = GUARD_MAX_ELAPSED_NS;
	tokens += elapsed * rate;
	if (tokens > cap)
		tokens = cap; /* also when burst was lowered at run time */
	b->stamp_ns = now;
	if (tokens < GUARD_TOKEN_SCALE) {
		b->tokens = tokens;
		return 0;
	}
	b->tokens = tokens - GUARD_TOKEN_SCALE;
	return 1;
}

SEC("xdp")
int xdp_guard(struct xdp_md *ctx)
{
	void *data = (void *)(long)ctx->data;
	void *data_end = (void *)(long)ctx->data_end;
	struct pkt p = {};
	int rc;

	rc = parse_packet(&p, data, data_end);
	if (rc == PARSE_NOT_IP)
		return verdict(GUARD_PASSED, XDP_PASS);
	if (rc == PARSE_MALFORMED)
		goto malformed;

	if (denied(&p))
		return verdict(GUARD_DROPPED_DENY, XDP_DROP);

	if (p.l4 && p.l4_proto == IPPROTO_TCP) {
		struct tcphdr *tcp = p.l4;

		if (tcp->syn && !tcp->ack) {
			__u32 port = bpf_ntohs(tcp->dest);
			__u32 word = port >> 6;
			__u64 *bits = bpf_map_lookup_elem(&guard_ports, &word);

			if (bits && (*bits & (1ULL << (port & 63))) && !take_token(&p))
				return verdict(GUARD_DROPPED_RATELIMIT, XDP_DROP);
		}
	}
	if (p.malformed)
		goto malformed;
	return verdict(GUARD_PASSED, XDP_PASS);

malformed:
	count(GUARD_MALFORMED);
	if (cfg_drop_malformed)
		return verdict(GUARD_DROPPED_MALFORMED, XDP_DROP);
	return verdict(GUARD_PASSED, XDP_PASS);
}

char _license[] SEC("license") = "GPL";
