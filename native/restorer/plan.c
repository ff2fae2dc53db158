/*
 * The restore plan: how a whole process tree comes back.
 *
 * The agent (ckptd/image/plan.py) reads every process's image and writes a
 * text plan, one operation per line.  `ckptd-restore --build PLAN` runs as
 * pid 2 of the new pid namespace and carries it out in two steps:
 *
 *   objects  everything several processes may share (pipes, FIFOs, Unix
 *            sockets, shared memory) is created once, filled with the data
 *            that was in flight, and kept at fixed descriptor numbers
 *            ("slots", base + index) that every process inherits;
 *   tree     each process forks its children with their old pids (clone3
 *            set_tid), takes its session and process group, then execs
 *            `ckptd-restore IMAGE_DIR --plan PLAN` for its own image.
 *            Zombies are recreated by a child that exits at once.
 *            Orphans are forked with CLONE_PARENT by a child of init in
 *            their session; a session or group whose leader had exited by
 *            a helper process with the leader's pid, gone before the job
 *            runs.  Nobody execs its restorer before the whole tree exists
 *            (wait_tree).
 *
 * Each per-process restorer reads the plan's key lines to find the slot
 * for each of its pipes, sockets and shared mappings (rst_slot_for), dups
 * them into place and closes every slot before the job runs.
 *
 * Lines (numbers decimal, paths and names hex-encoded bytes):
 *   slots BASE COUNT
 *   pipe R W INO SIZE              fifo SLOT INO PATH
 *   log SLOT INO STDFD             the job's stdout/stderr pipe to the relay
 *   socket SLOT INO TYPE           socketpair A INO_A B INO_B TYPE
 *   bind SLOT NAME   listen SLOT BACKLOG   connect SLOT NAME
 *   write SLOT FILE OFF LEN        raw bytes (a pipe, or a stream socket's peer)
 *   messages SLOT FILE OFF LEN     uint32-length records, one send() each
 *   sendto TYPE NAME FILE OFF LEN  records sent from a temporary socket
 *   shutdown SLOT HOW   close SLOT
 *   shm SLOT DEV INO SIZE NAME     shmfill SLOT FILE
 *   tcp SLOT INO FAMILY OPTS       tcpbind SLOT SOCKADDR   tcpopts SLOT OPTS
 *   tcppair C S LISTENERS|-1 FAMILY S_ADDR C_ADDR C_PEER   (LISTENERS: slots, comma-separated)
 *   tcprepair SLOT LOCAL PEER SND_SEQ RCV_SEQ MSS SND_WS RCV_WS TCPI_OPTS TS
 *   repairq SLOT 1|2 FILE OFF LEN   repairoff SLOT WL1 WND MAXWND RCVWND RCVWUP
 *                                  C binds C_ADDR, connects to C_PEER; the
 *                                  accepted end is S
 *   sockbuf SLOT SNDBUF RCVBUF     widen buffers before a large queue goes back
 *   sockopts SLOT FILE OFF COUNT   ck_sockopt records (native/common/sockopts.h) set again
 *   proc PID PPID PGID SID DIR     zombie PID PPID PGID SID WSTATUS
 *   helper PID SID                 a session or group whose leader had exited:
 *                                  made again by a temporary child of init
 *   file SLOT FLAGS POS PATH       one open file description several processes
 *   fileshm SLOT SHM FLAGS POS       share (open, then fork): a file, directory,
 *   eventfd SLOT COUNT SEMAPHORE     device or FIFO opened again; a memfd or
 *                                    deleted tmpfs file opened again from the
 *                                    shm object at slot SHM; an eventfd
 *   desc SLOT PID FD               process PID's descriptor FD is that object
 */
#include "restorer.h"

#include <errno.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/un.h>

#include "../common/sockopts.h"

#ifndef F_SETPIPE_SZ
#define F_SETPIPE_SZ 1031
#endif
#ifndef CLONE_PARENT
#define CLONE_PARENT 0x00008000
#endif
#define MAX_PROCS 1024
#define BOUNCE (1u << 20)

struct rst_clone_args {
    uint64_t flags, pidfd, child_tid, parent_tid, exit_signal, stack, stack_size, tls, set_tid, set_tid_size, cgroup;
};

