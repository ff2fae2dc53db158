/*
 * Unix sockets in the restore plan (plan.c has the format): each is made
 * once at its slot (both ends of a pair whose ends are both in the job as
 * one socketpair), bound and connected again, and its queued data sent
 * back: a stream's bytes by `write` (plan.c), datagrams one record at a
 * time.  Each process dups its sockets from the slots (fds.c).
 *   socket SLOT INO TYPE           socketpair A INO_A B INO_B TYPE
 *   bind SLOT NAME                 connect SLOT NAME
 *   messages SLOT FILE OFF LEN     uint32-length records, one send() each
 *   rights SLOT FILE OFF LEN FDS   one message (FILE OFF LEN: its bytes) sent with
 *                                  descriptors in flight, SCM_RIGHTS of the slots FDS
 *                                  (comma-separated, in order)
 *   sendto TYPE NAME FILE OFF LEN  records sent from a temporary socket
 *   shutdown SLOT HOW
 * `listen`, `close` and `sockopts` (plan.c) serve TCP sockets too.
 */
#include "plan.h"

#include <errno.h>
#include <sys/socket.h>
#include <sys/un.h>

static int sun_addr(const struct line *l, int i, struct sockaddr_un *sa)
{
    ck_memset(sa, 0, sizeof(*sa));
    sa->sun_family = AF_UNIX;
    size_t n = unhex(l, i, sa->sun_path, sizeof(sa->sun_path) + 1);
    return (int)(__builtin_offsetof(struct sockaddr_un, sun_path) + n);
}

void op_socket(const struct line *l)
{
    to_slot(ck_socket(AF_UNIX, (int)num(l, 3) | SOCK_CLOEXEC, 0), l, 1, "cannot create a Unix socket");
}

void op_socketpair(const struct line *l)
{
    int sv[2];
    long rc = ck_socketpair(AF_UNIX, (int)num(l, 5) | SOCK_CLOEXEC, 0, sv);
    if (rc < 0)
        rst_fail("cannot create a Unix socket pair", 0, rc);
    to_slot(sv[0], l, 1, "socketpair");
    to_slot(sv[1], l, 3, "socketpair");
}

/* mkdir -p of a path's directory, private to the job's user like the
 * temporary directories sockets usually live in */
static void make_parents(const char *path)
{
    char dir[sizeof(((struct sockaddr_un *)0)->sun_path) + 1];
    ck_strlcpy(dir, path, sizeof(dir));
    for (char *c = dir + 1; *c; c++) {
        if (*c != '/')
            continue;
        *c = 0;
        long rc = ck_mkdir(dir, 0700);
        if (rc < 0 && rc != -EEXIST)
            rst_fail("cannot create the directory of a Unix socket again", dir, rc);
        *c = '/';
    }
}

void op_bind(const struct line *l)
{
    struct sockaddr_un sa;
    int salen = sun_addr(l, 2, &sa);
    int fd = slot_fd(l, 1);
    if (sa.sun_path[0]) {
        /* the socket file the killed job left behind */
        struct stat st;
        if (ck_stat(sa.sun_path, &st) == 0 && S_ISSOCK(st.st_mode))
            ck_unlink(sa.sun_path);
    }
    long rc = ck_bind(fd, &sa, (unsigned)salen);
    if (rc == -ENOENT && sa.sun_path[0] == '/') {
        /* its directory is gone (multiprocessing removes its /tmp/pymp-*
         * directories at exit): it existed at the checkpoint, so make it */
        make_parents(sa.sun_path);
        rc = ck_bind(fd, &sa, (unsigned)salen);
    }
    if (rc < 0)
        rst_fail("cannot bind a Unix socket to its old address", sa.sun_path[0] ? sa.sun_path : sa.sun_path + 1, rc);
}

void op_connect(const struct line *l)
{
    struct sockaddr_un sa;
    int salen = sun_addr(l, 2, &sa);
    long rc = ck_connect(slot_fd(l, 1), &sa, (unsigned)salen);
    if (rc < 0)
        rst_fail("cannot connect a Unix socket to its old peer", sa.sun_path, rc);
}

