/* Packet parsing shared by the XDP and TC programs (kernel side only).
 *
 * parse_packet() walks Ethernet, up to two VLAN tags (802.1Q / 802.1ad), IPv4
 * (with options: ihl) or IPv6 (with up to PARSE_MAX_V6_EXT extension headers),
 * and finds the L4 header. Every access is bounds-checked against data_end.
 *
 * Results:
 *   PARSE_NOT_IP     not IPv4/IPv6 (ARP, LLDP, ...)
 *   PARSE_MALFORMED  too short or inconsistent before the source address could be read
 *   PARSE_OK         p->ip4 or p->ip6 set; p->l4 set only when the L4 header is complete
 *                    and this is not a non-first fragment. p->malformed is set when the
 *                    L3 header was readable but something after it was not (truncated
 *                    options / extension headers / TCP header).
 */
#ifndef AIPROXY_PARSE_H
#define AIPROXY_PARSE_H

#include <linux/types.h>
#include <linux/if_ether.h>
#include <linux/ip.h>
#include <linux/ipv6.h>
#include <linux/in.h>
#include <linux/tcp.h>
#include <linux/udp.h>
#include <bpf/bpf_helpers.h>
#include <bpf/bpf_endian.h>

#ifndef ETH_P_8021AD
#define ETH_P_8021AD 0x88A8
#endif

#define PARSE_MAX_VLAN 2
#ifndef PARSE_MAX_V6_EXT
#define PARSE_MAX_V6_EXT 4 /* verifier time grows fast with this: 6 costs 4x the load time */
#endif

enum parse_result {
	PARSE_OK = 0,
	PARSE_NOT_IP = 1,
	PARSE_MALFORMED = 2,
};

struct vlan_hdr_ {
	__be16 tci;
	__be16 proto;
};

struct v6_opt_hdr_ {
	__u8 nexthdr;
	__u8 hdrlen;
};

struct v6_frag_hdr_ {
	__u8 nexthdr;
	__u8 reserved;
	__be16 frag_off;
	__be32 identification;
};

struct pkt {
	struct iphdr *ip4;
	struct ipv6hdr *ip6;
	void *l4;        /* start of a complete TCP/UDP header, or NULL */
	__u32 l3_off;    /* offset of the IP header from data */
	__u8 l4_proto;   /* IPPROTO_* of the upper layer (0 if unknown) */
	__u8 fragment;   /* part of a fragmented datagram */
	__u8 nonfirst;   /* non-first fragment: no L4 header here, never read one */
	__u8 malformed;
};

static __always_inline int parse_l4(struct pkt *p, void *l4, void *data_end)
{
	if (p->nonfirst)
		return PARSE_OK;
	if (p->l4_proto == IPPROTO_TCP) {
		struct tcphdr *tcp = l4;

		if ((void *)(tcp + 1) > data_end || tcp->doff < 5) {
			p->malformed = 1;
			return PARSE_OK;
		}
		p->l4 = tcp;
	} else if (p->l4_proto == IPPROTO_UDP) {
		struct udphdr *udp = l4;

		if ((void *)(udp + 1) > data_end) {
			p->malformed = 1;
			return PARSE_OK;
		}
		p->l4 = udp;
	}
	return PARSE_OK;
}

static __always_inline int parse_ipv4(struct pkt *p, void *data, void *data_end, __u32 off)
{
	struct iphdr *ip = data + off;
	__u32 hlen;

	if ((void *)(ip + 1) > data_end)
		return PARSE_MALFORMED;
	if (ip->version != 4 || ip->ihl < 5)
		return PARSE_MALFORMED;
	p->ip4 = ip;
	p->l3_off = off;
	p->l4_proto = ip->protocol;
	if (ip->frag_off & bpf_htons(0x3fff)) { /* MF or an offset */
		p->fragment = 1;
		p->nonfirst = (ip->frag_off & bpf_htons(0x1fff)) != 0;
	}
	hlen = ip->ihl * 4; /* 20..60: ihl is 4 bits */
	if ((void *)ip + hlen > data_end) {
		p->malformed = 1; /* options cut short: L3 source still valid */
		return PARSE_OK;
	}
	return parse_l4(p, (void *)ip + hlen, data_end);
}

static __always_inline int parse_ipv6(struct pkt *p, void *data, void *data_end, __u32 off)
{
	struct ipv6hdr *ip6 = data + off;
	void *cur;
	__u8 nh;
	int i;

	if ((void *)(ip6 + 1) > data_end)
		return PARSE_MALFORMED;
	if (ip6->version != 6)
		return PARSE_MALFORMED;
	p->ip6 = ip6;
	p->l3_off = off;
	nh = ip6->nexthdr;
	cur = ip6 + 1;

#pragma unroll
	for (i = 0; i < PARSE_MAX_V6_EXT; i++) {
		if (nh == IPPROTO_HOPOPTS || nh == IPPROTO_ROUTING || nh == IPPROTO_DSTOPTS) {
			struct v6_opt_hdr_ *h = cur;

			if ((void *)(h + 1) > data_end)
				goto truncated;
			nh = h->nexthdr;
			cur += (h->hdrlen + 1) * 8;
		} else if (nh == IPPROTO_AH) {
			struct v6_opt_hdr_ *h = cur;

			if ((void *)(h + 1) > data_end)
				goto truncated;
			nh = h->nexthdr;
			cur += (h->hdrlen + 2) * 4;
		} else if (nh == IPPROTO_FRAGMENT) {
			struct v6_frag_hdr_ *f = cur;

			if ((void *)(f + 1) > data_end)
				goto truncated;
			p->fragment = 1;
			if (f->frag_off & bpf_htons(0xfff8))
				p->nonfirst = 1;
			nh = f->nexthdr;
			cur = f + 1;
		} else {
			break;
		}
	}
	p->l4_proto = nh;
	if (nh == IPPROTO_HOPOPTS || nh == IPPROTO_ROUTING || nh == IPPROTO_DSTOPTS ||
	    nh == IPPROTO_AH || nh == IPPROTO_FRAGMENT) {
		/* More extension headers than we walk: leave L4 unknown. */
		p->l4_proto = 0;
		return PARSE_OK;
	}
	if (cur > data_end)
		goto truncated;
	return parse_l4(p, cur, data_end);
truncated:
	p->l4_proto = 0;
	p->malformed = 1;
	return PARSE_OK;
}

static __always_inline int parse_packet(struct pkt *p, void *data, void *data_end)
{
	struct ethhdr *eth = data;
	__u32 off = sizeof(*eth);
	__be16 proto;
	int i;

	if ((void *)(eth + 1) > data_end)
		return PARSE_MALFORMED;
	proto = eth->h_proto;

#pragma unroll
	for (i = 0; i < PARSE_MAX_VLAN; i++) {
		struct vlan_hdr_ *vh;

		if (proto != bpf_htons(ETH_P_8021Q) && proto != bpf_htons(ETH_P_8021AD))
			break;
		vh = data + off;
		if ((void *)(vh + 1) > data_end)
			return PARSE_MALFORMED;
		proto = vh->proto;
		off += sizeof(*vh);
	}
	if (proto == bpf_htons(ETH_P_IP))
		return parse_ipv4(p, data, data_end, off);
	if (proto == bpf_htons(ETH_P_IPV6))
		return parse_ipv6(p, data, data_end, off);
	if (proto == bpf_htons(ETH_P_8021Q) || proto == bpf_htons(ETH_P_8021AD))
		return PARSE_MALFORMED; /* more tags than PARSE_MAX_VLAN */
	return PARSE_NOT_IP;
}

#endif /* AIPROXY_PARSE_H */
