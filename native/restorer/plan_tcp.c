/*
 * TCP sockets in the restore plan (plan.c has the format).  A socket is
 * made at its slot with the options its construction needs, listeners
 * bound and listening again; a connection whose two ends are in the job is
 * made again with its old four addresses (tcppair), one to another rank
 * is rebuilt alone in repair mode (tcprepair, repairq, repairoff); then
 * the bytes in flight (`write`, plan.c) and the options (tcpopts, and
 * `sockopts`, plan.c).  Each process dups its sockets from the slots
 * (fds.c).
 *   tcp SLOT INO FAMILY OPTS       tcpbind SLOT SOCKADDR   tcpopts SLOT OPTS
 *   tcppair C S LISTENERS|-1 FAMILY S_ADDR C_ADDR C_PEER
 *   tcprepair SLOT LOCAL PEER SND_SEQ RCV_SEQ MSS SND_WS RCV_WS TCPI_OPTS TS
 *   repairq SLOT 1|2 FILE OFF LEN  repairoff SLOT WL1 WND MAXWND RCVWND RCVWUP
 *   sockbuf SLOT SNDBUF RCVBUF     widen buffers before a large queue goes back
 *   tcpfin SLOT                    shut the sending side again (FIN wait 2)
 *   tcpgone TEMP SLOT              close TEMP, the peer's end of SLOT (close wait)
 *
 * At the end of this file: clearing the killed job's TIME_WAIT sockets off
 * the addresses the restore binds again.
 */
#include "plan.h"

#include <errno.h>
#include <linux/inet_diag.h>
#include <linux/netlink.h>
#include <linux/sock_diag.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>

static long clear_time_wait(const void *addr, size_t len);

/* ---- the sockets and their connections ---- */

static void set_int(int fd, int level, int name, int value, const char *what)
{
    long rc = ck_setsockopt(fd, level, name, &value, sizeof(value));
    if (rc < 0)
        rst_fail("cannot set a socket option", what, rc);
}

static void tcp_socket_opts(int fd, uint32_t opts)
{
    set_int(fd, IPPROTO_TCP, TCP_NODELAY, !!(opts & CK_SOCKOPT_NODELAY), "TCP_NODELAY");
    set_int(fd, SOL_SOCKET, SO_KEEPALIVE, !!(opts & CK_SOCKOPT_KEEPALIVE), "SO_KEEPALIVE");
    set_int(fd, SOL_SOCKET, SO_REUSEADDR, !!(opts & CK_SOCKOPT_REUSEADDR), "SO_REUSEADDR");
}

/* a TCP socket; SO_REUSEADDR while the restore binds old ports (the killed
 * job's connections may linger in TIME_WAIT), the real value at the end */
static long tcp_socket(int family, uint32_t opts)
{
    long fd = ck_socket(family, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd < 0)
        return fd;
    set_int((int)fd, SOL_SOCKET, SO_REUSEADDR, 1, "SO_REUSEADDR");
    if (opts & CK_SOCKOPT_REUSEPORT)
        set_int((int)fd, SOL_SOCKET, SO_REUSEPORT, 1, "SO_REUSEPORT");
    if (family == AF_INET6)
        set_int((int)fd, IPPROTO_IPV6, IPV6_V6ONLY, !!(opts & CK_SOCKOPT_V6ONLY), "IPV6_V6ONLY");
    return fd;
}

/* bind to an old address even while the killed job's connections linger
 * on it in TIME_WAIT: repair mode forces the reuse (it needs CAP_NET_ADMIN;
 * without it SO_REUSEADDR must do) */
static long tcp_bind_addr(int fd, const char *addr, size_t len)
{
    clear_time_wait(addr, len);          /* best effort: needs CAP_NET_ADMIN */
    int on = 1, off = -1;                /* TCP_REPAIR_OFF_NO_WP */
    int repair = ck_setsockopt(fd, SOL_TCP, TCP_REPAIR, &on, sizeof(on)) == 0;
    long rc = ck_bind(fd, addr, (unsigned)len);
    if (repair) {
        ck_setsockopt(fd, SOL_TCP, TCP_REPAIR, &off, sizeof(off));
        set_int(fd, SOL_SOCKET, SO_REUSEADDR, 1, "SO_REUSEADDR");
    }
    return rc;
}

