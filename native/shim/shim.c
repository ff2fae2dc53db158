/*
 * libckptd.so entry point: registration with the agent and the checkpoint
 * thread's command loop.
 *
 * Protocol (one line per message, tab-separated, values percent-encoded;
 * see agent/shim_link.py for the agent's side):
 *   shim  -> agent  HELLO job= pid= tid= ppid= exe= restored=0|1 checkpoint=
 *   agent -> shim   PREMAP [dir=]         -> PREMAPPED  (smaps read early, before parking;
 *                   dir: the image directory, whose files are made now: image_dir.c)
 *   agent -> shim   QUIESCE timeout_ms=   -> QUIESCED threads= unsent=   | ERROR msg=
 *                   (unsent: TCP sockets holding written, unsent bytes once
 *                   parked; 0 in every process: the round needs no SETTLE)
 *   agent -> shim   SETTLE timeout_ms=    -> SETTLED stuck=
 *                   (every process of the round is parked: let unsent TCP
 *                   bytes leave into the parked peers; stuck: still unsent)
 *   agent -> shim   DUMP dir= base= image= depth= cached= sync= dedup= [key=]
 *                                         -> DUMPED <stats> | ERROR [retry=1] msg=
 *                   (base: the checkpoint this one may build on; image: this
 *                   image's final directory relative to the job's, depth levels down;
 *                   sync=1: no writer, the copy might not fit in memory)
 *                   (retry=1: a passing state, e.g. descriptors in flight; worth another round)
 *                   (<stats> ends with sysv=0|1: the IPC namespace holds System V objects; dump_sysv.c)
 *   agent -> shim   RESUME / ABORT        -> RESUMED  (ABORT also stops the writer)
 *   agent -> shim   FLUSH                 -> FLUSHED written=0|1 | ERROR msg=
 *                   (lets the forked writer start, once every rank of the
 *                   round runs again, and waits until it has finished
 *                   pages.img; or writes the pages the dump staged; writeout.c)
 *   agent -> shim   DISCARD               -> DISCARDED  (kills the writer, drops staged pages)
 *   agent -> shim   REBASE core= image=   -> REBASED | ERROR msg=
 *                   (the agent rewrote the last image, core.img at core=:
 *                   the next one refers to its pages where they are now)
 *   agent -> shim   ADOPT core= image=    -> ADOPTED | ERROR msg=
 *                   (restored, still parked: the image it came from, core.img
 *                   at core=, named image= as DUMP names them, is its last
 *                   one; the restorer protected its memory: track.c)
 *   agent -> shim   LAZY_DONE             -> LAZY_DONE  (restart --lazy: every page is back; fork() may go on)
 *   agent -> shim   PING                  -> PONG
 *   shim  -> agent  TERM tid= sender=     (unasked: a SIGTERM at its default disposition
 *                                         is held, sigterm.c; any time, between replies)
 *   agent -> shim   TERM_HOLD | TERM_DELIVER -> TERM_OK  (the agent's decision)
 * After a restart --lazy the restored HELLO also says lazy_uffd=N: the
 * descriptor the agent takes (pidfd_getfd) for its pager before RESUME,
 * which closes the process's own copy (native/restorer/lazy.c).  QUIESCE
 * is refused (retry=1) while the fill runs (native/shim/lazy.c).
 * If the connection drops while threads are parked they are released: a
 * job is never left frozen because its agent died.  Except a restored
 * process before its first RESUME: only the agent knows whether its images
 * verified, so it stays parked and says HELLO restored=1 to the next agent
 * (which kills it: agent/runtime.py adopt).  Nothing unverified runs.
 */
#include "shim.h"
#include "../common/sys.h"
#include "../common/util.h"

#include <errno.h>
#include <pthread.h>
#include <stdlib.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/un.h>

#define CK_HIGH_FD 900
#define CK_PROTOCOL_VERSION 1

struct ck_shim_state ck_shim = {.agent_fd = -1, .lazy_fd = -1};
struct ck_restart_info ck_restart;

static char rx_buf[8192];
static size_t rx_len;

static void uri_decode(char *s)
{
    char *out = s;
    for (; *s; s++) {
        if (s[0] == '%' && s[1] && s[2]) {
            const char *end;
            char hex[3] = {s[1], s[2], 0};
            uint64_t v = ck_parse_u64(hex, 16, &end);
            if (end == hex + 2) {
                *out++ = (char)v;
                s += 2;
                continue;
            }
        }
        *out++ = *s;
    }
    *out = 0;
}

