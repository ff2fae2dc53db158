/*
 * Unix domain sockets: what the restore plan needs to build each one again.
 *
 * The kernel tells us a socket's type, state, bound name, peer and shutdown
 * state through NETLINK_SOCK_DIAG (unix_diag), queried by inode.  The bytes
 * queued for reading are copied without consuming them: MSG_PEEK walking
 * forward with SO_PEEK_OFF.  Datagram and seqpacket queues keep their
 * message boundaries (each record is a uint32 length, then the bytes).
 * Descriptors in flight (SCM_RIGHTS not yet received) are saved with the
 * messages that carry them: see "Descriptors in flight" below.  A listener's
 * backlog: save_backlog.
 *
 * TCP sockets are described in dump_tcp.c; UDP, ping and raw ones in
 * dump_dgram.c.
 *
 * Which process builds which socket, and how the two ends of a pair meet
 * again, is decided from every process's image by the agent (ckptd/image/
 * plan/unix.py); the shim only describes what it holds.  The restorer builds
 * them again in native/restorer/plan_unix.c.
 */
#include "shim.h"
#include "../common/sys.h"
#include "../common/util.h"

#include <errno.h>
#include <linux/netlink.h>
#include <linux/sock_diag.h>
#include <linux/unix_diag.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <netinet/tcp.h>

#include "../common/sockopts.h"

#define PEEK_BUF (4u << 20)     /* the largest datagram we expect (wmem_max) */
#define TCP_ESTABLISHED_ 1
#define TCP_LISTEN_ 10

#define MAX_ICONS 1024          /* connections in one listener's backlog we save */

struct diag_info {
    uint32_t state;
    uint32_t peer;
    uint32_t icons;       /* connections waiting in accept() */
    uint32_t icon[MAX_ICONS]; /* their client ends' inodes, in accept order (0: closed) */
    uint32_t backlog;
    uint32_t rqueue;      /* bytes to read (a listener: connections waiting) */
    uint32_t wqueue;      /* bytes sent and not yet read by the peer */
    uint32_t shutdown;
    uint32_t name_len;
    char name[sizeof(((struct sockaddr_un *)0)->sun_path)];
};

int ck_sock_diag_open(void)
{
    return (int)ck_socket(AF_NETLINK, SOCK_DGRAM | SOCK_CLOEXEC, NETLINK_SOCK_DIAG);
}

static int query(int nl, uint32_t ino, struct diag_info *out)
{
    struct {
        struct nlmsghdr nh;
        struct unix_diag_req req;
    } rq;
    static char resp[16384];
    ck_memset(&rq, 0, sizeof(rq));
    rq.nh.nlmsg_len = sizeof(rq);
    rq.nh.nlmsg_type = SOCK_DIAG_BY_FAMILY;
    rq.nh.nlmsg_flags = NLM_F_REQUEST;
    rq.req.sdiag_family = AF_UNIX;
    rq.req.udiag_states = 0xffffffff;
    rq.req.udiag_ino = ino;
    rq.req.udiag_show = UDIAG_SHOW_NAME | UDIAG_SHOW_PEER | UDIAG_SHOW_ICONS | UDIAG_SHOW_RQLEN;
    rq.req.udiag_cookie[0] = rq.req.udiag_cookie[1] = ~0u;
    struct sockaddr_nl sa;
    ck_memset(&sa, 0, sizeof(sa));
    sa.nl_family = AF_NETLINK;
    long rc = ck_sendto(nl, &rq, sizeof(rq), 0, &sa, sizeof(sa));
    if (rc < 0)
        return (int)rc;
    long n;
    do
        n = ck_read(nl, resp, sizeof(resp));
    while (n == -EINTR);
    if (n < 0)
        return (int)n;
    struct nlmsghdr *nh = (void *)resp;
    if (n < (long)sizeof(*nh) || nh->nlmsg_len > (uint32_t)n)
        return -EIO;
    if (nh->nlmsg_type == NLMSG_ERROR) {
        struct nlmsgerr *e = NLMSG_DATA(nh);
        return e->error ? e->error : -ENOENT;
    }
    struct unix_diag_msg *m = NLMSG_DATA(nh);
    ck_memset(out, 0, sizeof(*out));
    out->state = m->udiag_state;
    char *p = (char *)(m + 1), *end = (char *)nh + nh->nlmsg_len;
    while (p + sizeof(struct nlattr) <= end) {
        struct nlattr *a = (void *)p;
        if (a->nla_len < sizeof(*a) || p + a->nla_len > end)
            break;
        char *val = p + NLA_HDRLEN;
        uint32_t len = a->nla_len - NLA_HDRLEN;
        switch (a->nla_type) {
        case UNIX_DIAG_NAME:
            out->name_len = len < sizeof(out->name) ? len : (uint32_t)sizeof(out->name);
            ck_memcpy(out->name, val, out->name_len);
            break;
        case UNIX_DIAG_PEER:
            ck_memcpy(&out->peer, val, 4);
            break;
        case UNIX_DIAG_ICONS:
            out->icons = len / 4;
            ck_memcpy(out->icon, val, (out->icons < MAX_ICONS ? out->icons : MAX_ICONS) * 4);
            break;
        case UNIX_DIAG_RQLEN: {
            struct unix_diag_rqlen q;
            ck_memcpy(&q, val, sizeof(q));
            out->backlog = q.udiag_wqueue;  /* a listener's: its max backlog */
            out->rqueue = q.udiag_rqueue;
            out->wqueue = q.udiag_wqueue;
            break;
        }
        case UNIX_DIAG_SHUTDOWN:
            out->shutdown = (uint8_t)val[0];
            break;
        default:
            break;
        }
        p += NLA_ALIGN(a->nla_len);
    }
    return 0;
}

