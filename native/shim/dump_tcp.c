/*
 * TCP sockets: what the restore plan needs to build each one again.
 *
 * Saved per socket: family, state (listening, connected, or neither; a
 * connection half closed, FIN wait 2 or close wait, is connected with
 * ck_fd.shutdown set), the
 * local and remote addresses, the options that change behaviour (Nagle,
 * keepalive, address reuse, v6-only), the buffer sizes, and the bytes in
 * flight:
 *   receive queue  arrived, not yet read: copied with MSG_PEEK, so the job
 *                  still reads them if the checkpoint is aborted;
 *   send queue     written, not yet sent (Nagle waiting for an ACK, or a
 *                  full window).  Bytes already sent are in the peer's
 *                  receive queue, which its own process saves.
 *
 * Bytes must not move between the images of two processes: the agent sends
 * SETTLE to every parked process before any DUMP, and each lets its unsent
 * bytes leave (an ACK releases what Nagle holds back) into its parked
 * peers' receive queues.  What is still unsent then cannot move (the peer's
 * window is full and nobody reads), and is read in TCP repair mode
 * (CAP_NET_ADMIN); without it the checkpoint fails and can be retried.
 *
 * Which two sockets are the ends of one connection is decided by the agent
 * from every process's image (ckptd/image/plan/tcp.py): a connection whose peer
 * is not in the job is refused there, with both addresses.  The restorer
 * builds them again in native/restorer/plan_tcp.c.
 */
#include "shim.h"
#include "../common/sys.h"
#include "../common/util.h"

#include <errno.h>
#include <linux/inet_diag.h>
#include <linux/netlink.h>
#include <linux/sock_diag.h>
#include <linux/sockios.h>
#include <sys/ioctl.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sys/socket.h>

#include "../common/sockopts.h"

#define MAX_SNDQ (64u << 20)

static const char *const state_names[] = {
    "?", "established", "connecting (SYN sent)", "connecting (SYN received)", "closing (FIN wait 1)",
    "closing (FIN wait 2)", "time wait", "closed", "closing (peer closed, close wait)", "closing (last ACK)",
    "listening", "closing",
};

static int opt_on(int fd, int level, int name)
{
    int v = 0;
    unsigned len = sizeof(v);
    return ck_getsockopt(fd, level, name, &v, &len) == 0 && v;
}

static uint32_t opt_u32(int fd, int level, int name)
{
    int v = 0;
    unsigned len = sizeof(v);
    return ck_getsockopt(fd, level, name, &v, &len) == 0 && v > 0 ? (uint32_t)v : 0;
}

/* an address into BLOB; returns its offset, or UINT64_MAX */
static uint64_t save_addr(struct ck_image *im, int fd, int peer, uint32_t *len_out)
{
    struct sockaddr_in6 sa;
    unsigned len = sizeof(sa);
    ck_memset(&sa, 0, sizeof(sa));
    long rc = ck_sc3(peer ? SYS_getpeername : SYS_getsockname, fd, &sa, &len);
    if (rc < 0 || len > sizeof(sa))
        return UINT64_MAX;
    *len_out = len;
    return ck_table_bytes_append(&im->blob, &sa, len);
}

static int ioctl_int(int fd, unsigned long req)
{
    int v = 0;
    return ck_ioctl(fd, req, &v) < 0 ? -1 : v;
}

/* Leaving repair mode resets SO_REUSEADDR (the kernel sets sk_reuse to "no
 * reuse"): the job's socket gets its own value back, or its port would stay
 * taken after it closes (a restarted listener could not bind it again). */
static void repair_off(int fd, int reuse)
{
    int off = -1; /* TCP_REPAIR_OFF_NO_WP: leave without a window probe */
    ck_setsockopt(fd, SOL_TCP, TCP_REPAIR, &off, sizeof(off));
    ck_setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &reuse, sizeof(reuse));
}

#define MAX_SETTLE_FDS 4096

