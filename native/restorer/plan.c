/*
 * The restore plan: how a whole process tree comes back.
 *
 * The agent (ckptd/image/plan/, one module per kind) reads every
 * process's image and writes a text plan, one operation per line.  `ckptd-restore --build PLAN` runs as
 * pid 2 of the new pid namespace and carries it out in two steps:
 *
 *   objects  everything several processes may share (pipes, FIFOs, Unix
 *            sockets, shared memory) is created once, filled with the data
 *            that was in flight, and kept at fixed descriptor numbers
 *            ("slots", base + index) that every process inherits;
 *   tree     each process forks its children with their old pids (clone3
 *            set_tid), takes its session and process group, then execs
 *            `ckptd-restore IMAGE_DIR --plan PLAN` for its own image
 *            (plan_tree.c).
 *
 * Each per-process restorer reads the plan's key lines to find the slot
 * for each of its pipes, sockets and shared mappings (rst_slot_for), dups
 * them into place and closes every slot before the job runs.
 *
 * This file reads the plan and holds what the kinds share; each kind's
 * operations are in its own file, behind one table (ops[] below).
 *
 * Lines (numbers decimal, paths and names hex-encoded bytes), by the file
 * that carries them out:
 *   plan.c       ckptd-plan 1                   the header
 *                slots BASE COUNT
 *                write SLOT FILE OFF LEN        raw bytes (a pipe, or a stream socket's peer)
 *                listen SLOT BACKLOG            a Unix or TCP socket
 *                close SLOT
 *                sockopts SLOT FILE OFF COUNT   ck_sockopt records (native/common/sockopts.h)
 *                                               set again, on a Unix, TCP, UDP or raw socket
 *   plan_pipe.c  pipe R W INO SIZE              fifo SLOT INO PATH
 *                log SLOT INO STDFD             the job's stdout/stderr pipe to the relay
 *   plan_unix.c  socket SLOT INO TYPE           socketpair A INO_A B INO_B TYPE
 *                bind SLOT NAME                 connect SLOT NAME
 *                messages SLOT FILE OFF LEN     uint32-length records, one send() each
 *                rights SLOT FILE OFF LEN FDS   one message sent with descriptors (SCM_RIGHTS of
 *                                               the slots FDS, comma-separated)
 *                sendto TYPE NAME FILE OFF LEN  records sent from a temporary socket
 *                shutdown SLOT HOW
 *   plan_tcp.c   tcp SLOT INO FAMILY OPTS       tcpbind SLOT SOCKADDR   tcpopts SLOT OPTS
 *                tcppair C S LISTENERS|-1 FAMILY S_ADDR C_ADDR C_PEER   (LISTENERS: slots, comma-separated)
 *                                               C binds C_ADDR, connects to C_PEER; the
 *                                               accepted end is S
 *                tcprepair SLOT LOCAL PEER SND_SEQ RCV_SEQ MSS SND_WS RCV_WS TCPI_OPTS TS
 *                repairq SLOT 1|2 FILE OFF LEN  repairoff SLOT WL1 WND MAXWND RCVWND RCVWUP
 *                sockbuf SLOT SNDBUF RCVBUF     widen buffers before a large queue goes back
 *                tcpfin SLOT                    shut the sending side again, wait for FIN wait 2
 *                tcpgone TEMP SLOT              close TEMP, SLOT's closed peer, wait for close wait
 *   plan_dgram.c dgram SLOT INO FAMILY TYPE PROTOCOL OPTS   a UDP, ping or raw socket
 *                dgrambind SLOT SOCKADDR        dgramconnect SLOT SOCKADDR
 *                mcast SLOT FAMILY IFNAME GROUP a multicast group joined again (any source)
 *   plan_shm.c   shm SLOT DEV INO SIZE NAME     shmfill SLOT FILE
 *   plan_deleted.c  deleted SLOT DEV INO MODE UID GID SIZE PATH FILE   a deleted file (FILE: its
 *                                               contents) or removed directory (FILE "-")
 *                                               made again, opened at SLOT, removed again
 *   plan_file.c  file SLOT FLAGS POS PATH       one open file description several processes
 *                fileshm SLOT SHM FLAGS POS       share (open, then fork): a file, directory,
 *                                                 device or FIFO opened again; a memfd or
 *                                                 deleted tmpfs file opened again from the
 *                                                 shm object (or deleted file) at slot SHM
 *                desc SLOT PID FD               process PID's descriptor FD is that object
 *                                               (a key only: fds.c takes it)
 *   plan_eventfd.c  eventfd SLOT COUNT SEMAPHORE   an eventfd several processes share
 *   plan_timerfd.c  timerfd SLOT CLOCK INTERVAL_NS VALUE_NS TICKS FLAGS   a timerfd several processes share
 *   plan_signalfd.c signalfd SLOT MASK           a signalfd several processes share
 *   plan_sysv.c  sysvshm ID KEY MODE UID GID SIZE FILE   System V IPC objects, made again
 *                sysvsem ID KEY MODE UID GID NSEMS FILE [UNDO]   under their ids in the job's
 *                sysvmsg ID KEY MODE UID GID QBYTES COUNT FILE   fresh IPC namespace
 *   plan_pty.c   pty SLOT INDEX STATE TERMIOS ROW COL XPIXEL YPIXEL FILE OFF LEN
 *                                               a pseudo-terminal pair at its number
 *   plan_tree.c  proc PID PPID PGID SID DIR     zombie PID PPID PGID SID WSTATUS
 *                ctty SID SLAVE SLOT PGRP       session SID's controlling terminal: the pty
 *                                               at SLOT (its slave if SLAVE is 1), PGRP in front
 *                helper PID SID                 a session or group whose leader had exited:
 *                                               made again by a temporary child of init
 */