/*
 * Descriptors in flight.  A peek with a control buffer installs copies of a
 * message's descriptors in this process (unix_peek_fds: the queue keeps its
 * own), as CRIU's sk-queue.c reads them.  The copies stay open, listed here,
 * until RESUME or ABORT (ck_flight_close): ck_dump_fds describes each as a
 * CK_FDF_IN_FLIGHT record like any descriptor, and the agent's kcmp pass,
 * which runs after the dump, sees which open file descriptions they share
 * with the job's other descriptors.  The socket's ck_rights records name
 * them by number; the restore plan makes each at a slot and sends the
 * messages again with them (ckptd/image/plan/unix.py).  A stream's
 * descriptors ride on the kernel buffer (skb) of the bytes sent with them: a
 * read that reaches its first byte returns them, one that reaches its end
 * stops there.  A peek shows where it ends, never where it starts (a peek
 * looks ahead through the buffers after the bytes it copies and returns the
 * next descriptors), so a stream's descriptors are saved when the bytes
 * from the last boundary to that end are one byte (sendmsg of one byte with
 * the descriptors, as multiprocessing.reduction.sendfds does), and
 * refused otherwise (a passing state, retried).  So is a socket in flight
 * whose own queue carries descriptors.
 */
#define MAX_FLIGHT 1024
#define RIGHTS_CAP 65536
static int flight[MAX_FLIGHT];
static uint32_t nflight;
static int peeking_flight;  /* describing a descriptor in flight: its own queue may carry none */

int ck_flight_has(int fd)
{
    for (uint32_t i = 0; i < nflight; i++)
        if (flight[i] == fd)
            return 1;
    return 0;
}

uint32_t ck_flight_count(void)
{
    return nflight;
}

int ck_flight_fd(uint32_t i)
{
    return flight[i];
}

void ck_flight_describing(int on)
{
    peeking_flight = on;
}

void ck_flight_close(void)
{
    for (uint32_t i = 0; i < nflight; i++)
        ck_close(flight[i]);
    nflight = 0;
}

void ck_flight_forget(void)
{
    nflight = 0;  /* a restored process: the copies were never made again */
}

static void close_passed(struct msghdr *msg)
{
    for (struct cmsghdr *c = CMSG_FIRSTHDR(msg); c; c = CMSG_NXTHDR(msg, c))
        if (c->cmsg_level == SOL_SOCKET && c->cmsg_type == SCM_RIGHTS)
            for (size_t i = 0; i < (c->cmsg_len - CMSG_LEN(0)) / sizeof(int); i++)
                ck_close(((int *)CMSG_DATA(c))[i]);
}