/* ---- reading the plan ---- */

#define MAX_TOKENS 16

struct line {
    char *tok[MAX_TOKENS];
    int ntok;
};

static char *next_line(char **cursor, char *end, struct line *l)
{
    char *p = *cursor;
    if (p >= end)
        return 0;
    char *eol = p;
    while (eol < end && *eol != '\n')
        eol++;
    *eol = 0;
    *cursor = eol + 1;
    l->ntok = 0;
    for (char *q = p; *q && l->ntok < MAX_TOKENS;) {
        while (*q == ' ')
            *q++ = 0;
        if (!*q)
            break;
        l->tok[l->ntok++] = q;
        while (*q && *q != ' ')
            q++;
    }
    return p;
}

static uint64_t num(const struct line *l, int i)
{
    if (i >= l->ntok)
        rst_fail("corrupt restore plan: a line is too short", l->ntok ? l->tok[0] : 0, 0);
    const char *end;
    uint64_t v = ck_parse_u64(l->tok[i], 10, &end);
    if (*end)
        rst_fail("corrupt restore plan: not a number", l->tok[i], 0);
    return v;
}

/* hex-encoded bytes into out (NUL-terminated too); returns the length */
static size_t unhex(const struct line *l, int i, char *out, size_t cap)
{
    if (i >= l->ntok)
        rst_fail("corrupt restore plan: a line is too short", l->tok[0], 0);
    const char *h = l->tok[i];
    size_t n = 0;
    if (h[0] == '-' && !h[1]) {
        out[0] = 0;
        return 0;
    }
    for (; h[0] && h[1] && n + 1 < cap; h += 2) {
        char pair[3] = {h[0], h[1], 0};
        out[n++] = (char)ck_parse_u64(pair, 16, 0);
    }
    out[n] = 0;
    return n;
}

static char *read_plan(const char *path, uint64_t *size)
{
    char *buf = (char *)rst_read_file(path, size);
    if (!ck_startswith(buf, "ckptd-plan 1\n"))
        rst_fail("not a ckptd restore plan (or another version)", path, 0);
    return buf;
}

static void add_key(uint32_t kind, uint64_t slot, uint64_t dev, uint64_t ino)
{
    if (rst.nkeys >= RST_MAX_KEYS)
        rst_fail("the restore plan shares too many objects", 0, 0);
    if (slot >= (uint64_t)rst.nslots)
        rst_fail("corrupt restore plan: slot out of range", 0, 0);
    struct rst_key *k = &rst.keys[rst.nkeys++];
    k->kind = kind;
    k->slot = (uint32_t)slot;
    k->dev = dev;
    k->ino = ino;
}

/* the lines that name a slot for some (kind, dev, ino); also remembered by the builder */
static void parse_key_line(const struct line *l)
{
    const char *op = l->tok[0];
    if (!ck_strcmp(op, "slots")) {
        rst.slot_base = (int)num(l, 1);
        rst.nslots = (int)num(l, 2);
    } else if (!ck_strcmp(op, "pipe")) {
        add_key(RST_KEY_PIPE_R, num(l, 1), 0, num(l, 3));
        add_key(RST_KEY_PIPE_W, num(l, 2), 0, num(l, 3));
    } else if (!ck_strcmp(op, "fifo")) {
        add_key(RST_KEY_FIFO, num(l, 1), 0, num(l, 2));
    } else if (!ck_strcmp(op, "log")) {
        add_key(RST_KEY_PIPE_W, num(l, 1), 0, num(l, 2));
    } else if (!ck_strcmp(op, "socket")) {
        add_key(RST_KEY_UNIX, num(l, 1), 0, num(l, 2));
    } else if (!ck_strcmp(op, "socketpair")) {
        add_key(RST_KEY_UNIX, num(l, 1), 0, num(l, 2));
        add_key(RST_KEY_UNIX, num(l, 3), 0, num(l, 4));
    } else if (!ck_strcmp(op, "shm")) {
        add_key(RST_KEY_SHM, num(l, 1), num(l, 2), num(l, 3));
    } else if (!ck_strcmp(op, "tcp")) {
        add_key(RST_KEY_TCP, num(l, 1), 0, num(l, 2));
    } else if (!ck_strcmp(op, "desc")) {
        add_key(RST_KEY_DESC, num(l, 1), num(l, 2), num(l, 3));
    }
}