#include "plan.h"

#include <errno.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sys/socket.h>

#include "../common/sockopts.h"

/* ---- reading the plan ---- */

char *plan_next_line(char **cursor, char *end, struct line *l)
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

uint64_t num(const struct line *l, int i)
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
size_t unhex(const struct line *l, int i, char *out, size_t cap)
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

/* ---- what the kinds share ---- */

char *bounce;

int slot_fd(const struct line *l, int i)
{
    uint64_t s = num(l, i);
    if (s >= (uint64_t)rst.nslots)
        rst_fail("corrupt restore plan: slot out of range", l->tok[0], 0);
    return rst.slot_base + (int)s;
}

/* put a new descriptor at its slot: inherited across fork and exec */
void to_slot(long fd, const struct line *l, int i, const char *what)
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

long open_data(const struct line *l, int i)
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
void put_bytes(int to, const struct line *l, int i, const char *why)
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

/* ---- the operations several kinds share ---- */

static void op_slots(const struct line *l)
{
    (void)l;  /* the numbers were read with the keys (parse_key_line) */
    struct rlimit nofile;
    uint64_t need = (uint64_t)rst.slot_base + (uint64_t)rst.nslots + 64;
    if (ck_prlimit(RLIMIT_NOFILE, 0, &nofile) == 0 && nofile.rlim_cur < need) {
        nofile.rlim_cur = nofile.rlim_max < need ? nofile.rlim_max : need;
        ck_prlimit(RLIMIT_NOFILE, &nofile, 0);
    }
}

static void op_write(const struct line *l)
{
    put_bytes(slot_fd(l, 1), l, 2, "cannot put queued bytes back (the queue is smaller than at checkpoint time?)");
}

static void op_listen(const struct line *l)
{
    int fd = slot_fd(l, 1), family = 0;
    unsigned flen = sizeof(family);
    ck_getsockopt(fd, SOL_SOCKET, SO_DOMAIN, &family, &flen);
    long rc = ck_listen(fd, (int)num(l, 2));
    if (rc < 0)
        rst_fail(family == AF_UNIX ? "cannot listen on a Unix socket"
                                   : "cannot listen on a TCP socket (is its port taken on this node?)",
                 0, rc);
}