/* value of key in a received line ("CMD\tk=v\tk=v"), decoded in place */
static const char *msg_get(char *line, const char *key)
{
    size_t kl = ck_strlen(key);
    char *p = line;
    while ((p = __builtin_strchr(p, '\t')) != 0) {
        p++;
        if (ck_strncmp(p, key, kl) == 0 && p[kl] == '=') {
            char *v = p + kl + 1;
            char *end = __builtin_strchr(v, '\t');
            if (end)
                *end = 0;
            uri_decode(v);
            return v;
        }
    }
    return 0;
}

/* value of key copied out (decoded) into buf; the line is left as it was */
static const char *msg_copy(const char *line, const char *key, char *buf, size_t cap)
{
    size_t kl = ck_strlen(key);
    const char *p = line;
    while ((p = __builtin_strchr(p, '\t')) != 0) {
        p++;
        if (ck_strncmp(p, key, kl) == 0 && p[kl] == '=') {
            const char *v = p + kl + 1;
            size_t n = 0;
            while (v[n] && v[n] != '\t' && v[n] != '\n' && n + 1 < cap)
                n++;
            ck_memcpy(buf, v, n);
            buf[n] = 0;
            uri_decode(buf);
            return buf;
        }
    }
    return 0;
}

static int send_all(int fd, const char *p, size_t n)
{
    while (n) {
        long w = ck_sc4(SYS_sendto, fd, p, n, MSG_NOSIGNAL);
        if (w == -EINTR)
            continue;
        if (w <= 0)
            return -1;
        p += w;
        n -= (size_t)w;
    }
    return 0;
}

static int send_line(struct ck_buf *b)
{
    ck_buf_char(b, '\n');
    if (ck_shim.agent_fd < 0)
        return -1;
    return send_all(ck_shim.agent_fd, b->data, b->len);
}

static void kv_str(struct ck_buf *b, const char *k, const char *v)
{
    ck_buf_char(b, '\t');
    ck_buf_str(b, k);
    ck_buf_char(b, '=');
    ck_buf_escaped(b, v);
}

static void kv_u64(struct ck_buf *b, const char *k, uint64_t v)
{
    ck_buf_char(b, '\t');
    ck_buf_str(b, k);
    ck_buf_char(b, '=');
    ck_buf_u64(b, v);
}

/* next line from the agent into `out`; 0 on success, -1 on EOF or error */
static int recv_line(char *out, size_t cap)
{
    for (;;) {
        for (size_t i = 0; i < rx_len; i++) {
            if (rx_buf[i] == '\n') {
                size_t n = i < cap - 1 ? i : cap - 1;
                ck_memcpy(out, rx_buf, n);
                out[n] = 0;
                rx_len -= i + 1;
                __builtin_memmove(rx_buf, rx_buf + i + 1, rx_len);
                ck_memset(rx_buf + rx_len, 0, i + 1);  /* no stale copy of a line (an encryption key) stays */
                return 0;
            }
        }
        if (rx_len == sizeof(rx_buf))
            rx_len = 0;  /* oversized line: drop it */
        long n = ck_read(ck_shim.agent_fd, rx_buf + rx_len, sizeof(rx_buf) - rx_len);
        if (n == -EINTR)
            continue;
        if (n <= 0)
            return -1;
        rx_len += (size_t)n;
    }
}

/* Held while a connection to the agent is being made, and by fork (the
 * atfork handlers): a child forked between socket() and agent_fd being set
 * would keep the parent's half-made connection as a descriptor of its own,
 * a Unix socket to a process outside the job that fails its checkpoint. */
static pthread_mutex_t connecting = PTHREAD_MUTEX_INITIALIZER;

static int connect_agent_locked(void);

static int connect_agent(void)
{
    /* A thread parked inside fork's handlers holds the mutex until it runs
     * again, and so does its copy in an image taken then: a restored
     * process, or one whose connection dropped while parked, would wait
     * for the RESUME that only this connection can bring.  Parked threads
     * do not fork, so then the connection is made without it. */
    if (pthread_mutex_trylock(&connecting) != 0) {
        if (ck_is_parked())
            return connect_agent_locked();
        pthread_mutex_lock(&connecting);
    }
    int rc = connect_agent_locked();
    pthread_mutex_unlock(&connecting);
    return rc;
}