/* keep a message's passed descriptors in flight[] and its ck_rights in rights */
static int keep_rights(struct ck_image *im, struct msghdr *msg, uint64_t at, uint32_t len, char *rights,
                       size_t *used)
{
    struct ck_rights r = {at, len, 0};
    size_t head = *used;
    if (head + sizeof(r) > RIGHTS_CAP)
        goto full;
    *used += sizeof(r);
    for (struct cmsghdr *c = CMSG_FIRSTHDR(msg); c; c = CMSG_NXTHDR(msg, c)) {
        if (c->cmsg_level != SOL_SOCKET || c->cmsg_type != SCM_RIGHTS)
            continue;
        for (size_t i = 0; i < (c->cmsg_len - CMSG_LEN(0)) / sizeof(int); i++) {
            int passed = ((int *)CMSG_DATA(c))[i];
            if (passed <= 2) {
                /* not where stdin, stdout or stderr belong (classify reads those as the log's) */
                long high = ck_fcntl(passed, F_DUPFD_CLOEXEC, 3);
                if (high >= 0) {
                    ck_close(passed);
                    passed = (int)high;
                    ((int *)CMSG_DATA(c))[i] = passed;
                }
            }
            if (nflight >= MAX_FLIGHT || *used + sizeof(int32_t) > RIGHTS_CAP) {
                ck_close(passed);
                goto full;
            }
            flight[nflight++] = passed;
            ck_memcpy(rights + *used, &passed, sizeof(int32_t));
            *used += sizeof(int32_t);
            r.nfds++;
        }
    }
    while (*used % 8)
        rights[(*used)++] = 0;
    ck_memcpy(rights + head, &r, sizeof(r));
    return 0;
full:
    close_passed(msg);
    return ck_image_passing(im, ck_image_fail(im, "a Unix socket has more than 1024 file descriptors in flight "
                                                  "(SCM_RIGHTS sent, not yet received)", 0, 0));
}