static void op_close(const struct line *l)
{
    ck_close(slot_fd(l, 1));
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

/* ---- the table: every op word, its builder, the keys it names ---- */

/*
 * Filled by code, not initialised data: a pointer in initialised data needs
 * a relocation, and the restorer has none (it copies itself elsewhere), so
 * it is filled again each time it is used, where it runs.
 */
#define KEY(kind, slot, dev, ino) {kind, slot, dev, ino}
#define MAX_OPS 64
#define OP(w, fn, ...) add_op(&n, (struct plan_op){w, fn, {__VA_ARGS__}})
static struct plan_op ops[MAX_OPS];
static size_t nops;

static void add_op(size_t *n, struct plan_op op)
{
    if (*n >= MAX_OPS)
        rst_fail("too many restore plan operations for the table (raise MAX_OPS in plan.c)", op.word, 0);
    ops[(*n)++] = op;
}

static void fill_ops(void)
{
    size_t n = 0;
    OP("slots", op_slots);
    OP("write", op_write);
    OP("listen", op_listen);
    OP("close", op_close);
    OP("sockopts", op_sockopts);
    /* plan_pipe.c */
    OP("pipe", op_pipe, KEY(RST_KEY_PIPE_R, 1, 0, 3), KEY(RST_KEY_PIPE_W, 2, 0, 3));
    OP("fifo", op_fifo, KEY(RST_KEY_FIFO, 1, 0, 2));
    OP("log", op_log, KEY(RST_KEY_PIPE_W, 1, 0, 2));
    /* plan_unix.c */
    OP("socket", op_socket, KEY(RST_KEY_UNIX, 1, 0, 2));
    OP("socketpair", op_socketpair, KEY(RST_KEY_UNIX, 1, 0, 2), KEY(RST_KEY_UNIX, 3, 0, 4));
    OP("bind", op_bind);
    OP("connect", op_connect);
    OP("messages", op_messages);
    OP("rights", op_rights);
    OP("sendto", op_sendto);
    OP("shutdown", op_shutdown);
    /* plan_tcp.c */
    OP("tcp", op_tcp, KEY(RST_KEY_TCP, 1, 0, 2));
    OP("tcpbind", op_tcpbind);
    OP("tcpopts", op_tcpopts);
    OP("tcppair", op_tcppair);
    OP("tcprepair", op_tcprepair);
    OP("repairq", op_repairq);
    OP("repairoff", op_repairoff);
    OP("sockbuf", op_sockbuf);
    OP("tcpfin", op_tcpfin);
    OP("tcpgone", op_tcpgone);
    /* plan_dgram.c */
    OP("dgram", op_dgram, KEY(RST_KEY_DGRAM, 1, 0, 2));
    OP("dgrambind", op_dgrambind);
    OP("dgramconnect", op_dgramconnect);
    OP("mcast", op_mcast);
    /* plan_shm.c */
    OP("shm", op_shm, KEY(RST_KEY_SHM, 1, 2, 3));
    OP("shmfill", op_shmfill);
    /* plan_file.c; desc is a key only (fds.c takes it) */
    OP("deleted", op_deleted, KEY(RST_KEY_DELETED, 1, 2, 3));

    OP("file", op_file);
    OP("fileshm", op_fileshm);
    OP("desc", 0, KEY(RST_KEY_DESC, 1, 2, 3));
    /* plan_eventfd.c */
    OP("eventfd", op_eventfd);
    OP("timerfd", op_timerfd);
    OP("signalfd", op_signalfd);
    /* plan_sysv.c */
    OP("sysvshm", op_sysvshm);
    OP("sysvsem", op_sysvsem);
    OP("sysvmsg", op_sysvmsg);
    /* plan_pty.c; ctty is plan_tree.c's */
    OP("pty", op_pty, KEY(RST_KEY_PTY, 1, 0, 2));
    OP("ctty", 0);
    /* plan_tree.c, once every object exists */
    OP("proc", 0);
    OP("zombie", 0);
    OP("helper", 0);
    nops = n;
}

static const struct plan_op *find_op(const char *word)
{
    for (size_t i = 0; i < nops; i++)
        if (!ck_strcmp(ops[i].word, word))
            return &ops[i];
    return 0;
}

/* ---- the keys: which slot holds some (kind, dev, ino) ---- */

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

/* the lines that name a slot for some (kind, dev, ino); also remembered by
 * the builder.  Returns the line's operation, 0 for an unknown word. */
static const struct plan_op *parse_key_line(const struct line *l)
{
    if (!ck_strcmp(l->tok[0], "slots")) {
        rst.slot_base = (int)num(l, 1);
        rst.nslots = (int)num(l, 2);
    }
    const struct plan_op *op = find_op(l->tok[0]);
    for (int k = 0; op && k < 2 && op->key[k].kind; k++) {
        const struct plan_key *key = &op->key[k];
        uint64_t ino = num(l, key->ino), dev = key->dev ? num(l, key->dev) : 0;
        add_key(key->kind, num(l, key->slot), dev, ino);
    }
    return op;
}

void rst_load_plan_keys(const char *path)
{
    uint64_t size;
    char *buf = read_plan(path, &size), *cur = buf;
    struct line l;
    fill_ops();
    rst.nkeys = 0;
    while (plan_next_line(&cur, buf + size, &l))
        if (l.ntok)
            parse_key_line(&l);
    ck_munmap(buf, (size + 4096) & ~4095ull);
}

int rst_slot_for(uint32_t kind, uint64_t dev, uint64_t ino)
{
    for (int i = 0; i < rst.nkeys; i++) {
        const struct rst_key *k = &rst.keys[i];
        if (k->kind == kind && k->ino == ino &&
            ((kind != RST_KEY_SHM && kind != RST_KEY_DESC && kind != RST_KEY_DELETED) || k->dev == dev))
            return rst.slot_base + (int)k->slot;
    }
    return -1;
}

void rst_close_slots(void)
{
    if (rst.nslots > 0)
        ck_sc3(SYS_close_range, rst.slot_base, rst.slot_base + rst.nslots - 1, 0);
}

/* ---- the builder ---- */

static void build_objects(char *buf, uint64_t size)
{
    char *cur = buf;
    struct line l;
    fill_ops();
    plan_next_line(&cur, buf + size, &l);  /* header */
    while (plan_next_line(&cur, buf + size, &l)) {
        if (!l.ntok)
            continue;
        const struct plan_op *op = parse_key_line(&l);
        if (!op)
            rst_fail("corrupt restore plan: unknown operation", l.tok[0], 0);
        if (op->build)
            op->build(&l);
    }
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
    plan_build_tree(buf, size);
}