static int connect_agent_locked(void)
{
    struct sockaddr_un sa;
    ck_memset(&sa, 0, sizeof(sa));
    sa.sun_family = AF_UNIX;
    ck_strlcpy(sa.sun_path, ck_shim.socket_path, sizeof(sa.sun_path));
    long fd = ck_socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd < 0)
        return -1;
    if (ck_connect((int)fd, &sa, sizeof(sa)) < 0) {
        ck_close((int)fd);
        return -1;
    }
    /* keep clear of the low descriptors programs like to dup2 onto */
    long high = ck_fcntl((int)fd, F_DUPFD_CLOEXEC, CK_HIGH_FD);
    if (high >= 0) {
        ck_close((int)fd);
        fd = high;
    }
    ck_shim.agent_fd = (int)fd;
    rx_len = 0;
    return 0;
}

static int send_hello(int restored)
{
    char exe[512], line[2048];
    struct ck_buf b;
    long n = ck_readlink("/proc/self/exe", exe, sizeof(exe) - 1);
    exe[n > 0 ? n : 0] = 0;
    ck_buf_init(&b, line, sizeof(line));
    ck_buf_str(&b, "HELLO");
    kv_u64(&b, "version", CK_PROTOCOL_VERSION);
    kv_str(&b, "job", ck_shim.job);
    kv_u64(&b, "pid", (uint64_t)ck_getpid());
    kv_u64(&b, "ppid", (uint64_t)ck_getppid());
    kv_str(&b, "exe", exe);
    kv_u64(&b, "restored", (uint64_t)restored);
    kv_str(&b, "checkpoint", restored ? ck_restart.checkpoint_id : "");
    if (restored && ck_shim.lazy_fd >= 0)
        kv_u64(&b, "lazy_uffd", (uint64_t)ck_shim.lazy_fd);
    return send_line(&b);
}

static void reply_error_retry(const char *msg, int retry)
{
    char line[CK_ERR_CAP + 64];
    struct ck_buf b;
    ck_buf_init(&b, line, sizeof(line));
    ck_buf_str(&b, "ERROR");
    if (retry)
        kv_u64(&b, "retry", 1);
    kv_str(&b, "msg", msg);
    send_line(&b);
}

static void reply_error(const char *msg)
{
    reply_error_retry(msg, 0);
}

static void reply_simple(const char *word)
{
    char line[64];
    struct ck_buf b;
    ck_buf_init(&b, line, sizeof(line));
    ck_buf_str(&b, word);
    send_line(&b);
}

static void drop_connection(void)
{
    if (ck_shim.agent_fd >= 0)
        ck_close(ck_shim.agent_fd);
    ck_shim.agent_fd = -1;
    /* never leave the job frozen without someone to resume it, unless
     * nobody has said yet that it may run at all */
    if (ck_is_parked() && !ck_shim.unverified)
        ck_release();
    ck_writeout_go();  /* no FLUSH will come: the image is written, as nobody waits for it */
    ck_term_decide(0);  /* a SIGTERM held for the agent is delivered: no one is left to decide */
}

/* Called on the restored checkpoint thread: finish what the restorer began. */
static void finish_restore(void)
{
    ck_wait_threads_arrived(ck_restart.nthreads);
    ck_term_restored();  /* a SIGTERM held in the image was the previous incarnation's */
    ck_track_restored(ck_restart.track_uffd);
    ck_shim.lazy_fd = ck_restart.lazy_uffd;
    ck_shim.lazy_pending = ck_shim.lazy_fd >= 0;
    if (ck_restart.hole_start && ck_restart.hole_len)
        ck_munmap((void *)ck_restart.hole_start, ck_restart.hole_len);
    ck_shim.agent_fd = -1;  /* the old connection did not survive */
    if (ck_restart.agent_socket[0])
        ck_strlcpy(ck_shim.socket_path, ck_restart.agent_socket, sizeof(ck_shim.socket_path));
    /* Stay parked until an agent says RESUME, however long that takes (the
     * command loop keeps trying as well): a process never releases itself */
    ck_shim.unverified = 1;
    for (int attempt = 0; attempt < 100; attempt++) {
        if (connect_agent() == 0 && send_hello(1) == 0)
            return;
        drop_connection();
        ck_nanosleep_ms(100);
    }
}