void rst_load_plan_keys(const char *path)
{
    uint64_t size;
    char *buf = read_plan(path, &size), *cur = buf;
    struct line l;
    rst.nkeys = 0;
    while (next_line(&cur, buf + size, &l))
        if (l.ntok)
            parse_key_line(&l);
    ck_munmap(buf, (size + 4096) & ~4095ull);
}

int rst_slot_for(uint32_t kind, uint64_t dev, uint64_t ino)
{
    for (int i = 0; i < rst.nkeys; i++) {
        const struct rst_key *k = &rst.keys[i];
        if (k->kind == kind && k->ino == ino && ((kind != RST_KEY_SHM && kind != RST_KEY_DESC) || k->dev == dev))
            return rst.slot_base + (int)k->slot;
    }
    return -1;
}

void rst_close_slots(void)
{
    if (rst.nslots > 0)
        ck_sc3(SYS_close_range, rst.slot_base, rst.slot_base + rst.nslots - 1, 0);
}

/* ---- the builder: shared objects ---- */

static char *bounce;

static int slot_fd(const struct line *l, int i)
{
    uint64_t s = num(l, i);
    if (s >= (uint64_t)rst.nslots)
        rst_fail("corrupt restore plan: slot out of range", l->tok[0], 0);
    return rst.slot_base + (int)s;
}

/* put a new descriptor at its slot: inherited across fork and exec */
static void to_slot(long fd, const struct line *l, int i, const char *what)
{
    if (fd < 0)
        rst_fail(what, 0, fd);
    int want = slot_fd(l, i);
    if (fd != want) {
        long rc = ck_dup3((int)fd, want, 0);
        if (rc < 0)
            rst_fail("cannot place a shared object at its slot", what, rc);
        ck_close((int)fd);
    }
}

static int sun_addr(const struct line *l, int i, struct sockaddr_un *sa)
{
    ck_memset(sa, 0, sizeof(*sa));
    sa->sun_family = AF_UNIX;
    size_t n = unhex(l, i, sa->sun_path, sizeof(sa->sun_path) + 1);
    return (int)(__builtin_offsetof(struct sockaddr_un, sun_path) + n);
}

static long open_data(const struct line *l, int i)
{
    char path[1200];
    unhex(l, i, path, sizeof(path));
    long fd = ck_open(path, O_RDONLY | O_CLOEXEC, 0);
    if (fd < 0)
        rst_fail("cannot open saved data for the restore", path, fd);
    return fd;
}

/* the saved bytes FILE OFF LEN (tokens i..i+2) into a pipe or a stream
 * socket (or a TCP queue in repair mode), never blocking */
static void put_bytes(int to, const struct line *l, int i, const char *why)
{
    long in = open_data(l, i);
    uint64_t off = num(l, i + 1), left = num(l, i + 2);
    while (left) {
        uint64_t n = left > BOUNCE ? BOUNCE : left;
        rst_pread_all((int)in, bounce, n, off, "saved queue data is truncated");
        for (uint64_t done = 0; done < n;) {
            long w = ck_sendto(to, bounce + done, n - done, MSG_DONTWAIT, 0, 0);
            if (w == -ENOTSOCK)
                w = ck_write(to, bounce + done, n - done);
            if (w == -EINTR)
                continue;
            if (w <= 0)
                rst_fail(why, 0, w);
            done += (uint64_t)w;
        }
        off += n;
        left -= n;
    }
    ck_close((int)in);
}