/* copy the receive queue without consuming it */
int ck_peek_queue(struct ck_image *im, struct ck_fd *f, int fd)
{
    static char *rights;
    size_t rights_used = 0;
    if (!rights && !(rights = ck_arena_alloc(RIGHTS_CAP)))
        return ck_image_fail(im, "cannot allocate checkpoint scratch memory", 0, 0);
    static char *buf;
    if (!buf && !(buf = ck_arena_alloc(PEEK_BUF)))
        return ck_image_fail(im, "cannot allocate checkpoint scratch memory", 0, 0);
    int old_off = -1;
    unsigned ol = sizeof(old_off);
    ck_getsockopt(fd, SOL_SOCKET, SO_PEEK_OFF, &old_off, &ol);
    int zero = 0;
    long rc = ck_setsockopt(fd, SOL_SOCKET, SO_PEEK_OFF, &zero, sizeof(zero));
    if (rc < 0)
        return ck_image_fail(im, "cannot peek at a socket's queue (SO_PEEK_OFF)", 0, rc);
    int stream = f->sock_type == SOCK_STREAM;
    f->data_off = im->blob.count;
    f->flags |= CK_FDF_DATA_SAVED;
    int result = 0;
    for (uint32_t guard = 0; guard < (1u << 24); guard++) {
        static union {
            struct cmsghdr h;
            char space[CMSG_SPACE(sizeof(int) * 253)];  /* SCM_MAX_FD: one message never carries more */
        } ctl;  /* off the checkpoint thread's stack */
        int at = (int)f->data_len;  /* a stream's peek offset: the bytes saved so far */
        struct iovec iov = {buf, PEEK_BUF};
        struct msghdr msg;
        ck_memset(&msg, 0, sizeof(msg));
        msg.msg_iov = &iov;
        msg.msg_iovlen = 1;
        msg.msg_control = &ctl;
        msg.msg_controllen = sizeof(ctl);
        long n = ck_recvmsg(fd, &msg, MSG_PEEK | MSG_DONTWAIT | MSG_CMSG_CLOEXEC);
        if (n == -EINTR)
            continue;
        if (n == -EAGAIN || (stream && n == 0))
            break;
        if (n < 0) {
            result = ck_image_fail(im, "cannot read a socket's queue", 0, n);
            break;
        }
        int passed = 0;
        for (struct cmsghdr *c = CMSG_FIRSTHDR(&msg); c; c = CMSG_NXTHDR(&msg, c))
            passed |= c->cmsg_level == SOL_SOCKET && c->cmsg_type == SCM_RIGHTS;
        if ((msg.msg_flags & MSG_CTRUNC) || (passed && peeking_flight)) {
            /* more than the control buffer holds (RLIMIT_NOFILE: more than
             * this process may take), or a socket in flight carrying more: the
             * receiver takes them as soon as it runs again */
            close_passed(&msg);
            result = ck_image_passing(
                im, ck_image_fail(im, peeking_flight ? "a Unix socket in flight carries file descriptors in flight "
                                                       "itself (SCM_RIGHTS sent, not yet received)"
                                                     : "a Unix socket has file descriptors in flight (SCM_RIGHTS "
                                                       "sent, not yet received) that ckptd cannot take",
                                  0, 0));
            break;
        }
        if (passed && stream && n != 1) {
            close_passed(&msg);
            result = ck_image_passing(
                im, ck_image_fail(im, "a Unix stream socket has file descriptors in flight (SCM_RIGHTS sent, not yet "
                                      "received) after bytes whose boundary with theirs ckptd cannot see",
                                  0, 0));
            break;
        }
        if (passed) {
            if ((result = keep_rights(im, &msg, stream ? (uint64_t)at : f->nqueued, (uint32_t)n, rights,
                                      &rights_used)) < 0)
                break;
            f->nrights++;
        }
        if (msg.msg_flags & MSG_TRUNC) {
            result = ck_image_fail(im, "a queued datagram is larger than 4 MiB", 0, 0);
            break;
        }
        if (!stream) {
            uint32_t len = (uint32_t)n;
            if (ck_table_bytes_append(&im->blob, &len, sizeof(len)) == UINT64_MAX) {
                result = ck_image_fail(im, "too much queued socket data", 0, 0);
                break;
            }
            f->data_len += sizeof(len);
            f->nqueued++;
        }
        if (n && ck_table_bytes_append(&im->blob, buf, (size_t)n) == UINT64_MAX) {
            result = ck_image_fail(im, "too much queued socket data", 0, 0);
            break;
        }
        f->data_len += (uint64_t)n;
        if (stream)
            f->nqueued = 1;
    }
    ck_setsockopt(fd, SOL_SOCKET, SO_PEEK_OFF, &old_off, sizeof(old_off));
    if (result == 0 && f->nrights) {
        f->rights_off = im->blob.count;
        if (ck_table_bytes_append(&im->blob, rights, rights_used) == UINT64_MAX)
            return ck_image_fail(im, "too much queued socket data", 0, 0);
    }
    return result;
}

/*
 * A listener's backlog: connections made and not yet accepted.  The
 * server's end of each exists in no process (accept() would make it one),
 * so nothing can be read from it; what makes it again is its client end,
 * whose inode unix_diag lists for each (UNIX_DIAG_ICONS, in accept order).
 * When every client end is in the job, still open and has sent nothing the
 * server has not read (its send queue, charged to it until read, is empty),
 * the restore plan connects each again to the rebuilt listener in that
 * order (ckptd/image/plan/unix.py), and accept() returns them as before.
 * The inodes go into the listener's data (nqueued of them).  Otherwise the
 * server is about to accept them: a passing state, the round is retried.
 * Whether each client end is in the job only the plan knows.
 */