static void handle_dump(char *line)
{
    static char dirbuf[4096], base[256], image[CK_SOURCE_PATH + 2], depth[16], cached[4], sync[4], dedup[4];  /* too long an image name: detected, not cut */
    struct ck_dump_args a;
    a.dir = msg_copy(line, "dir", dirbuf, sizeof(dirbuf));
    a.base = msg_copy(line, "base", base, sizeof(base));
    a.self = msg_copy(line, "image", image, sizeof(image));
    a.depth = msg_copy(line, "depth", depth, sizeof(depth)) ? (uint32_t)ck_parse_u64(depth, 10, 0) : 0;
    a.keep_cached = msg_copy(line, "cached", cached, sizeof(cached)) && cached[0] == '1';
    a.no_writer = msg_copy(line, "sync", sync, sizeof(sync)) && sync[0] == '1';
    a.dedup = msg_copy(line, "dedup", dedup, sizeof(dedup)) && dedup[0] >= '1' && dedup[0] <= '2' ? dedup[0] - '0' : 0;
    a.key_hex = (char *)msg_get(line, "key");  /* last: msg_get cuts the line; ck_dump wipes it */
    const char *dir = a.dir;
    char err[CK_ERR_CAP];
    struct ck_dump_stats st;
    if ((!dir || !ck_is_parked()) && a.key_hex)
        ck_memset(a.key_hex, 0, ck_strlen(a.key_hex));
    if (!dir) {
        reply_error("DUMP without dir");
        return;
    }
    if (!ck_is_parked()) {
        reply_error("DUMP before QUIESCE");
        return;
    }
    int rc = ck_dump(&a, &st, err, sizeof(err));
    if (rc != CK_DUMP_RESTORED && a.key_hex) {
        ck_memset(a.key_hex, 0, ck_strlen(a.key_hex));  /* a dump that failed before it took the key */
        ck_seal_scrub_stack();  /* what the cipher left below this frame */
    }
    if (rc == CK_DUMP_RESTORED) {
        ck_flight_forget();  /* the restorer left the copies of descriptors in flight out */
        finish_restore();
        return;
    }
    if (rc != CK_DUMP_OK) {
        reply_error_retry(err, rc == CK_DUMP_RETRY);
        return;
    }
    char out[512];
    struct ck_buf b;
    ck_buf_init(&b, out, sizeof(out));
    ck_buf_str(&b, "DUMPED");
    kv_u64(&b, "pages_bytes", st.pages_bytes);
    kv_u64(&b, "core_bytes", st.core_bytes);
    kv_u64(&b, "files_bytes", st.files_bytes);
    kv_u64(&b, "ref_bytes", st.ref_bytes);
    kv_u64(&b, "vmas", st.nvmas);
    kv_u64(&b, "threads", st.nthreads);
    kv_u64(&b, "fds", st.nfds);
    kv_u64(&b, "files", st.nfiles);
    kv_u64(&b, "dump_ns", (uint64_t)st.duration_ns);
    kv_u64(&b, "capture", st.capture);
    kv_u64(&b, "sysv", (uint64_t)ck_sysv_objects());
    send_line(&b);
}

/* after every process of the job is parked, before any is dumped */
static void handle_settle(char *line)
{
    const char *ms = msg_get(line, "timeout_ms");
    if (!ck_is_parked()) {
        reply_error("SETTLE before QUIESCE");
        return;
    }
    int stuck = ck_tcp_settle(ms ? (int)ck_parse_u64(ms, 10, 0) : 500);
    char out[96];
    struct ck_buf b;
    ck_buf_init(&b, out, sizeof(out));
    ck_buf_str(&b, "SETTLED");
    kv_u64(&b, "stuck", stuck > 0 ? (uint64_t)stuck : 0);
    send_line(&b);
}

static void handle_quiesce(char *line)
{
    const char *t = msg_get(line, "timeout_ms");
    long timeout = t ? (long)ck_parse_u64(t, 10, 0) : 10000;
    char err[CK_ERR_CAP];
    if (ck_lazy_filling()) {  /* the agent that knew has restarted: the writer would see zeros */
        reply_error_retry("memory is still being filled after a lazy restart", 1);
        return;
    }
    ck_writeout_discard();  /* a writer nobody waited for belongs to a round long gone */
    if (ck_arena_setup() < 0) {
        reply_error("cannot reserve checkpoint scratch memory");
        return;
    }
    if (ck_quiesce(timeout, err, sizeof(err)) < 0) {
        reply_error(err);
        return;
    }
    uint32_t n;
    ck_parked_threads(&n);
    /* parked, it writes nothing more: a send queue with nothing unsent now
     * stays so (SETTLE would find nothing to wait for); unreadable: ask for it */
    int unsent = ck_tcp_settle(0);
    char out[128];
    struct ck_buf b;
    ck_buf_init(&b, out, sizeof(out));
    ck_buf_str(&b, "QUIESCED");
    kv_u64(&b, "threads", n + 1);
    kv_u64(&b, "unsent", unsent < 0 ? 1 : (uint64_t)unsent);
    send_line(&b);
}

