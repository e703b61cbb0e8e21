/* sk_splice map family: shared by bpf/sk_splice.c and aiproxy/kernel/splice.py
 * (ctypes mirror in aiproxy/kernel/structs.py, checked by tests/kernel/test_structs.py). */
#ifndef AIPROXY_SPLICE_H
#define AIPROXY_SPLICE_H

#include <linux/types.h>

#define SPLICE_MAX_SOCKS 65536

/* splice_peers[cookie of a socket]: where its received bytes go. */
struct splice_peer {
	__u64 peer;   /* socket cookie of the peer (key in splice_socks) */
	__u64 bytes;  /* bytes redirected from this socket to the peer */
	__u64 segs;   /* skbs redirected */
	__u64 passed; /* bytes handed to user space instead (see splice_armed) */
};

/* splice_armed[cookie of a socket] exists once both sockets of its pair are in
 * splice_socks. Until then its bytes are passed to user space (a redirect to a peer not
 * yet in the map would drop them); once any byte was passed, every later byte is
 * passed too, so user space copies that direction in order. */

#endif /* AIPROXY_SPLICE_H */