int ck_tcp_settle(int timeout_ms)
{
    static int fds[MAX_SETTLE_FDS];
    static char buf[8192];
    int n = 0, unseen = 0; /* unseen: TCP sockets past MAX_SETTLE_FDS, counted as stuck */
    long dfd = ck_open("/proc/self/fd", O_RDONLY | O_DIRECTORY | O_CLOEXEC, 0);
    if (dfd < 0)
        return (int)dfd;
    for (;;) {
        long got = ck_getdents64((int)dfd, buf, sizeof(buf));
        if (got <= 0)
            break;
        for (long off = 0; off < got;) {
            struct ck_linux_dirent64 *d = (void *)(buf + off);
            off += d->d_reclen;
            if (d->d_name[0] < '0' || d->d_name[0] > '9')
                continue;
            int fd = (int)ck_parse_u64(d->d_name, 10, 0);
            if (fd == (int)dfd || opt_u32(fd, SOL_SOCKET, SO_PROTOCOL) != IPPROTO_TCP)
                continue;
            if (n < MAX_SETTLE_FDS)
                fds[n++] = fd;
            else
                unseen = 1;
        }
    }
    ck_close((int)dfd);
    int stuck = 0;
    for (int waited = 0;; waited += 5) {
        stuck = unseen;
        for (int i = 0; i < n; i++)
            stuck += ioctl_int(fds[i], SIOCOUTQNSD) > 0;
        if (stuck == unseen || waited >= timeout_ms) /* the ones it sees have settled, or time is up */
            return stuck;
        ck_nanosleep_ms(5);
    }
}

/* the written-but-unsent tail of the send queue (after SETTLE: it cannot move) */
static int save_unsent(struct ck_image *im, struct ck_fd *f, int fd)
{
    int unsent = ioctl_int(fd, SIOCOUTQNSD);
    if (unsent <= 0)
        return 0;
    int queued = ioctl_int(fd, SIOCOUTQ);
    if (queued < unsent || (uint32_t)queued > MAX_SNDQ)
        return ck_image_passing(im, ck_fail_fd(im, f->fd, "TCP socket with an unreadable send queue", 0));
    int on = 1, reuse = opt_on(fd, SOL_SOCKET, SO_REUSEADDR);
    long rc = ck_setsockopt(fd, SOL_TCP, TCP_REPAIR, &on, sizeof(on));
    if (rc < 0)
        return ck_image_passing(im, ck_fail_fd(im, f->fd,
                                               "TCP socket whose peer is not reading (its unsent bytes can only be "
                                               "saved with CAP_NET_ADMIN)",
                                               0));
    char *buf = ck_arena_alloc((size_t)queued);
    int q = TCP_SEND_QUEUE;
    long n = -ENOMEM;
    if (buf && (n = ck_setsockopt(fd, SOL_TCP, TCP_REPAIR_QUEUE, &q, sizeof(q))) == 0)
        n = ck_sc6(SYS_recvfrom, fd, (long)buf, queued, MSG_PEEK | MSG_DONTWAIT, 0, 0);
    repair_off(fd, reuse);
    if (n != queued)
        return ck_image_fail(im, "cannot read a TCP send queue in repair mode", 0, n < 0 ? n : -EIO);
    f->sndq_off = ck_table_bytes_append(&im->blob, buf + (queued - unsent), (size_t)unsent);
    if (f->sndq_off == UINT64_MAX)
        return ck_image_fail(im, "too much queued socket data", 0, 0);
    f->sndq_len = (uint64_t)unsent;
    return 0;
}

static long queue_seq(int fd, int queue, uint32_t *seq)
{
    long rc = ck_setsockopt(fd, SOL_TCP, TCP_REPAIR_QUEUE, &queue, sizeof(queue));
    unsigned len = sizeof(*seq);
    if (rc == 0)
        rc = ck_getsockopt(fd, SOL_TCP, TCP_QUEUE_SEQ, seq, &len);
    return rc;
}

