/* sk_splice map family: shared by bpf/sk_splice.c and aiproxy/kernel/splice.py
 * (ctypes mirror in aiproxy/kernel/structs.py, checked by tests/kernel/test_structs.py). */
#ifndef AIPROXY_SPLICE_H
#define AIPROXY_SPLICE_H

#include <linux/types.h>

#define SPLICE_MAX_SOCKS 65536

/* splice_peers[cookie of a socket]: where its received bytes go. */
struct splice_peer {
	__u64 peer;  /* socket cookie of the peer (key in splice_socks) */
	__u64 bytes; /* bytes redirected from this socket to the peer */
	__u64 segs;  /* skbs redirected */
};

#endif /* AIPROXY_SPLICE_H */
