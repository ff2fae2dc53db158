/*
 * Clearing the killed job's TIME_WAIT sockets off the addresses a restore
 * needs again.
 *
 * When a job is killed its TCP connections close, and the end that closed
 * first lingers in TIME_WAIT for a minute, owning its address.  A listener
 * cannot bind that port again, nor a connection its four addresses, unless
 * the job had asked for SO_REUSEADDR.  TIME_WAIT sockets belong to no
 * process: with CAP_NET_ADMIN they can be destroyed (SOCK_DESTROY through
 * NETLINK_SOCK_DIAG, what `ss -K` does).  Without it nothing is destroyed
 * and the restore falls back to what SO_REUSEADDR allows.
 */
#include "restorer.h"

#include <errno.h>
#include <linux/inet_diag.h>
#include <linux/netlink.h>
#include <linux/sock_diag.h>
#include <netinet/in.h>
#include <sys/socket.h>

#ifndef SOCK_DESTROY
#define SOCK_DESTROY 21
#endif
#define TCP_TIME_WAIT_STATE 6
#define MAX_VICTIMS 256

struct diag_request {
    struct nlmsghdr nh;
    struct inet_diag_req_v2 req;
};

static long nl_send(int nl, uint16_t type, uint16_t flags, int family, const struct inet_diag_sockid *id)
{
    struct diag_request rq;
    ck_memset(&rq, 0, sizeof(rq));
    rq.nh.nlmsg_len = sizeof(rq);
    rq.nh.nlmsg_type = type;
    rq.nh.nlmsg_flags = flags;
    rq.req.sdiag_family = (uint8_t)family;
    rq.req.sdiag_protocol = IPPROTO_TCP;
    rq.req.idiag_states = 1u << TCP_TIME_WAIT_STATE;
    if (id)
        rq.req.id = *id;
    struct sockaddr_nl sa;
    ck_memset(&sa, 0, sizeof(sa));
    sa.nl_family = AF_NETLINK;
    return ck_sendto(nl, &rq, sizeof(rq), 0, &sa, sizeof(sa));
}

/* the address part of a sockaddr as the diag id holds it */
static int local_of(const void *addr, size_t len, int *family, uint16_t *port, uint32_t ip[4])
{
    const struct sockaddr_in *v4 = addr;
    const struct sockaddr_in6 *v6 = addr;
    ck_memset(ip, 0, 16);
    if (len >= sizeof(*v4) && v4->sin_family == AF_INET) {
        *family = AF_INET;
        *port = v4->sin_port;
        ip[0] = v4->sin_addr.s_addr;
        return 0;
    }
    if (len >= sizeof(*v6) && v6->sin6_family == AF_INET6) {
        *family = AF_INET6;
        *port = v6->sin6_port;
        ck_memcpy(ip, &v6->sin6_addr, 16);
        return 0;
    }
    return -EAFNOSUPPORT;
}

long rst_tcp_clear_time_wait(const void *addr, size_t len)
{
    int family;
    uint16_t port;
    uint32_t ip[4];
    if (local_of(addr, len, &family, &port, ip) < 0 || !port)
        return 0;
    long nl = ck_socket(AF_NETLINK, SOCK_DGRAM | SOCK_CLOEXEC, NETLINK_SOCK_DIAG);
    if (nl < 0)
        return nl;
    static struct inet_diag_sockid victims[MAX_VICTIMS];
    static char buf[32768];
    int nvictims = 0;
    long rc = nl_send((int)nl, SOCK_DIAG_BY_FAMILY, NLM_F_REQUEST | NLM_F_DUMP, family, 0);
    for (int done = rc < 0; !done;) {
        long n = ck_read((int)nl, buf, sizeof(buf));
        if (n == -EINTR)
            continue;
        if (n <= 0) {
            rc = n < 0 ? n : -EIO;
            break;
        }
        for (struct nlmsghdr *nh = (void *)buf; NLMSG_OK(nh, (unsigned)n); nh = NLMSG_NEXT(nh, n)) {
            if (nh->nlmsg_type == NLMSG_DONE || nh->nlmsg_type == NLMSG_ERROR) {
                done = 1;
                break;
            }
            const struct inet_diag_msg *m = NLMSG_DATA(nh);
            int same_ip = family == AF_INET ? m->id.idiag_src[0] == ip[0] : !ck_memcmp(m->id.idiag_src, ip, 16);
            if (m->id.idiag_sport == port && same_ip && nvictims < MAX_VICTIMS)
                victims[nvictims++] = m->id;
        }
    }
    long destroyed = 0;
    for (int i = 0; i < nvictims && rc >= 0; i++) {
        rc = nl_send((int)nl, SOCK_DESTROY, NLM_F_REQUEST | NLM_F_ACK, family, &victims[i]);
        long n;
        do
            n = ck_read((int)nl, buf, sizeof(buf));
        while (n == -EINTR);
        struct nlmsghdr *nh = (void *)buf;
        if (rc >= 0 && n >= (long)sizeof(*nh) && nh->nlmsg_type == NLMSG_ERROR) {
            const struct nlmsgerr *e = NLMSG_DATA(nh);
            rc = e->error;  /* -EPERM without CAP_NET_ADMIN */
        }
        if (rc >= 0)
            destroyed++;
    }
    ck_close((int)nl);
    return rc < 0 ? rc : destroyed;
}