/* uint32-length records, one message each */
static void send_records(int to, long in, uint64_t off, uint64_t len, const struct sockaddr_un *sa, int salen)
{
    uint64_t end = off + len;
    while (off < end) {
        uint32_t n;
        rst_pread_all((int)in, &n, sizeof(n), off, "saved queue data is truncated");
        off += sizeof(n);
        if (n > BOUNCE || off + n > end)
            rst_fail("corrupt saved datagram queue", 0, 0);
        rst_pread_all((int)in, bounce, n, off, "saved queue data is truncated");
        off += n;
        long w;
        do
            w = ck_sendto(to, bounce, n, MSG_DONTWAIT, sa, (unsigned)salen);
        while (w == -EINTR);
        if (w != (long)n)
            rst_fail("cannot put a queued message back", 0, w < 0 ? w : -EIO);
    }
}

void op_messages(const struct line *l)
{
    long in = open_data(l, 2);
    send_records(slot_fd(l, 1), in, num(l, 3), num(l, 4), 0, 0);
    ck_close((int)in);
}

void op_sendto(const struct line *l)
{
    struct sockaddr_un sa;
    int salen = sun_addr(l, 2, &sa);
    long s = ck_socket(AF_UNIX, (int)num(l, 1) | SOCK_CLOEXEC, 0);
    if (s < 0)
        rst_fail("cannot create a socket", 0, s);
    long in = open_data(l, 3);
    send_records((int)s, in, num(l, 4), num(l, 5), &sa, salen);
    ck_close((int)in);
    ck_close((int)s);
}

void op_shutdown(const struct line *l)
{
    long rc = ck_shutdown(slot_fd(l, 1), (int)num(l, 2));
    if (rc < 0 && rc != -ENOTCONN)
        rst_fail("cannot shut a socket down", 0, rc);
}

/* a message that carried descriptors, sent again with the plan's objects
 * (made at their slots before: plan/unix.py) in their place */
void op_rights(const struct line *l)
{
    int to = slot_fd(l, 1);
    uint64_t off = num(l, 3), n = num(l, 4);
    if (n > BOUNCE)
        rst_fail("corrupt restore plan: a message with descriptors is too large", 0, 0);
    if (l->ntok < 6)
        rst_fail("corrupt restore plan: a line is too short", l->tok[0], 0);
    union {
        struct cmsghdr h;
        char space[CMSG_SPACE(sizeof(int) * 253)];  /* SCM_MAX_FD */
    } ctl;
    int *fds = (int *)CMSG_DATA(&ctl.h);
    uint32_t nfds = 0;
    for (const char *p = l->tok[5]; *p;) {
        const char *end;
        uint64_t s = ck_parse_u64(p, 10, &end);
        if (end == p || nfds >= 253 || s >= (uint64_t)rst.nslots || (*end && *end != ','))
            rst_fail("corrupt restore plan: bad descriptor slots", l->tok[5], 0);
        fds[nfds++] = rst.slot_base + (int)s;
        p = *end ? end + 1 : end;
    }
    long in = open_data(l, 2);
    rst_pread_all((int)in, bounce, n, off, "saved queue data is truncated");
    ck_close((int)in);
    struct iovec iov = {bounce, n};
    struct msghdr msg;
    ck_memset(&msg, 0, sizeof(msg));
    msg.msg_iov = &iov;
    msg.msg_iovlen = 1;
    msg.msg_control = &ctl;
    msg.msg_controllen = CMSG_SPACE(sizeof(int) * nfds);
    ctl.h.cmsg_level = SOL_SOCKET;
    ctl.h.cmsg_type = SCM_RIGHTS;
    ctl.h.cmsg_len = CMSG_LEN(sizeof(int) * nfds);
    long w;
    do
        w = ck_sendmsg(to, &msg, MSG_DONTWAIT);
    while (w == -EINTR);
    if (w != (long)n)
        rst_fail("cannot put a queued message with descriptors back", 0, w < 0 ? w : -EIO);
}
