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

/* splice_armed[cookie of a socket] exists once that socket is in splice_socks (user
 * space writes it right after the socket joins). A socket's bytes are redirected once
 * its peer has the entry; until then they are passed to user space (a redirect to a
 * peer not yet in the map would drop them), and once any byte was passed, every later
 * byte is passed too, so user space copies that direction in order. The socket that
 * joins second finds its peer armed already, so only the first has such a window.
 * Teardown deletes both entries before either socket leaves. */

#endif /* AIPROXY_SPLICE_H */