static void tcp_bind(int fd, const struct line *l, int i)
{
    char addr[128];
    size_t n = unhex(l, i, addr, sizeof(addr));
    long rc = tcp_bind_addr(fd, addr, n);
    if (rc < 0)
        rst_fail("cannot bind a TCP socket to its old address (is the port taken on this node?)", 0, rc);
}

static long connect_retry(int fd, const char *addr, size_t len)
{
    long rc;
    do
        rc = ck_connect(fd, addr, (unsigned)len);
    while (rc == -EINTR);
    return rc;
}

/* the job's listeners on the server's port: slots separated by commas */
#define MAX_LISTENERS 16
static int listener_slots(const struct line *l, int i, struct pollfd *out)
{
    int n = 0;
    for (const char *p = l->tok[i]; *p && n < MAX_LISTENERS;) {
        const char *end;
        uint64_t s = ck_parse_u64(p, 10, &end);
        if (end == p || s >= (uint64_t)rst.nslots || (*end && *end != ','))
            rst_fail("corrupt restore plan: bad listener list", l->tok[i], 0);
        out[n].fd = rst.slot_base + (int)s;
        out[n].events = POLLIN;
        out[n++].revents = 0;
        p = *end ? end + 1 : end;
    }
    return n;
}

/* the connection again: the client end from its old port to the server's
 * old address, the server end accepted there.  With SO_REUSEPORT the
 * kernel hands the connection to any of the port's listeners: the one
 * that has it in its queue accepts it. */
void op_tcppair(const struct line *l)
{
    int client = slot_fd(l, 1);
    int temporary = l->tok[3][0] == '-';
    long listener;
    struct pollfd lst[MAX_LISTENERS];
    int nlst = 0;
    if (temporary) {
        listener = tcp_socket((int)num(l, 4), 0);
        if (listener < 0)
            rst_fail("cannot create a TCP socket", 0, listener);
        tcp_bind((int)listener, l, 5);
        long rc = ck_listen((int)listener, 1);
        if (rc < 0)
            rst_fail("cannot listen on a TCP socket", 0, rc);
    } else {
        nlst = listener_slots(l, 3, lst);
        listener = lst[0].fd;
    }
    char local[128], peer[128];
    size_t nlocal = unhex(l, 6, local, sizeof(local)), npeer = unhex(l, 7, peer, sizeof(peer));
    long rc = tcp_bind_addr(client, local, nlocal);
    if (rc == 0)
        rc = connect_retry(client, peer, npeer);
    if (rc == -EADDRNOTAVAIL || rc == -EADDRINUSE) {
        /* the old connection's TIME_WAIT still owns these four addresses (for
         * about a second on loopback): the client end takes a new port */
        int family = 0;
        unsigned flen = sizeof(family);
        ck_getsockopt(client, SOL_SOCKET, SO_DOMAIN, &family, &flen);
        to_slot(tcp_socket(family, 0), l, 1, "cannot create a TCP socket");
        rc = connect_retry(client, peer, npeer);
    }
    if (rc < 0)
        rst_fail("cannot connect a TCP connection again", 0, rc);
    if (nlst > 1) {
        struct timespec ts = {10, 0};
        do
            rc = ck_sc5(SYS_ppoll, lst, nlst, &ts, 0, 8);
        while (rc == -EINTR);
        if (rc <= 0)
            rst_fail("cannot accept a TCP connection again (no listener has it)", 0, rc);
        for (int i = 0; i < nlst; i++)
            if (lst[i].revents & POLLIN) {
                listener = lst[i].fd;
                break;
            }
    }
    long server;
    do
        server = ck_accept4((int)listener, SOCK_CLOEXEC);
    while (server == -EINTR);
    to_slot(server, l, 2, "cannot accept a TCP connection again");
    if (temporary)
        ck_close((int)listener);
}

