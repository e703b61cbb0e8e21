/* tc_classify map family: shared by bpf/tc_classify.c and aiproxy/kernel/maps.py
 * (ctypes mirror in aiproxy/kernel/structs.py, checked by tests/kernel/test_structs.py). */
#ifndef AIPROXY_CLASSIFY_H
#define AIPROXY_CLASSIFY_H

#include <linux/types.h>

/* Class ids index class_info / class_stats; id 0 is "unclassified". */
#define CLASSIFY_MAX_CLASSES 16
#define CLASSIFY_MAX_PORTS 1024

#define CLASS_SET_PRIORITY 0x1
#define CLASS_SET_DSCP 0x2

struct class_info {
	__u32 priority; /* skb->priority when CLASS_SET_PRIORITY */
	__u8 dscp;      /* 0..63, written to IPv4 TOS / IPv6 traffic class when CLASS_SET_DSCP */
	__u8 flags;
	__u16 _pad;
};

struct class_stats {
	__u64 packets;
	__u64 bytes;
};

/* Indexes of class_sigs (payload signature -> class id, 0 = signature off). */
enum class_sig {
	SIG_H2_PREFACE = 0, /* "PRI * HTTP/2.0\r\n" */
	SIG_POST_V1 = 1,    /* "POST /v1/" */
	SIG_NR = 2,
};

#endif /* AIPROXY_CLASSIFY_H */