/*
 * This end's whole state in repair mode, so that it can be rebuilt without
 * its peer's image (the peer is another rank, maybe on another node, and
 * is dumped at another instant).  Any instant while both ends are parked
 * is consistent: bytes only move from "in A's send queue" to "in A's send
 * queue and in B's receive queue" (received, not yet acknowledged), and a
 * restored A sends those again, which B drops as duplicates.
 *
 * The receive queue is peeked between two reads of its sequence number,
 * again until no segment arrived in between.  Without CAP_NET_ADMIN
 * nothing is saved here, and only connections inside one rank restore.
 */
static int save_repair(struct ck_image *im, struct ck_fd *f, int fd, const struct tcp_info *ti)
{
    int on = 1, reuse = opt_on(fd, SOL_SOCKET, SO_REUSEADDR);
    if (ck_setsockopt(fd, SOL_TCP, TCP_REPAIR, &on, sizeof(on)) < 0)
        return ck_peek_queue(im, f, fd);
    int result = -1;
    f->mss = opt_u32(fd, SOL_TCP, TCP_MAXSEG);
    f->snd_wscale = ti->tcpi_snd_wscale;
    f->rcv_wscale = ti->tcpi_rcv_wscale;
    f->tcpi_options = ti->tcpi_options;
    unsigned len = sizeof(f->timestamp);
    if (ck_getsockopt(fd, SOL_TCP, TCP_TIMESTAMP, &f->timestamp, &len) < 0)
        f->timestamp = 0;

    uint32_t write_seq = 0, rcv1 = 0, rcv2 = 0;
    long rc = queue_seq(fd, TCP_SEND_QUEUE, &write_seq);
    int queued = ioctl_int(fd, SIOCOUTQ);
    if (rc < 0 || queued < 0 || (uint32_t)queued > MAX_SNDQ) {
        ck_image_fail(im, "cannot read a TCP send queue in repair mode", 0, rc < 0 ? rc : -EIO);
        goto out;
    }
    char *buf = queued ? ck_arena_alloc((size_t)queued) : 0;
    long n = 0;
    if (queued && !buf) {
        ck_image_fail(im, "cannot allocate checkpoint scratch memory", 0, -ENOMEM);
        goto out;
    }
    if (queued)  /* acknowledgements may shorten it meanwhile: n is what is left */
        n = ck_sc6(SYS_recvfrom, fd, (long)buf, queued, MSG_PEEK | MSG_DONTWAIT, 0, 0);
    if (n < 0) {
        ck_image_fail(im, "cannot read a TCP send queue in repair mode", 0, n);
        goto out;
    }
    f->snd_seq = write_seq - (uint32_t)n;
    f->sendq_off = ck_table_bytes_append(&im->blob, buf, (size_t)n);
    f->sendq_len = (uint64_t)n;
    if (f->sendq_off == UINT64_MAX) {
        ck_image_fail(im, "too much queued socket data", 0, 0);
        goto out;
    }

    for (int tries = 0;; tries++) {
        f->data_len = 0;
        if ((rc = queue_seq(fd, TCP_RECV_QUEUE, &rcv1)) < 0 || ck_peek_queue(im, f, fd) < 0 ||
            (rc = queue_seq(fd, TCP_RECV_QUEUE, &rcv2)) < 0) {
            if (rc < 0)
                ck_image_fail(im, "cannot read a TCP receive queue in repair mode", 0, rc);
            goto out;
        }
        if (rcv1 == rcv2)
            break;
        if (tries == 50) {
            ck_image_passing(im, ck_fail_fd(im, fd, "TCP connection that keeps receiving while parked", 0));
            goto out;
        }
    }
    f->rcv_seq = rcv1 - (uint32_t)f->data_len;

    struct tcp_repair_window w;
    len = sizeof(w);
    ck_memset(&w, 0, sizeof(w));
    rc = ck_getsockopt(fd, SOL_TCP, TCP_REPAIR_WINDOW, &w, &len);
    if (rc < 0) {
        ck_image_fail(im, "cannot read a TCP window in repair mode", 0, rc);
        goto out;
    }
    f->snd_wl1 = w.snd_wl1;
    f->snd_wnd = w.snd_wnd;
    f->max_window = w.max_window;
    f->rcv_wnd = w.rcv_wnd;
    f->rcv_wup = w.rcv_wup;
    f->repair = 1;
    result = 0;
out:;
    int none = TCP_NO_QUEUE;
    ck_setsockopt(fd, SOL_TCP, TCP_REPAIR_QUEUE, &none, sizeof(none));
    repair_off(fd, reuse);
    return result;
}