/*
 * One end of a connection to another rank, rebuilt alone in repair mode:
 *   tcprepair SLOT LOCAL PEER SND_SEQ RCV_SEQ MSS SND_WS RCV_WS TCPI_OPTS TS
 * binds the old local address and "connects" without a handshake; then
 *   repairq SLOT 1|2 FILE OFF LEN   the receive (1) or send (2) queue's bytes
 *   repairoff SLOT WL1 WND MAXWND RCVWND RCVWUP   the window, then repair off.
 * Its peer is rebuilt the same way by its own rank; the agents keep the
 * ranks' links down until every rank is rebuilt, so neither end can meet
 * the other's absence (a reset).  Needs CAP_NET_ADMIN.
 */
static void set_repair(int fd, int name, const void *v, unsigned len, const char *what)
{
    long rc = ck_setsockopt(fd, SOL_TCP, name, v, len);
    if (rc < 0)
        rst_fail("cannot rebuild a TCP connection to another rank", what, rc);
}

void op_tcprepair(const struct line *l)
{
    int fd = slot_fd(l, 1);
    int on = 1;
    set_repair(fd, TCP_REPAIR, &on, sizeof(on), "TCP_REPAIR (needs CAP_NET_ADMIN)");
    int q = TCP_SEND_QUEUE;
    uint32_t seq = (uint32_t)num(l, 4);
    set_repair(fd, TCP_REPAIR_QUEUE, &q, sizeof(q), "TCP_REPAIR_QUEUE");
    set_repair(fd, TCP_QUEUE_SEQ, &seq, sizeof(seq), "TCP_QUEUE_SEQ");
    q = TCP_RECV_QUEUE;
    seq = (uint32_t)num(l, 5);
    set_repair(fd, TCP_REPAIR_QUEUE, &q, sizeof(q), "TCP_REPAIR_QUEUE");
    set_repair(fd, TCP_QUEUE_SEQ, &seq, sizeof(seq), "TCP_QUEUE_SEQ");

    char local[128], peer[128];
    size_t nlocal = unhex(l, 2, local, sizeof(local)), npeer = unhex(l, 3, peer, sizeof(peer));
    long rc = ck_bind(fd, local, (unsigned)nlocal);
    if (rc < 0)
        rst_fail("cannot bind a TCP connection to its old address (is this rank's address on this node?)", 0, rc);
    rc = connect_retry(fd, peer, npeer);
    if (rc < 0)
        rst_fail("cannot rebuild a TCP connection to another rank (connect in repair mode)", 0, rc);

    uint32_t tcpi = (uint32_t)num(l, 9);
    struct tcp_repair_opt opts[4];
    unsigned n = 0;
    opts[n].opt_code = TCPOPT_MAXSEG;
    opts[n++].opt_val = (uint32_t)num(l, 6);
    if (tcpi & TCPI_OPT_WSCALE) {
        opts[n].opt_code = TCPOPT_WINDOW;
        opts[n++].opt_val = (uint32_t)num(l, 7) | ((uint32_t)num(l, 8) << 16);
    }
    if (tcpi & TCPI_OPT_SACK) {
        opts[n].opt_code = TCPOPT_SACK_PERMITTED;
        opts[n++].opt_val = 0;
    }
    if (tcpi & TCPI_OPT_TIMESTAMPS) {
        opts[n].opt_code = TCPOPT_TIMESTAMP;
        opts[n++].opt_val = 0;
        uint32_t ts = (uint32_t)num(l, 10);
        set_repair(fd, TCP_TIMESTAMP, &ts, sizeof(ts), "TCP_TIMESTAMP");
    }
    set_repair(fd, TCP_REPAIR_OPTIONS, opts, n * (unsigned)sizeof(opts[0]), "TCP_REPAIR_OPTIONS");
}

void op_repairq(const struct line *l)
{
    int fd = slot_fd(l, 1);
    int q = num(l, 2) == 1 ? TCP_RECV_QUEUE : TCP_SEND_QUEUE;
    set_repair(fd, TCP_REPAIR_QUEUE, &q, sizeof(q), "TCP_REPAIR_QUEUE");
    put_bytes(fd, l, 3, "cannot put a TCP queue back in repair mode");
}

