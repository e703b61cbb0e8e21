// SPDX-License-Identifier: GPL-2.0
/* sk_splice: splice two TCP sockets in the kernel.
 *
 * User space (aiproxy/kernel/splice.py) puts both sockets of a tunnel into
 * splice_socks (key: socket cookie) and records each one's peer in splice_peers.
 * The stream verdict program runs for every skb a member socket receives and
 * redirects it to the egress of the peer socket: the bytes never reach user
 * space. A socket in splice_socks without a splice_peers entry gets SK_PASS: its
 * bytes are queued for recv() as usual. So does a socket whose peer is not armed yet
 * (include/splice.h: splice_armed).
 */
#include <linux/bpf.h>
#include <bpf/bpf_helpers.h>

#include "splice.h"

struct {
	__uint(type, BPF_MAP_TYPE_SOCKHASH);
	__type(key, __u64);   /* socket cookie */
	__type(value, __u64); /* socket (fd on update, cookie on lookup) */
	__uint(max_entries, SPLICE_MAX_SOCKS);
} splice_socks SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__type(key, __u64); /* socket cookie */
	__type(value, struct splice_peer);
	__uint(max_entries, SPLICE_MAX_SOCKS);
} splice_peers SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__type(key, __u64); /* socket cookie */
	__type(value, __u32);
	__uint(max_entries, SPLICE_MAX_SOCKS);
} splice_armed SEC(".maps");

SEC("sk_skb/stream_verdict")
int sk_splice_verdict(struct __sk_buff *skb)
{
	__u64 cookie = bpf_get_socket_cookie(skb);
	struct splice_peer *peer = bpf_map_lookup_elem(&splice_peers, &cookie);
	__u64 to;

	/* A FIN that arrives without data comes as an empty skb. Redirected, the peer's
	 * send backlog gets 0 from skb_send_sock() and breaks the peer with EPIPE; passed
	 * while this socket's own redirect queue is busy, it is queued behind it and breaks
	 * this socket the same way (the rest of the stream is then dropped). It carries
	 * nothing: TCP has already marked the socket shut for reading, so recv() returns
	 * 0 and poll() reports RDHUP without it. */
	if (skb->len == 0)
		return SK_DROP;
	if (!peer)
		return SK_PASS;
	/* The verdicts of one socket run one at a time, so `passed` cannot change under us.
	 * The peer's armed entry says the peer is in splice_socks, so a redirect finds it. */
	if (peer->passed || !bpf_map_lookup_elem(&splice_armed, &peer->peer)) {
		__sync_fetch_and_add(&peer->passed, skb->len);
		return SK_PASS;
	}
	to = peer->peer;
	__sync_fetch_and_add(&peer->bytes, skb->len);
	__sync_fetch_and_add(&peer->segs, 1);
	return bpf_sk_redirect_hash(skb, &splice_socks, &to, 0);
}

char _license[] SEC("license") = "GPL";