static void op_write(const struct line *l)
{
    put_bytes(slot_fd(l, 1), l, 2, "cannot put queued bytes back (the queue is smaller than at checkpoint time?)");
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

static void op_sendto(const struct line *l)
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

/* copy the data ranges of a saved file into a shared memory object */
static void op_shmfill(const struct line *l)
{
    int to = slot_fd(l, 1);
    long in = open_data(l, 2);
    struct stat st;
    long rc = ck_fstat((int)in, &st);
    if (rc < 0)
        rst_fail("cannot stat saved shared memory", 0, rc);
    rc = ck_copy_sparse((int)in, to, (uint64_t)st.st_size);
    if (rc < 0)
        rst_fail("cannot refill shared memory", 0, rc);
    ck_close((int)in);
}

static void op_fifo(const struct line *l)
{
    char path[1200];
    unhex(l, 3, path, sizeof(path));
    long fd = ck_open(path, O_RDWR | O_NONBLOCK | O_CLOEXEC, 0);
    if (fd == -ENOENT) {
        long rc = ck_mknod(path, S_IFIFO | 0600, 0);
        if (rc < 0)
            rst_fail("cannot create a FIFO again", path, rc);
        fd = ck_open(path, O_RDWR | O_NONBLOCK | O_CLOEXEC, 0);
    }
    to_slot(fd, l, 1, "cannot open a FIFO");
}

/* an open file description several processes share, at its offset; its
 * status flags are set by each process that holds it (fds.c) */
static void op_file(const struct line *l, int from_shm)
{
    char path[1200];
    int flags = (int)num(l, from_shm ? 3 : 2) & ~(O_CREAT | O_TRUNC | O_EXCL | (from_shm ? O_NOFOLLOW : 0));
    long fd;
    if (from_shm) {
        /* a memfd or deleted file has no path: its object's /proc link does */
        struct ck_buf b;
        ck_buf_init(&b, path, sizeof(path));
        ck_buf_str(&b, "/proc/self/fd/");
        ck_buf_u64(&b, (uint64_t)slot_fd(l, 2));
    } else {
        unhex(l, 4, path, sizeof(path));
    }
    /* O_NONBLOCK: a FIFO's or device's open must not wait */
    fd = ck_open(path, flags | O_NONBLOCK | O_CLOEXEC, 0);
    if (fd < 0)
        rst_fail("cannot reopen a file several processes share", path, fd);
    long rc = ck_lseek((int)fd, (int64_t)num(l, from_shm ? 4 : 3), SEEK_SET);
    if (rc < 0 && rc != -ESPIPE)
        rst_fail("cannot seek a file several processes share", path, rc);
    to_slot(fd, l, 1, "cannot reopen a file several processes share");
}

static void op_eventfd(const struct line *l)
{
    long fd = ck_eventfd2(0, (num(l, 3) ? 1 /* EFD_SEMAPHORE */ : 0) | O_CLOEXEC);
    uint64_t v = num(l, 2);
    if (fd >= 0 && v && ck_write((int)fd, &v, sizeof(v)) != sizeof(v))
        rst_fail("cannot restore an eventfd counter", 0, 0);
    to_slot(fd, l, 1, "cannot create an eventfd");
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

static void op_bind(const struct line *l)
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

/* ---- TCP ---- */

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
    rst_tcp_clear_time_wait(addr, len);  /* best effort: needs CAP_NET_ADMIN */
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
static void op_tcppair(const struct line *l)
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

static void op_tcprepair(const struct line *l)
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

static void op_repairq(const struct line *l)
{
    int fd = slot_fd(l, 1);
    int q = num(l, 2) == 1 ? TCP_RECV_QUEUE : TCP_SEND_QUEUE;
    set_repair(fd, TCP_REPAIR_QUEUE, &q, sizeof(q), "TCP_REPAIR_QUEUE");
    put_bytes(fd, l, 3, "cannot put a TCP queue back in repair mode");
}

static void op_repairoff(const struct line *l)
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

/* sockopts SLOT FILE OFF COUNT: ck_sockopt records, only options the table names */
static void op_sockopts(const struct line *l)
{
    int fd = slot_fd(l, 1);
    long in = open_data(l, 2);
    uint64_t off = num(l, 3), n = num(l, 4);
    if (n > 4 * CK_NSOCKOPTS)
        rst_fail("corrupt restore plan: too many socket options", 0, 0);
    for (uint64_t i = 0; i < n; i++) {
        struct ck_sockopt o;
        rst_pread_all((int)in, &o, sizeof(o), off + i * sizeof(o), "saved socket options are truncated");
        const struct ck_sockopt_def *d = ck_sockopt_find(o.level, o.name);
        if (!d || o.len > d->size || o.len > sizeof(o.val))
            rst_fail("corrupt image: a socket option ckptd does not save", 0, 0);
        long rc = ck_setsockopt(fd, o.level, o.name, o.val, o.len);
        if (rc < 0)
            rst_fail("cannot set a socket option again", d->what, rc);
    }
    ck_close((int)in);
}

static void op_sockbuf(const struct line *l)
{
    int fd = slot_fd(l, 1);
    int snd = (int)num(l, 2), rcv = (int)num(l, 3);
    /* root may exceed the system's maximum; others get what it allows */
    if (snd && ck_setsockopt(fd, SOL_SOCKET, SO_SNDBUFFORCE, &snd, sizeof(snd)) < 0)
        ck_setsockopt(fd, SOL_SOCKET, SO_SNDBUF, &snd, sizeof(snd));
    if (rcv && ck_setsockopt(fd, SOL_SOCKET, SO_RCVBUFFORCE, &rcv, sizeof(rcv)) < 0)
        ck_setsockopt(fd, SOL_SOCKET, SO_RCVBUF, &rcv, sizeof(rcv));
}

static void build_objects(char *buf, uint64_t size)
{
    char *cur = buf;
    struct line l;
    next_line(&cur, buf + size, &l);  /* header */
    while (next_line(&cur, buf + size, &l)) {
        if (!l.ntok)
            continue;
        const char *op = l.tok[0];
        long rc = 0;
        parse_key_line(&l);
        if (!ck_strcmp(op, "slots")) {
            struct rlimit nofile;
            uint64_t need = (uint64_t)rst.slot_base + (uint64_t)rst.nslots + 64;
            if (ck_prlimit(RLIMIT_NOFILE, 0, &nofile) == 0 && nofile.rlim_cur < need) {
                nofile.rlim_cur = nofile.rlim_max < need ? nofile.rlim_max : need;
                ck_prlimit(RLIMIT_NOFILE, &nofile, 0);
            }
        } else if (!ck_strcmp(op, "pipe")) {
            int p[2];
            rc = ck_pipe2(p, O_CLOEXEC | O_NONBLOCK);
            if (rc < 0)
                rst_fail("cannot create a pipe", 0, rc);
            if (num(&l, 4))
                ck_fcntl(p[1], F_SETPIPE_SZ, (long)num(&l, 4));
            to_slot(p[0], &l, 1, "pipe");
            to_slot(p[1], &l, 2, "pipe");
        } else if (!ck_strcmp(op, "fifo")) {
            op_fifo(&l);
        } else if (!ck_strcmp(op, "log")) {
            to_slot(ck_fcntl((int)num(&l, 3), F_DUPFD_CLOEXEC, 0), &l, 1, "the job's output pipe");
        } else if (!ck_strcmp(op, "socket")) {
            to_slot(ck_socket(AF_UNIX, (int)num(&l, 3) | SOCK_CLOEXEC, 0), &l, 1, "cannot create a Unix socket");
        } else if (!ck_strcmp(op, "socketpair")) {
            int sv[2];
            rc = ck_socketpair(AF_UNIX, (int)num(&l, 5) | SOCK_CLOEXEC, 0, sv);
            if (rc < 0)
                rst_fail("cannot create a Unix socket pair", 0, rc);
            to_slot(sv[0], &l, 1, "socketpair");
            to_slot(sv[1], &l, 3, "socketpair");
        } else if (!ck_strcmp(op, "bind")) {
            op_bind(&l);
        } else if (!ck_strcmp(op, "listen")) {
            int fd = slot_fd(&l, 1), family = 0;
            unsigned flen = sizeof(family);
            ck_getsockopt(fd, SOL_SOCKET, SO_DOMAIN, &family, &flen);
            rc = ck_listen(fd, (int)num(&l, 2));
            if (rc < 0)
                rst_fail(family == AF_UNIX ? "cannot listen on a Unix socket"
                                           : "cannot listen on a TCP socket (is its port taken on this node?)",
                         0, rc);
        } else if (!ck_strcmp(op, "connect")) {
            struct sockaddr_un sa;
            int salen = sun_addr(&l, 2, &sa);
            rc = ck_connect(slot_fd(&l, 1), &sa, (unsigned)salen);
            if (rc < 0)
                rst_fail("cannot connect a Unix socket to its old peer", sa.sun_path, rc);
        } else if (!ck_strcmp(op, "write")) {
            op_write(&l);
        } else if (!ck_strcmp(op, "messages")) {
            long in = open_data(&l, 2);
            send_records(slot_fd(&l, 1), in, num(&l, 3), num(&l, 4), 0, 0);
            ck_close((int)in);
        } else if (!ck_strcmp(op, "sendto")) {
            op_sendto(&l);
        } else if (!ck_strcmp(op, "shutdown")) {
            rc = ck_shutdown(slot_fd(&l, 1), (int)num(&l, 2));
            if (rc < 0 && rc != -ENOTCONN)
                rst_fail("cannot shut a socket down", 0, rc);
        } else if (!ck_strcmp(op, "close")) {
            ck_close(slot_fd(&l, 1));
        } else if (!ck_strcmp(op, "shm")) {
            char name[256];
            unhex(&l, 5, name, sizeof(name));
            /* the name as the job's memfd had it (empty too); sealable, so
             * that its seals can be added back once it is filled (fds.c) */
            rc = ck_memfd_create(name, 1 /* MFD_CLOEXEC */ | 2 /* MFD_ALLOW_SEALING */);
            if (rc >= 0) {
                long t = ck_ftruncate((int)rc, (int64_t)num(&l, 4));
                if (t < 0)
                    rst_fail("cannot size shared memory", name, t);
            }
            to_slot(rc, &l, 1, "cannot create shared memory (memfd)");
        } else if (!ck_strcmp(op, "shmfill")) {
            op_shmfill(&l);
        } else if (!ck_strcmp(op, "tcp")) {
            to_slot(tcp_socket((int)num(&l, 3), (uint32_t)num(&l, 4)), &l, 1, "cannot create a TCP socket");
        } else if (!ck_strcmp(op, "tcpbind")) {
            tcp_bind(slot_fd(&l, 1), &l, 2);
        } else if (!ck_strcmp(op, "tcppair")) {
            op_tcppair(&l);
        } else if (!ck_strcmp(op, "tcprepair")) {
            op_tcprepair(&l);
        } else if (!ck_strcmp(op, "repairq")) {
            op_repairq(&l);
        } else if (!ck_strcmp(op, "repairoff")) {
            op_repairoff(&l);
        } else if (!ck_strcmp(op, "tcpopts")) {
            tcp_socket_opts(slot_fd(&l, 1), (uint32_t)num(&l, 2));
        } else if (!ck_strcmp(op, "sockopts")) {
            op_sockopts(&l);
        } else if (!ck_strcmp(op, "sockbuf")) {
            op_sockbuf(&l);
        } else if (!ck_strcmp(op, "file") || !ck_strcmp(op, "fileshm")) {
            op_file(&l, op[4] == 's');
        } else if (!ck_strcmp(op, "eventfd")) {
            op_eventfd(&l);
        } else if (ck_strcmp(op, "proc") && ck_strcmp(op, "zombie") && ck_strcmp(op, "helper") &&
                   ck_strcmp(op, "desc")) {
            rst_fail("corrupt restore plan: unknown operation", op, 0);
        }
    }
}

/* ---- the builder: the process tree ---- */

struct plan_proc {
    int pid, ppid, pgid, sid;
    int zombie, helper, wstatus;
    char dir[1024];
};

static struct plan_proc *procs;
static int nprocs;
/* the tree is whole when this pipe reads EOF: every process holds its
 * write end until it has forked its children and joined its group */
static int tree_pipe[2] = {-1, -1};

static void collect_procs(char *buf, uint64_t size)
{
    char *cur = buf;
    struct line l;
    procs = ck_mmap(0, sizeof(*procs) * MAX_PROCS, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (ck_mmap_failed(procs))
        rst_fail("out of memory", 0, (long)procs);
    while (next_line(&cur, buf + size, &l)) {
        if (!l.ntok)
            continue;
        int zombie = !ck_strcmp(l.tok[0], "zombie"), helper = !ck_strcmp(l.tok[0], "helper");
        if (ck_strcmp(l.tok[0], "proc") && !zombie && !helper)
            continue;
        if (nprocs >= MAX_PROCS)
            rst_fail("too many processes in the restore plan", 0, 0);
        struct plan_proc *p = &procs[nprocs++];
        p->pid = (int)num(&l, 1);
        p->zombie = zombie;
        p->helper = helper;
        if (helper) {  /* helper PID SID: a child of init leading group PID (and session PID if SID is PID) */
            p->ppid = 1;
            p->pgid = p->pid;
            p->sid = (int)num(&l, 2);
            continue;
        }
        p->ppid = (int)num(&l, 2);
        p->pgid = (int)num(&l, 3);
        p->sid = (int)num(&l, 4);
        if (zombie)
            p->wstatus = (int)num(&l, 5);
        else
            unhex(&l, 5, p->dir, sizeof(p->dir));
    }
}

static void die_as(const struct plan_proc *p) __attribute__((noreturn));
static void die_as(const struct plan_proc *p)
{
    int sig = p->wstatus & 0x7f;
    if (sig && sig != 0x7f) {
        struct ck_kernel_sigaction dfl;
        ck_memset(&dfl, 0, sizeof(dfl));
        ck_rt_sigaction(sig, &dfl, 0);
        uint64_t none = 0;
        ck_sigprocmask(SIG_SETMASK, &none, 0);
        ck_kill((int)ck_getpid(), sig);
    }
    ck_exit_group((p->wstatus >> 8) & 0xff);
}

/* Wait until every process of the tree exists, in its session and group:
 * then a restorer that reopens /proc/PID/... of another process of the job
 * finds it, and a helper (which has made its session or group, forked its
 * orphans and kept the group alive while others joined it) may go. */
static void wait_tree(void)
{
    ck_close(tree_pipe[1]);
    char c;
    while (ck_read(tree_pipe[0], &c, 1) == -EINTR)
        ;
    ck_close(tree_pipe[0]);
}

static void become(int idx) __attribute__((noreturn));

static void spawn(int idx, uint64_t flags)
{
    int64_t tid = procs[idx].pid;
    struct rst_clone_args a;
    ck_memset(&a, 0, sizeof(a));
    a.flags = flags;
    /* clone3 refuses an exit signal with CLONE_PARENT: the child gets its
     * new parent's (init's child's: SIGCHLD) */
    a.exit_signal = (flags & CLONE_PARENT) ? 0 : SIGCHLD;
    a.set_tid = (uint64_t)&tid;
    a.set_tid_size = 1;
    long rc = ck_clone3(&a, sizeof(a));
    if (rc < 0) {
        char what[32];
        struct ck_buf b;
        ck_buf_init(&b, what, sizeof(what));
        ck_buf_str(&b, "pid ");
        ck_buf_u64(&b, (uint64_t)tid);
        rst_fail("cannot recreate a process with its old pid (clone3 set_tid)", what, rc);
    }
    if (rc == 0)
        become(idx);
}

static void exec_restorer(const struct plan_proc *p) __attribute__((noreturn));
static void exec_restorer(const struct plan_proc *p)
{
    static char status[1200];
    struct ck_buf b;
    ck_buf_init(&b, status, sizeof(status));
    ck_buf_str(&b, rst.status_dir);
    ck_buf_str(&b, "/restore-");
    ck_buf_u64(&b, (uint64_t)p->pid);
    ck_buf_str(&b, ".status");
    static char key_fd[24];  /* encryption at rest: the descriptor holding the key goes on to each */
    ck_buf_init(&b, key_fd, sizeof(key_fd));
    ck_buf_u64(&b, (uint64_t)rst.key_fd);
    char *argv[] = {rst.self_path, (char *)p->dir, "--status-file", status, "--agent-socket", rst.agent_socket,
                    "--checkpoint", rst.checkpoint_id, "--plan", rst.plan_path, rst.lazy ? "--lazy" : "--eager",
                    rst.key_fd >= 0 ? "--key-fd" : 0, key_fd, 0};
    char *envp[] = {0};
    long rc = ck_execve(rst.self_path, argv, envp);
    rst_fail("cannot run the restorer for a process", rst.self_path, rc);
}

/* the process that forks a child of init (an orphan or a helper), with
 * CLONE_PARENT: a child of init in its session (plan.py checks there is one) */
static int spawner_of(const struct plan_proc *p)
{
    return p->sid == p->pid ? 2 : p->sid;
}

/* the group may not exist yet: its leader (or helper) is forked by another
 * branch of the tree, concurrently; nobody waits here before forking its
 * own children, so every group's leader comes */
static void join_group(const struct plan_proc *p)
{
    for (int tries = 0;; tries++) {
        long rc = ck_setpgid(0, p->pgid);
        if (rc >= 0)
            return;
        if (rc != -EPERM || tries >= 5000)
            rst_fail("cannot rejoin a process group (its leader did not come back)", 0, rc);
        ck_nanosleep_ms(2);
    }
}

static void become(int idx)
{
    const struct plan_proc *p = &procs[idx];
    long rc = 0;
    if (!p->sid || !p->pgid) {  /* a zombie whose session or group was outside the job's pid namespace */
        if (p->zombie)
            die_as(p);
        rst_fail("corrupt restore plan: a process without a session or process group", 0, 0);
    }
    if (p->sid == p->pid && ck_getsid(0) != p->pid)
        rc = ck_setsid();
    else if (p->pgid == p->pid && ck_getpgid(0) != p->pid)
        rc = ck_setpgid(0, 0);
    if (rc < 0)
        rst_fail("cannot recreate a session or process group", 0, rc);
    if (ck_getsid(0) != p->sid)
        rst_fail("cannot restore a process's session (it was created by a process that is gone)", 0, 0);
    /* init's children in this session: helpers first (the groups and
     * sessions that others join), then orphans */
    if (p->ppid == 1)
        for (int pass = 0; pass < 2; pass++)
            for (int j = 0; j < nprocs; j++)
                if (j != idx && procs[j].ppid == 1 && procs[j].pid != 2 && procs[j].helper == !pass &&
                    spawner_of(&procs[j]) == p->pid)
                    spawn(j, CLONE_PARENT);
    for (int j = 0; j < nprocs; j++)
        if (j != idx && procs[j].ppid == p->pid)
            spawn(j, 0);
    if (ck_getpgid(0) != p->pgid)
        join_group(p);
    if (p->zombie)
        die_as(p);
    if (p->helper) {  /* nothing of the job's may stay open in it: it exits once the tree is whole */
        ck_close_range(0, (unsigned)tree_pipe[0] - 1);
        ck_close_range((unsigned)tree_pipe[0] + 1, ~0u);
        tree_pipe[1] = -1;
    }
    wait_tree();
    if (p->helper)
        ck_exit_group(0);  /* init reaps it */
    exec_restorer(p);
}

void rst_build(void)
{
    uint64_t size;
    char *buf = read_plan(rst.plan_path, &size);
    bounce = ck_mmap(0, BOUNCE, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (ck_mmap_failed(bounce))
        rst_fail("out of memory", 0, (long)bounce);
    build_objects(buf, size);
    /* the lines were cut into tokens in place: read them again */
    ck_munmap(buf, (size + 4096) & ~4095ull);
    buf = read_plan(rst.plan_path, &size);
    collect_procs(buf, size);
    int tp[2];
    long rc = ck_pipe2(tp, O_CLOEXEC);
    if (rc < 0)
        rst_fail("cannot create a pipe", 0, rc);
    for (int k = 0; k < 2; k++) {  /* above the slots: nothing of the job's is there */
        tree_pipe[k] = (int)ck_fcntl(tp[k], F_DUPFD_CLOEXEC, rst.slot_base + rst.nslots);
        if (tree_pipe[k] < 0)
            rst_fail("cannot place a pipe", 0, tree_pipe[k]);
        ck_close(tp[k]);
    }
    for (int i = 0; i < nprocs; i++)
        if (procs[i].pid == (int)ck_getpid() && !procs[i].zombie)
            become(i);
    rst_fail("the restore plan has no process for pid 2", 0, 0);
}