static void handle_command(char *line);

static void command_loop(void)
{
    static char line[4096];
    for (;;) {
        if (ck_shim.agent_fd < 0) {
            /* agent gone (restarted?): keep trying, the job runs meanwhile */
            if (connect_agent() < 0 || send_hello(ck_shim.unverified) < 0) {
                drop_connection();
                ck_nanosleep_ms(1000);
                continue;
            }
        }
        if (recv_line(line, sizeof(line)) < 0) {
            drop_connection();
            continue;
        }
        __atomic_store_n(&ck_shim.busy, 1, __ATOMIC_RELEASE);
        handle_command(line);
        __atomic_store_n(&ck_shim.busy, 0, __ATOMIC_RELEASE);
    }
}

static void handle_command(char *line)
{
    if (ck_startswith(line, "QUIESCE")) {
        handle_quiesce(line);
    } else if (ck_startswith(line, "PREMAP")) {
        static char dir[4096];
        ck_image_dir_prepare(msg_copy(line, "dir", dir, sizeof(dir)));  /* the image's files, before the pause */
        if (ck_arena_setup() < 0 || ck_premaps_capture() < 0)
            reply_error("cannot read /proc/self/smaps");
        else
            reply_simple("PREMAPPED");
    } else if (ck_startswith(line, "SETTLE")) {
        handle_settle(line);
    } else if (ck_startswith(line, "DUMP")) {
        handle_dump(line);
    } else if (ck_startswith(line, "RESUME") || ck_startswith(line, "ABORT")) {
        ck_shim.unverified = 0;  /* the agent's word */
        if (ck_shim.lazy_fd >= 0) {
            /* the agent's pager holds it now; closing the last copy
             * is what ends the registration once it is done */
            ck_close(ck_shim.lazy_fd);
            ck_shim.lazy_fd = -1;
        }
        int parked = ck_is_parked();
        ck_image_dir_drop();  /* staged for a dump that did not come */
        ck_flight_close();  /* the agent has compared them with the job's descriptors (dump_sockets.c) */
        if (ck_startswith(line, "ABORT"))
            ck_writeout_discard();
        ck_arena_reset();
        /* the reply goes first: once released, the process may exit
         * at once (a restored child a moment from its end), and the
         * agent would read a closed connection as a failed RESUME */
        reply_simple("RESUMED");
        if (parked)
            ck_release();
    } else if (ck_startswith(line, "FLUSH")) {
        char err[CK_ERR_CAP];
        char *key = (char *)msg_get(line, "key");
        int rc = ck_writeout_flush(err, sizeof(err), key);
        if (key) {
            ck_memset(key, 0, ck_strlen(key));
            ck_seal_scrub_stack();
        }
        if (rc < 0)
            reply_error(err);
        else
            reply_simple(rc == 0 ? "FLUSHED\twritten=1" : "FLUSHED\twritten=0");
    } else if (ck_startswith(line, "DISCARD")) {
        ck_writeout_discard();
        reply_simple("DISCARDED");
    } else if (ck_startswith(line, "REBASE") || ck_startswith(line, "ADOPT")) {
        /* an image's core.img to take the page runs of (track.c): the last
         * one, rewritten (REBASE); the one a restored process came from (ADOPT) */
        static char core[4096], image[CK_SOURCE_PATH];
        int adopt = ck_startswith(line, "ADOPT");
        const char *c = msg_copy(line, "core", core, sizeof(core));
        const char *i = msg_copy(line, "image", image, sizeof(image));
        if (c && i && (adopt ? ck_track_adopt(c, i) : ck_track_rebase(c, i)) == 0)
            reply_simple(adopt ? "ADOPTED" : "REBASED");
        else
            reply_error(adopt ? "cannot track the pages of the image this process was restored from"
                              : "cannot take the rewritten image's page runs");
    } else if (ck_startswith(line, "LAZY_DONE")) {
        __atomic_store_n(&ck_shim.lazy_pending, 0, __ATOMIC_RELEASE);
        ck_futex_wake_all(&ck_shim.lazy_pending);
        reply_simple("LAZY_DONE");
    } else if (ck_startswith(line, "TERM_HOLD") || ck_startswith(line, "TERM_DELIVER")) {
        ck_term_decide(ck_startswith(line, "TERM_HOLD"));
        reply_simple("TERM_OK");
    } else if (ck_startswith(line, "PING")) {
        reply_simple("PONG");
    } else {
        reply_error("unknown command");
    }
}