/*
 * Close wait: whether the peer's end was closed on this host, so that no
 * process holds it (an orphan the kernel keeps in FIN wait 2 for a while,
 * or gone): then the restore plan may make it again for a moment and close
 * it (tcp.py), and the job meets what it would have met: its unread bytes,
 * the end of the stream, and a reset if it writes.  On this host: the two
 * ends have one address (a connection on the host from and to itself);
 * held: NETLINK_SOCK_DIAG finds the peer's four addresses with an inode.
 */
static int peer_closed_here(struct ck_image *im, int fd, int family)
{
    struct sockaddr_in6 local, peer;
    unsigned ll = sizeof(local), pl = sizeof(peer);
    ck_memset(&local, 0, sizeof(local));
    ck_memset(&peer, 0, sizeof(peer));
    if (im->diag_fd < 0 || ck_sc3(SYS_getsockname, fd, &local, &ll) < 0 || ck_sc3(SYS_getpeername, fd, &peer, &pl) < 0)
        return 0;
    struct {
        struct nlmsghdr nh;
        struct inet_diag_req_v2 req;
    } rq;
    ck_memset(&rq, 0, sizeof(rq));
    struct inet_diag_sockid *id = &rq.req.id;
    if (family == AF_INET) {
        const struct sockaddr_in *l4 = (const void *)&local, *p4 = (const void *)&peer;
        if (l4->sin_addr.s_addr != p4->sin_addr.s_addr)
            return 0;
        id->idiag_sport = p4->sin_port;
        id->idiag_dport = l4->sin_port;
        id->idiag_src[0] = p4->sin_addr.s_addr;
        id->idiag_dst[0] = l4->sin_addr.s_addr;
    } else {
        if (ck_memcmp(&local.sin6_addr, &peer.sin6_addr, 16) != 0)
            return 0;
        id->idiag_sport = peer.sin6_port;
        id->idiag_dport = local.sin6_port;
        ck_memcpy(id->idiag_src, &peer.sin6_addr, 16);
        ck_memcpy(id->idiag_dst, &local.sin6_addr, 16);
    }
    id->idiag_cookie[0] = id->idiag_cookie[1] = INET_DIAG_NOCOOKIE;
    rq.nh.nlmsg_len = sizeof(rq);
    rq.nh.nlmsg_type = SOCK_DIAG_BY_FAMILY;
    rq.nh.nlmsg_flags = NLM_F_REQUEST;
    rq.req.sdiag_family = (uint8_t)family;
    rq.req.sdiag_protocol = IPPROTO_TCP;
    rq.req.idiag_states = ~0u;
    struct sockaddr_nl sa;
    ck_memset(&sa, 0, sizeof(sa));
    sa.nl_family = AF_NETLINK;
    if (ck_sendto(im->diag_fd, &rq, sizeof(rq), 0, &sa, sizeof(sa)) < 0)
        return 0;
    static char resp[4096];
    long n;
    do
        n = ck_read(im->diag_fd, resp, sizeof(resp));
    while (n == -EINTR);
    struct nlmsghdr *nh = (void *)resp;
    if (n < (long)sizeof(*nh) || nh->nlmsg_len > (uint32_t)n)
        return 0;
    if (nh->nlmsg_type == NLMSG_ERROR)
        return ((struct nlmsgerr *)NLMSG_DATA(nh))->error == -ENOENT;  /* gone */
    if (nh->nlmsg_len < NLMSG_LENGTH(sizeof(struct inet_diag_msg)))
        return 0;
    return ((struct inet_diag_msg *)NLMSG_DATA(nh))->idiag_inode == 0;  /* an orphan */
}