static int save_backlog(struct ck_image *im, struct ck_fd *f, int nl, const struct diag_info *di, const char *target)
{
    static struct diag_info client;
    if (di->icons > MAX_ICONS)
        return ck_image_passing(im, ck_image_fail(im, "a listening Unix socket has more than 1024 connections not "
                                                      "yet accepted", target, 0));
    uint32_t icons = di->icons;
    const uint32_t *icon = di->icon;
    for (uint32_t i = 0; i < icons; i++) {
        const char *why = 0;
        if (!icon[i])
            why = "a listening Unix socket has a connection not yet accepted whose client has closed it";
        else if (query(nl, icon[i], &client) < 0)
            why = "a listening Unix socket has a connection not yet accepted whose client cannot be described";
        else if (client.wqueue)
            why = "a listening Unix socket has a connection not yet accepted that holds data";
        if (why)
            return ck_image_passing(im, ck_image_fail(im, why, target, 0));
    }
    f->flags |= CK_FDF_DATA_SAVED;
    f->data_off = im->blob.count;
    f->data_len = icons * sizeof(uint32_t);
    f->nqueued = icons;
    if (ck_table_bytes_append(&im->blob, icon, f->data_len) == UINT64_MAX)
        return ck_image_fail(im, "too much socket data", 0, 0);
    return 0;
}

static const char *family_name(int family)
{
    switch (family) {
    case AF_INET: return "IPv4 socket of an unsupported type (SCTP?)";
    case AF_INET6: return "IPv6 socket of an unsupported type (SCTP?)";
    case AF_NETLINK: return "netlink socket";
    case AF_PACKET: return "packet socket";
    default: return "socket of an unsupported family";
    }
}

int ck_dump_socket(struct ck_image *im, struct ck_fd *f, int nl, const char *target)
{
    int fd = f->fd, family = 0, type = 0;
    unsigned len = sizeof(family);
    if (ck_getsockopt(fd, SOL_SOCKET, SO_DOMAIN, &family, &len) == 0 && (family == AF_INET || family == AF_INET6)) {
        len = sizeof(type);
        if (ck_getsockopt(fd, SOL_SOCKET, SO_TYPE, &type, &len) == 0 && type == SOCK_STREAM && fd > 2)
            return ck_dump_tcp(im, f, family, target);
        if ((type == SOCK_DGRAM || type == SOCK_RAW) && fd > 2)
            return ck_dump_dgram(im, f, family, type, target);  /* dump_dgram.c */
    }
    if (family != AF_UNIX) {
        if (fd <= 2) {
            f->type = CK_FD_STDIO;  /* the launcher's socket: the log takes its place */
            return 0;
        }
        return ck_fail_fd(im, fd, family_name(family), target);
    }
    len = sizeof(type);
    long rc = ck_getsockopt(fd, SOL_SOCKET, SO_TYPE, &type, &len);
    if (rc < 0)
        return ck_image_fail(im, "cannot read a socket's type", target, rc);
    if (type != SOCK_STREAM && type != SOCK_DGRAM && type != SOCK_SEQPACKET)
        return ck_fail_fd(im, fd, "Unix socket of an unknown type", target);
    static struct diag_info di;  /* 4 KiB: off the checkpoint thread's stack */
    rc = nl >= 0 ? query(nl, (uint32_t)f->ino, &di) : nl;
    if (rc < 0)
        return ck_image_fail(im, "cannot describe a Unix socket (NETLINK_SOCK_DIAG)", target, rc);
    f->type = CK_FD_UNIX;
    f->sock_type = (uint32_t)type;
    if (ck_dump_sockopts(im, f, fd, CK_SO_UNIX) < 0)
        return -1;
    f->peer_ino = di.peer;
    f->shutdown = di.shutdown;
    if (di.name_len) {
        f->name_off = im->blob.count;
        f->name_len = di.name_len;
        if (ck_table_bytes_append(&im->blob, di.name, di.name_len) == UINT64_MAX)
            return ck_image_fail(im, "too much socket data", 0, 0);
    }
    if (di.state == TCP_LISTEN_) {
        f->sock_state = CK_SOCK_LISTEN;
        f->backlog = di.backlog;
        return di.icons ? save_backlog(im, f, nl, &di, target) : 0;
    }
    f->sock_state = di.state == TCP_ESTABLISHED_ ? CK_SOCK_CONNECTED : CK_SOCK_UNCONNECTED;
    if (f->sock_state == CK_SOCK_UNCONNECTED && f->sock_type == SOCK_STREAM)
        return 0;  /* made, not connected yet (a client between socket() and connect()): no queue,
                      and recvmsg would say EINVAL */
    return ck_peek_queue(im, f, fd);
}