void op_repairoff(const struct line *l)
{
    int fd = slot_fd(l, 1);
    struct tcp_repair_window w = {
        .snd_wl1 = (uint32_t)num(l, 2),
        .snd_wnd = (uint32_t)num(l, 3),
        .max_window = (uint32_t)num(l, 4),
        .rcv_wnd = (uint32_t)num(l, 5),
        .rcv_wup = (uint32_t)num(l, 6),
    };
    set_repair(fd, TCP_REPAIR_WINDOW, &w, sizeof(w), "TCP_REPAIR_WINDOW");
    int q = TCP_NO_QUEUE, off = 0; /* off with a window probe: the peer learns our window at once */
    set_repair(fd, TCP_REPAIR_QUEUE, &q, sizeof(q), "TCP_REPAIR_QUEUE");
    set_repair(fd, TCP_REPAIR, &off, sizeof(off), "TCP_REPAIR off");
}

/* Shut fd's sending side, after its bytes in flight, and wait for the
 * peer's acknowledgement (FIN wait 2; the peer, in close wait, acknowledges
 * a FIN late, as a delayed ACK) */
static void shut_and_wait(int fd)
{
    long rc = ck_shutdown(fd, SHUT_WR);
    if (rc < 0)
        rst_fail("cannot shut a TCP connection's sending side again", 0, rc);
    for (int ms = 0; ms < 5000; ms++) {
        struct tcp_info ti;
        unsigned len = sizeof(ti);
        rc = ck_getsockopt(fd, SOL_TCP, TCP_INFO, &ti, &len);
        if (rc < 0)
            rst_fail("cannot read a TCP connection's state (TCP_INFO)", 0, rc);
        if (ti.tcpi_state == TCP_FIN_WAIT2)
            return;
        ck_nanosleep_ms(1);
    }
    rst_fail("a half-closed TCP connection's peer did not acknowledge its FIN again", 0, -ETIMEDOUT);
}

/* tcpfin SLOT: an end that had shut its sending side and had its FIN
 * acknowledged (FIN wait 2; its peer in close wait), so again: the job
 * finds both ends in their states */
void op_tcpfin(const struct line *l)
{
    shut_and_wait(slot_fd(l, 1));
}

/* tcpgone TEMP SLOT: SLOT was in close wait and its peer's end had been
 * closed on this host, no process holding it: TEMP is that end made again
 * for the moment, shut and closed now, an orphan in FIN wait 2 again as the
 * kernel kept the old one */
void op_tcpgone(const struct line *l)
{
    int temp = slot_fd(l, 1);
    (void)slot_fd(l, 2);
    shut_and_wait(temp);
    ck_close(temp);
}

void op_tcp(const struct line *l)
{
    to_slot(tcp_socket((int)num(l, 3), (uint32_t)num(l, 4)), l, 1, "cannot create a TCP socket");
}

void op_tcpbind(const struct line *l)
{
    tcp_bind(slot_fd(l, 1), l, 2);
}

void op_tcpopts(const struct line *l)
{
    tcp_socket_opts(slot_fd(l, 1), (uint32_t)num(l, 2));
}

void op_sockbuf(const struct line *l)
{
    int fd = slot_fd(l, 1);
    int snd = (int)num(l, 2), rcv = (int)num(l, 3);
    /* root may exceed the system's maximum; others get what it allows */
    if (snd && ck_setsockopt(fd, SOL_SOCKET, SO_SNDBUFFORCE, &snd, sizeof(snd)) < 0)
        ck_setsockopt(fd, SOL_SOCKET, SO_SNDBUF, &snd, sizeof(snd));
    if (rcv && ck_setsockopt(fd, SOL_SOCKET, SO_RCVBUFFORCE, &rcv, sizeof(rcv)) < 0)
        ck_setsockopt(fd, SOL_SOCKET, SO_RCVBUF, &rcv, sizeof(rcv));
}

/* ---- TIME_WAIT ----
 *
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

/* destroy TIME_WAIT sockets on a local address; count or -errno */
static long clear_time_wait(const void *addr, size_t len)
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