int ck_dump_tcp(struct ck_image *im, struct ck_fd *f, int family, const char *target)
{
    int fd = f->fd;
    struct tcp_info ti;
    unsigned len = sizeof(ti);
    ck_memset(&ti, 0, sizeof(ti));
    long rc = ck_getsockopt(fd, SOL_TCP, TCP_INFO, &ti, &len);
    if (rc < 0)
        return ck_image_fail(im, "cannot read a TCP socket's state (TCP_INFO)", target, rc);
    f->type = CK_FD_TCP;
    f->sock_type = SOCK_STREAM;
    f->sock_family = (uint32_t)family;
    f->sock_opts = (opt_on(fd, SOL_TCP, TCP_NODELAY) ? CK_SOCKOPT_NODELAY : 0) |
                   (opt_on(fd, SOL_SOCKET, SO_KEEPALIVE) ? CK_SOCKOPT_KEEPALIVE : 0) |
                   (opt_on(fd, SOL_SOCKET, SO_REUSEADDR) ? CK_SOCKOPT_REUSEADDR : 0) |
                   (opt_on(fd, SOL_SOCKET, SO_REUSEPORT) ? CK_SOCKOPT_REUSEPORT : 0) |
                   (family == AF_INET6 && opt_on(fd, IPPROTO_IPV6, IPV6_V6ONLY) ? CK_SOCKOPT_V6ONLY : 0);
    if (ck_dump_sockopts(im, f, fd, family == AF_INET6 ? CK_SO_TCP6 : CK_SO_TCP4) < 0)
        return -1;
    f->rcvbuf = opt_u32(fd, SOL_SOCKET, SO_RCVBUF);
    f->sndbuf = opt_u32(fd, SOL_SOCKET, SO_SNDBUF);
    f->name_off = save_addr(im, fd, 0, &f->name_len);
    if (f->name_off == UINT64_MAX)
        return ck_image_fail(im, "cannot read a TCP socket's address", target, 0);

    switch (ti.tcpi_state) {
    case TCP_LISTEN:
        f->sock_state = CK_SOCK_LISTEN;
        f->backlog = ti.tcpi_sacked;  /* for a listener: the backlog it asked for */
        if (ti.tcpi_unacked)          /* and this: connections not yet accepted */
            return ck_image_passing(im, ck_fail_fd(im, fd, "listening TCP socket with connections not yet accepted",
                                                   target));
        return 0;
    case TCP_CLOSE:
        f->sock_state = CK_SOCK_UNCONNECTED;  /* made (and maybe bound), never connected */
        return 0;
    case TCP_ESTABLISHED:
        break;
    /* Half closed, for as long as the program keeps it so: saved as a
     * connection with f->shutdown saying which FIN was exchanged; the
     * restore plan makes it again established, puts its bytes back, then
     * shuts the sending side of the end that had (tcp.py).  Only its
     * acknowledged states: a FIN not yet acknowledged (FIN wait 1, closing,
     * last ACK) is a close under way, retried below. */
    case TCP_FIN_WAIT2:  /* this end shut its sending side, its FIN acknowledged */
        f->shutdown = 2;
        break;
    case TCP_CLOSE_WAIT:  /* the peer's FIN arrived: the end of the stream, after the queue */
        f->shutdown = 1 | (peer_closed_here(im, fd, family) ? 4 : 0);
        break;
    default: {
        static char why[96];
        struct ck_buf b;
        ck_buf_init(&b, why, sizeof(why));
        ck_buf_str(&b, "TCP connection that is ");
        ck_buf_str(&b, ti.tcpi_state < sizeof(state_names) / sizeof(state_names[0]) ? state_names[ti.tcpi_state] : "?");
        /* a handshake or a close under way ends by itself */
        return ck_image_passing(im, ck_fail_fd(im, fd, why, target));
    }
    }
    f->sock_state = CK_SOCK_CONNECTED;
    f->peer_off = save_addr(im, fd, 1, &f->peer_len);
    if (f->peer_off == UINT64_MAX)
        return ck_image_fail(im, "cannot read a TCP connection's peer address", target, 0);
    if (save_unsent(im, f, fd) < 0)
        return -1;
    return save_repair(im, f, fd, &ti);
}