static void *checkpoint_thread(void *arg)
{
    (void)arg;
    ck_prctl(PR_SET_NAME, (unsigned long)"ckptd", 0, 0, 0);
    command_loop();
    return 0;
}

static void start_checkpoint_thread(void)
{
    pthread_t th;
    pthread_attr_t attr;
    /* the checkpoint thread inherits a mask blocking every signal except
     * glibc's internal SIGCANCEL and SIGSETXID (setuid() in a threaded
     * program waits for every thread to take SIGSETXID) */
    uint64_t all = ~0ull & ~((1ull << 31) | (1ull << 32)), old = 0;
    ck_sigprocmask(SIG_SETMASK, &all, &old);
    pthread_attr_init(&attr);
    pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
    pthread_attr_setstacksize(&attr, 256 * 1024);
    if (pthread_create(&th, &attr, checkpoint_thread, 0) != 0)
        ck_shim.active = 0;
    pthread_attr_destroy(&attr);
    ck_sigprocmask(SIG_SETMASK, &old, 0);
}

/* A child forked before a lazy restore's fill is done would not have the
 * registration, and its unfilled pages would read as zeros: wait. */
static void before_fork(void)
{
    while (ck_lazy_filling())
        ck_futex_wait(&ck_shim.lazy_pending, 1, 200);  /* LAZY_DONE wakes it; else lazy.c looks again */
    pthread_mutex_lock(&connecting);
}

static void after_fork_parent(void)
{
    pthread_mutex_unlock(&connecting);
}

static void after_fork_child(void)
{
    pthread_mutex_init(&connecting, 0);  /* held by the parent's forking thread, not this one */
    ck_quiesce_after_fork();
    ck_sigev_after_fork();
    ck_sem_undo_after_fork();  /* fork does not pass SEM_UNDO adjustments on */
    ck_writeout_after_fork();
    ck_image_dir_after_fork();
    /* the child shares the parent's socket: leave it to the parent */
    if (ck_shim.agent_fd >= 0)
        ck_close(ck_shim.agent_fd);
    ck_shim.agent_fd = -1;
    if (ck_shim.active)
        start_checkpoint_thread();
}

__attribute__((constructor)) static void ck_shim_init(void)
{
    const char *sock = getenv("CKPTD_SHIM_SOCKET");
    const char *job = getenv("CKPTD_JOB");
    const char *sig = getenv("CKPTD_QUIESCE_SIGNAL");
    ck_interpose_init();
    if (!sock || !*sock || !job)
        return;  /* preloaded outside a ckptd job: stay inert */
    ck_strlcpy(ck_shim.socket_path, sock, sizeof(ck_shim.socket_path));
    ck_strlcpy(ck_shim.job, job, sizeof(ck_shim.job));
    ck_shim.quiesce_signal = sig && *sig ? (int)ck_parse_u64(sig, 10, 0) : SIGRTMAX - 1;
    if (ck_quiesce_install(ck_shim.quiesce_signal) < 0)
        return;
    ck_shim.active = 1;
    ck_sem_undo_init();
    const char *uring = getenv("CKPTD_ALLOW_IO_URING");
    ck_shim.hide_io_uring = !(uring && uring[0] == '1');
    const char *track = getenv("CKPTD_TRACK");
    ck_shim.track_mode = !track || !*track || !ck_strcmp(track, "auto") ? CK_TRACK_AUTO
                         : !ck_strcmp(track, "uffd")                    ? CK_TRACK_UFFD
                         : !ck_strcmp(track, "hash")                    ? CK_TRACK_HASH
                                                                        : CK_TRACK_OFF;
    const char *capture = getenv("CKPTD_CAPTURE");
    ck_shim.capture_sync = capture && !ck_strcmp(capture, "sync");
    ck_shim.fault = getenv("CKPTD_FAULT");
    ck_checksum_load();  /* while the process is one thread: dlopen is safe */
    pthread_atfork(before_fork, after_fork_parent, after_fork_child);
    if (connect_agent() < 0 || send_hello(0) < 0)
        drop_connection();  /* the checkpoint thread keeps retrying */
    start_checkpoint_thread();
    ck_term_install();  /* after HELLO: a SIGTERM's TERM follows it on the connection */
}
