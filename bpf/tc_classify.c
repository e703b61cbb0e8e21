// SPDX-License-Identifier: GPL-2.0
/* tc_classify: clsact ingress/egress classifier for AI traffic.
 *
 * A packet's class comes from, in order:
 *   1. the first bytes of a TCP payload (cheap: one 16-byte load) when a signature
 *      is enabled in class_sigs: the HTTP/2 client preface "PRI * HTTP/2.0\r\n"
 *      or an OpenAI-style "POST /v1/" request line;
 *   2. the TCP/UDP destination port, then the source port, in class_ports.
 * For a class with CLASS_SET_PRIORITY the program sets skb->priority; with
 * CLASS_SET_DSCP it rewrites the DSCP bits (IPv4 TOS with the header checksum
 * fixed by bpf_l3_csum_replace, IPv6 traffic class), keeping ECN. Packets and
 * bytes are counted per class (class 0 = unclassified IP traffic).
 * Always TC_ACT_OK: this program marks, it never drops.
 */
#include <linux/bpf.h>
#include <linux/pkt_cls.h>
#include <bpf/bpf_helpers.h>
#include <bpf/bpf_endian.h>

#include "parse.h"
#include "classify.h"

/* Load-time: 0 turns payload sniffing off (ports only). */
const volatile __u8 cfg_payload_match = 1;

struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__type(key, __u16); /* port, host order */
	__type(value, __u32); /* class id */
	__uint(max_entries, CLASSIFY_MAX_PORTS);
} class_ports SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__type(key, __u32);   /* enum class_sig */
	__type(value, __u32); /* class id, 0 = off */
	__uint(max_entries, SIG_NR);
} class_sigs SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__type(key, __u32);
	__type(value, struct class_info);
	__uint(max_entries, CLASSIFY_MAX_CLASSES);
} class_info SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__type(key, __u32);
	__type(value, struct class_stats);
	__uint(max_entries, CLASSIFY_MAX_CLASSES);
} class_stats SEC(".maps");

#define LE8(a, b, c, d, e, f, g, h)                                                  \
	((__u64)(a) | (__u64)(b) << 8 | (__u64)(c) << 16 | (__u64)(d) << 24 |         \
	 (__u64)(e) << 32 | (__u64)(f) << 40 | (__u64)(g) << 48 | (__u64)(h) << 56)

#define PREFACE_0 LE8('P', 'R', 'I', ' ', '*', ' ', 'H', 'T')
#define PREFACE_1 LE8('T', 'P', '/', '2', '.', '0', '\r', '\n')
#define POST_V1_0 LE8('P', 'O', 'S', 'T', ' ', '/', 'v', '1')
#define POST_V1_8 '/'

static __always_inline __u32 sig_class(__u32 sig)
{
	__u32 *id = bpf_map_lookup_elem(&class_sigs, &sig);

	return id ? *id : 0;
}

static __always_inline __u32 payload_class(struct __sk_buff *skb, __u32 off)
{
	__u64 w[2];

	if (skb->len >= off + 16 && bpf_skb_load_bytes(skb, off, w, 16) == 0) {
		if (w[0] == PREFACE_0 && w[1] == PREFACE_1)
			return sig_class(SIG_H2_PREFACE);
	} else if (skb->len < off + 9 || bpf_skb_load_bytes(skb, off, w, 9) != 0) {
		return 0;
	}
	if (w[0] == POST_V1_0 && (w[1] & 0xff) == POST_V1_8)
		return sig_class(SIG_POST_V1);
	return 0;
}

static __always_inline __u32 port_class(__u16 port)
{
	__u32 *id = bpf_map_lookup_elem(&class_ports, &port);

	return id ? *id : 0;
}

static __always_inline void set_dscp(struct __sk_buff *skb, struct pkt *p, __u8 dscp)
{
	if (p->ip4) {
		__u8 hdr[2], old_tos = p->ip4->tos;
		__u16 old_w, new_w;

		__builtin_memcpy(hdr, p->ip4, 2);
		__builtin_memcpy(&old_w, hdr, 2);
		hdr[1] = (dscp << 2) | (old_tos & 0x3);
		__builtin_memcpy(&new_w, hdr, 2);
		if (old_w == new_w)
			return;
		bpf_l3_csum_replace(skb, p->l3_off + offsetof(struct iphdr, check), old_w, new_w, 2);
		bpf_skb_store_bytes(skb, p->l3_off, hdr, 2, 0);
	} else if (p->ip6) {
		__u8 hdr[2], tc;

		__builtin_memcpy(hdr, p->ip6, 2);
		/* version(4) | traffic class(8) | flow label(20) */
		tc = (hdr[0] << 4) | (hdr[1] >> 4);
		tc = (dscp << 2) | (tc & 0x3);
		hdr[0] = (hdr[0] & 0xf0) | (tc >> 4);
		hdr[1] = (hdr[1] & 0x0f) | (tc << 4);
		bpf_skb_store_bytes(skb, p->l3_off, hdr, 2, 0);
	}
}

SEC("tc")
int tc_classify(struct __sk_buff *skb)
{
	void *data = (void *)(long)skb->data;
	void *data_end = (void *)(long)skb->data_end;
	struct class_stats *st;
	struct class_info *info;
	struct pkt p = {};
	__u32 id = 0;

	/* Headers beyond the linear part (rare: GSO/GRO'd or fragmented skbs): pull up
	 * to 128 bytes in once, before parsing. */
	if (data_end - data < 128 && skb->len > data_end - data) {
		if (bpf_skb_pull_data(skb, skb->len < 128 ? skb->len : 128))
			return TC_ACT_OK;
		data = (void *)(long)skb->data;
		data_end = (void *)(long)skb->data_end;
	}
	if (parse_packet(&p, data, data_end) != PARSE_OK)
		return TC_ACT_OK;

	if (p.l4 && p.l4_proto == IPPROTO_TCP) {
		struct tcphdr *tcp = p.l4;
		__u32 payload = (void *)tcp - data + tcp->doff * 4;

		if (cfg_payload_match && skb->len > payload)
			id = payload_class(skb, payload);
		if (!id)
			id = port_class(bpf_ntohs(tcp->dest));
		if (!id)
			id = port_class(bpf_ntohs(tcp->source));
	} else if (p.l4 && p.l4_proto == IPPROTO_UDP) {
		struct udphdr *udp = p.l4;

		id = port_class(bpf_ntohs(udp->dest));
		if (!id)
			id = port_class(bpf_ntohs(udp->source));
	}
	if (id >= CLASSIFY_MAX_CLASSES)
		id = 0;

	st = bpf_map_lookup_elem(&class_stats, &id);
	if (st) {
		st->packets += 1;
		st->bytes += skb->len;
	}
	if (!id)
		return TC_ACT_OK;
	info = bpf_map_lookup_elem(&class_info, &id);
	if (!info)
		return TC_ACT_OK;
	if (info->flags & CLASS_SET_PRIORITY)
		skb->priority = info->priority;
	if (info->flags & CLASS_SET_DSCP)
		set_dscp(skb, &p, info->dscp & 0x3f); /* last: invalidates packet pointers */
	return TC_ACT_OK;
}

char _license[] SEC("license") = "GPL";
