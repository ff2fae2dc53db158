/*
 * One process dump, run on the checkpoint thread while every other thread
 * is parked: process-wide state, descriptors, written files, memory, then
 * core.img.  The checkpoint thread's own resume point is saved first; the
 * restored process continues from there with ck_dump() returning
 * CK_DUMP_RESTORED.
 */
#include "shim.h"
#include "../common/sys.h"
#include "../common/util.h"
#include "../common/maps.h"

#include <errno.h>
#include <sys/prctl.h>
#include <linux/securebits.h>

/* a few MiB of /proc text at most: stat, status, auxv */
static char procbuf[65536];

uint32_t ck_image_string(struct ck_image *im, const char *s)
{
    if (!s || !*s)
        return 0;
    uint64_t off = ck_table_bytes_append(&im->strings, s, ck_strlen(s) + 1);
    return off == UINT64_MAX ? 0 : (uint32_t)off;
}

int ck_image_fail(struct ck_image *im, const char *what, const char *detail, long rc)
{
    struct ck_buf b;
    ck_buf_init(&b, im->err, im->errcap);
    ck_buf_error(&b, what, detail, rc);
    im->retry = 0;  /* the failure reported is the last one: its kind decides */
    return -1;
}

int ck_image_passing(struct ck_image *im, int rc)
{
    im->retry = 1;
    return rc;
}

int ck_image_is_own_fd(struct ck_image *im, int fd)
{
    for (int i = 0; i < im->n_own_fds; i++)
        if (im->own_fds[i] == fd)
            return 1;
    return 0;
}

void ck_image_add_own_fd(struct ck_image *im, int fd)
{
    if (fd >= 0 && im->n_own_fds < (int)(sizeof(im->own_fds) / sizeof(im->own_fds[0])))
        im->own_fds[im->n_own_fds++] = fd;
}

/*
 * Saving the files the job writes opens and closes them, and a close drops
 * every POSIX lock (F_SETLK) the process holds on that file (fcntl(2)).  A
 * process holding such locks saves them from a thread with a copy of its
 * descriptor table (no CLONE_FILES): that thread's closes are not its own.
 */
struct files_job {
    struct ck_image *im;
    uint64_t *bytes;
    int rc;
    uint32_t done;
};

static void files_thread(void *arg)
{
    struct files_job *j = arg;
    j->rc = ck_dump_files(j->im, j->bytes);
    __atomic_store_n(&j->done, 1, __ATOMIC_RELEASE);
    ck_futex_wake_all(&j->done);
}

static int holds_posix_locks(struct ck_image *im)
{
    for (size_t i = 0; i < im->fds.count; i++) {
        const struct ck_fd *f = ck_table_at(&im->fds, i);
        for (uint32_t k = 0; k < f->nlocks; k++) {
            struct ck_file_lock l;
            ck_memcpy(&l, (const char *)ck_table_at(&im->blob, 0) + f->locks_off + k * sizeof(l), sizeof(l));
            if (l.kind == CK_LOCK_POSIX)
                return 1;
        }
    }
    return 0;
}

static int dump_files_keeping_locks(struct ck_image *im, uint64_t *bytes)
{
    if (!holds_posix_locks(im))
        return ck_dump_files(im, bytes);
    size_t size = 1 << 20;
    char *stack = ck_mmap(0, size, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (ck_mmap_failed(stack))
        return ck_image_fail(im, "out of memory for a thread that saves files", 0, (long)stack);
    struct files_job j = {im, bytes, 0, 0};
    long tid = ck_writer_thread(stack + size, files_thread, &j, CK_THREAD_FLAGS & ~(unsigned long)CK_FILES_OWN);
    if (tid < 0) {
        ck_munmap(stack, size);
        return ck_image_fail(im, "cannot start a thread that saves files", 0, tid);
    }
    while (!__atomic_load_n(&j.done, __ATOMIC_ACQUIRE))
        ck_futex_wait(&j.done, 0, -1);
    while (ck_tgkill((int)ck_getpid(), (int)tid, 0) == 0)  /* off its stack: gone */
        ck_sched_yield();
    ck_munmap(stack, size);
    return j.rc;
}

/* the n-th space-separated field after the ")" that ends comm in /proc/self/stat */
static const char *stat_field(const char *after_comm, int n)
{
    const char *p = after_comm;
    for (int i = 0; i < n && *p; i++) {
        p = ck_skip_spaces(p);
        while (*p && *p != ' ')
            p++;
    }
    return ck_skip_spaces(p);
}

/* the text after "key" on its line of a /proc status file, or "" */
static const char *status_line(const char *text, const char *key)
{
    size_t kl = ck_strlen(key);
    for (const char *p = text; *p;) {
        if (ck_strncmp(p, key, kl) == 0)
            return p + kl;
        while (*p && *p != '\n')
            p++;
        if (*p)
            p++;
    }
    return "";
}

static uint64_t status_hex(const char *text, const char *key)
{
    return ck_parse_u64(ck_skip_spaces(status_line(text, key)), 16, 0);
}

static uint64_t status_oct(const char *text, const char *key)
{
    uint64_t v = 0;
    for (const char *p = ck_skip_spaces(status_line(text, key)); *p >= '0' && *p <= '7'; p++)
        v = v * 8 + (uint64_t)(*p - '0');
    return v;
}

/* /proc/self/task/TID/status into buf, NUL-terminated; -1 if unreadable */
static int read_task_status(int tid, char *buf, size_t cap)
{
    char path[64];
    struct ck_buf b;
    ck_buf_init(&b, path, sizeof(path));
    ck_buf_str(&b, "/proc/self/task/");
    ck_buf_u64(&b, (uint64_t)tid);
    ck_buf_str(&b, "/status");
    long len = ck_read_file(path, buf, cap - 1);
    if (len <= 0)
        return -1;
    buf[len] = 0;
    return 0;
}

static uint64_t read_xcr0(void)
{
    uint32_t eax, ebx, ecx, edx;
    __asm__ volatile("cpuid" : "=a"(eax), "=b"(ebx), "=c"(ecx), "=d"(edx) : "a"(1), "c"(0));
    if (!(ecx & (1u << 27)))  /* OSXSAVE */
        return 0;
    uint32_t lo, hi;
    __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
    return ((uint64_t)hi << 32) | lo;
}

#define CK_MEMBARRIER_QUERY 0
#define CK_MEMBARRIER_REGISTER_ALL (4 | 16 | 64 | 256)  /* the MEMBARRIER_CMD_REGISTER_* commands */
#define CK_MEMBARRIER_GET_REGISTRATIONS 512

/* membarrier registrations live in the mm and die with it: read them to
 * issue them again at restore.  A kernel before 6.3 cannot say which
 * there are, so a checkpoint there would lose them without a word. */
static int dump_membarrier(struct ck_image *im)
{
    long reg = ck_sc3(SYS_membarrier, CK_MEMBARRIER_GET_REGISTRATIONS, 0, 0);
    if (reg >= 0) {
        im->proc.membarrier = (uint64_t)reg & CK_MEMBARRIER_REGISTER_ALL;
        return 0;
    }
    long cmds = ck_sc3(SYS_membarrier, CK_MEMBARRIER_QUERY, 0, 0);
    if (cmds < 0 || !(cmds & CK_MEMBARRIER_REGISTER_ALL))
        return 0;  /* no membarrier, or nothing to register for: nothing to lose */
    return ck_image_fail(im, "this kernel cannot report membarrier() registrations "
                             "(MEMBARRIER_CMD_GET_REGISTRATIONS needs Linux 6.3): checkpoint on a newer kernel", 0, reg);
}

static int dump_proc(struct ck_image *im)
{
    struct ck_proc *p = &im->proc;
    char path[4096];
    struct stat st;
    long n;

    p->pid = (int32_t)ck_getpid();
    p->ppid = (int32_t)ck_getppid();
    p->pgid = (int32_t)ck_getpgid(0);
    p->sid = (int32_t)ck_getsid(0);
    p->quiesce_signal = (uint32_t)ck_shim.quiesce_signal;
    p->personality = (uint32_t)ck_personality(0xffffffff);
    p->restart_info = (uint64_t)&ck_restart;
    p->xcr0 = read_xcr0();
    p->ckpt_realtime_ns = ck_now_ns(CLOCK_REALTIME);
    p->ckpt_monotonic_ns = ck_now_ns(CLOCK_MONOTONIC);
    ck_prctl(PR_GET_NAME, (unsigned long)p->comm, 0, 0, 0);
    if (dump_membarrier(im) < 0)
        return -1;

    n = ck_readlink("/proc/self/exe", path, sizeof(path) - 1);
    if (n < 0)
        return ck_image_fail(im, "cannot read /proc/self/exe", 0, n);
    path[n] = 0;
    if (ck_endswith(path, " (deleted)"))
        return ck_image_fail(im, "the program's executable was deleted", path, 0);
    p->exe = ck_image_string(im, path);
    if (ck_stat(path, &st) == 0) {
        p->exe_dev = st.st_dev;
        p->exe_ino = st.st_ino;
    }
    n = ck_readlink("/proc/self/cwd", path, sizeof(path) - 1);
    if (n < 0)
        return ck_image_fail(im, "cannot read /proc/self/cwd", 0, n);
    path[n] = 0;
    if (ck_endswith(path, " (deleted)")) {
        /* removed, so empty: the restorer makes an empty one, enters it
         * and removes it again (proc.c) */
        if (ck_stat(".", &st) < 0)
            return ck_image_fail(im, "cannot stat the working directory", path, 0);
        path[n - 10] = 0;
        p->cwd_deleted = 1;
        p->cwd_mode = st.st_mode;
        p->cwd_uid = st.st_uid;
        p->cwd_gid = st.st_gid;
    }
    p->cwd = ck_image_string(im, path);

    /* mm fields: start_code, end_code, start_stack are fields 26-28 of
     * /proc/self/stat; start_data..env_end are 45-51 (1-based) */
    n = ck_read_file("/proc/self/stat", procbuf, sizeof(procbuf) - 1);
    if (n < 0)
        return ck_image_fail(im, "cannot read /proc/self/stat", 0, n);
    procbuf[n] = 0;
    const char *rp = procbuf, *q;
    for (q = procbuf; *q; q++)
        if (*q == ')')
            rp = q + 1;
    /* after ")" field 3 (state) is index 0 */
    p->start_code = ck_parse_u64(stat_field(rp, 26 - 3), 10, 0);
    p->end_code = ck_parse_u64(stat_field(rp, 27 - 3), 10, 0);
    p->start_stack = ck_parse_u64(stat_field(rp, 28 - 3), 10, 0);
    p->start_data = ck_parse_u64(stat_field(rp, 45 - 3), 10, 0);
    p->end_data = ck_parse_u64(stat_field(rp, 46 - 3), 10, 0);
    p->start_brk = ck_parse_u64(stat_field(rp, 47 - 3), 10, 0);
    p->arg_start = ck_parse_u64(stat_field(rp, 48 - 3), 10, 0);
    p->arg_end = ck_parse_u64(stat_field(rp, 49 - 3), 10, 0);
    p->env_start = ck_parse_u64(stat_field(rp, 50 - 3), 10, 0);
    p->env_end = ck_parse_u64(stat_field(rp, 51 - 3), 10, 0);
    p->brk = (uint64_t)ck_brk(0);
    /* tty_nr, tpgid: fields 7 and 8 */
    if (ck_dump_ctty(im, p, ck_parse_u64(stat_field(rp, 7 - 3), 10, 0),
                     ck_parse_i64(stat_field(rp, 8 - 3), 0)) < 0)
        return -1;

    n = ck_read_file("/proc/self/status", procbuf, sizeof(procbuf) - 1);
    if (n < 0)
        return ck_image_fail(im, "cannot read /proc/self/status", 0, n);
    procbuf[n] = 0;
    p->umask = (uint32_t)status_oct(procbuf, "Umask:");
    if (ck_strncmp(ck_skip_spaces(status_line(procbuf, "x86_Thread_features:")), "shstk", 5) == 0)
        return ck_image_fail(im, "x86 shadow stacks are enabled; not supported", 0, 0);
    if (ck_dump_sem_undo(im) < 0)  /* eintr.c: the adjustments of semop with SEM_UNDO */
        return -1;

    n = ck_read_file("/proc/self/auxv", im->auxv, sizeof(im->auxv));
    if (n < 0)
        return ck_image_fail(im, "cannot read /proc/self/auxv", 0, n);
    im->auxv_len = (size_t)n;
    return 0;
}

static int64_t read_proc_int(const char *path, int64_t missing)
{
    char buf[32];
    long n = ck_read_file(path, buf, sizeof(buf) - 1);
    if (n <= 0)
        return missing;
    buf[n] = 0;
    return ck_parse_i64(buf, 0);
}

/*
 * Process-wide attributes the restorer sets again (proc.c), and the ones it
 * cannot, refused here while the job runs on: a seccomp filter, securebits
 * other than keep-caps, threads with different supplementary groups, an
 * rseq registration the shim cannot identify, dumpable mode 2.
 */
static int dump_attrs(struct ck_image *im)
{
    struct ck_proc *p = &im->proc;
    char status[4096], self_groups[1024];
    int v = 0;

    p->oom_score_adj = (int32_t)read_proc_int("/proc/self/oom_score_adj", 0);
    p->loginuid = (uint32_t)read_proc_int("/proc/self/loginuid", 0xffffffff);
    ck_prctl(PR_GET_CHILD_SUBREAPER, (unsigned long)&v, 0, 0, 0);
    p->child_subreaper = v != 0;
    long thp = ck_prctl(PR_GET_THP_DISABLE, 0, 0, 0, 0);
    p->thp_disable = thp > 0 ? (uint32_t)thp : 0;

    uint32_t *groups = ck_arena_alloc(65536 * sizeof(uint32_t));
    long ng = groups ? ck_getgroups(65536, groups) : -ENOMEM;
    if (ng < 0)
        return ck_image_fail(im, "cannot read the supplementary groups", 0, ng);
    p->ngroups = (uint32_t)ng;
    p->groups_off = ck_table_bytes_append(&im->blob, groups, (size_t)ng * sizeof(uint32_t));
    if (ng && p->groups_off == UINT64_MAX)
        return ck_image_fail(im, "too much data to checkpoint", 0, 0);

    long n = ck_read_file("/proc/thread-self/status", status, sizeof(status) - 1);
    if (n < 0)
        return ck_image_fail(im, "cannot read /proc/thread-self/status", 0, n);
    status[n] = 0;
    ck_strlcpy(self_groups, status_line(status, "Groups:"), sizeof(self_groups));
    for (char *q = self_groups; *q; q++)
        if (*q == '\n')
            *q = 0;
    for (size_t i = 0; i < im->threads.count; i++) {
        struct ck_thread *t = ck_table_at(&im->threads, i);
        if (t->flags & CK_THREAD_RSEQ_UNKNOWN)
            return ck_image_fail(im, "a thread has an rseq registration the shim did not see made (not through glibc or syscall()); ckptd cannot restore it", 0, 0);
        if (t->securebits & ~(uint32_t)SECBIT_KEEP_CAPS)
            return ck_image_fail(im, "a thread has securebits set other than keep-caps (PR_SET_SECUREBITS); ckptd cannot restore them", 0, 0);
        if (read_task_status(t->tid, status, sizeof(status)) < 0)
            continue;
        if (ck_parse_u64(ck_skip_spaces(status_line(status, "Seccomp:")), 10, 0) != 0)
            return ck_image_fail(im, "the process runs under seccomp (strict mode or a filter); ckptd cannot restore seccomp filters", 0, 0);
        const char *g = status_line(status, "Groups:");
        size_t gl = ck_strlen(self_groups);
        if (ck_strncmp(g, self_groups, gl) != 0 || (g[gl] != '\n' && g[gl] != 0))
            return ck_image_fail(im, "the process's threads have different supplementary groups (raw setgroups); ckptd restores one list per process", 0, 0);
    }
    return 0;
}

/* signals in `set` pending on thread tid that were not taken with their
 * siginfo (they arrived after it parked): raised again bare, as before */
static int add_pending(struct ck_image *im, int tid, uint64_t set)
{
    for (int s = 1; s <= 64; s++) {
        if (!(set & (1ull << (s - 1))) || s == ck_shim.quiesce_signal || (s == SIGTERM && ck_term_hidden()))
            continue;  /* a SIGTERM held for the agent is this incarnation's (sigterm.c) */
        int taken = 0;
        for (size_t i = 0; i < im->pending.count && !taken; i++) {
            struct ck_pending *pe = ck_table_at(&im->pending, i);
            taken = pe->tid == tid && pe->signo == s;
        }
        if (taken)
            continue;
        struct ck_pending *pe = ck_table_push(&im->pending);
        if (!pe)
            return ck_image_fail(im, "too many pending signals", 0, 0);
        ck_memset(pe, 0, sizeof(*pe));
        pe->tid = tid;
        pe->signo = s;
    }
    return 0;
}

/*
 * Interval timers, POSIX timers and pending signals, read together as the last thing
 * before core.img is written, so they describe the same instant.  A
 * periodic ITIMER_REAL whose SIGALRM is pending reads as it_value 0: the
 * kernel re-arms it only when the signal is dequeued (the restorer knows).
 */
static int capture_timers_and_pending(struct ck_image *im)
{
    char status[4096];
    for (int i = 0; i < 3; i++) {
        struct itimerval v;
        if (ck_getitimer(i, &v) == 0) {
            im->proc.itimers[i].interval_sec = v.it_interval.tv_sec;
            im->proc.itimers[i].interval_usec = v.it_interval.tv_usec;
            im->proc.itimers[i].value_sec = v.it_value.tv_sec;
            im->proc.itimers[i].value_usec = v.it_value.tv_usec;
        }
    }
    /* every queue, now: the parked threads their own, the main thread the
     * process-wide one too, the checkpoint thread its own (quiesce.c) */
    if (ck_take_all_pending() < 0)
        return ck_image_fail(im, "a parked thread did not take its pending signals within 10 s", 0, 0);
    uint32_t ntaken, failed;
    const int64_t *fired_at;
    struct ck_pending *taken = ck_taken_pending(&ntaken, &failed, &fired_at);
    if (failed == 1)
        return ck_image_fail(im, "more than 4096 signals are queued in the process; ckptd keeps at most 4096", 0, 0);
    if (failed)
        return ck_image_fail(im, "a pending signal could not be queued again after reading it", 0, 0);
    /* POSIX timers, with the overrun of their signals taken brought up to now */
    if (ck_dump_timers(im, taken, fired_at, ntaken) < 0)
        return -1;
    for (uint32_t i = 0; i < ntaken; i++) {
        struct ck_pending *pe = ck_table_push(&im->pending);
        if (!pe)
            return ck_image_fail(im, "too many pending signals", 0, 0);
        ck_memcpy(pe, &taken[i], sizeof(*pe));
    }
    long n = ck_read_file("/proc/self/status", procbuf, sizeof(procbuf) - 1);
    if (n < 0)
        return ck_image_fail(im, "cannot read /proc/self/status", 0, n);
    procbuf[n] = 0;
    if (add_pending(im, 0, status_hex(procbuf, "ShdPnd:")) < 0)
        return -1;
    for (size_t i = 0; i < im->threads.count; i++) {
        struct ck_thread *t = ck_table_at(&im->threads, i);
        if (read_task_status(t->tid, status, sizeof(status)) < 0)
            continue;
        if (add_pending(im, t->tid, status_hex(status, "SigPnd:")) < 0)
            return -1;
    }
    return 0;
}

static int dump_threads(struct ck_image *im, struct ck_thread *self)
{
    uint32_t n;
    struct ck_thread *parked = ck_parked_threads(&n);
    int have_main = self->flags & CK_THREAD_MAIN;

    for (uint32_t i = 0; i <= n; i++) {
        struct ck_thread *src = i < n ? &parked[i] : self;
        struct ck_thread *t = ck_table_push(&im->threads);
        if (!t)
            return ck_image_fail(im, "too many threads", 0, 0);
        ck_memcpy(t, src, sizeof(*t));
        if (t->flags & CK_THREAD_MAIN)
            have_main = 1;
    }
    if (!have_main)
        return ck_image_fail(im, "the main thread has exited; a process without its main thread cannot be restored", 0, 0);
    im->proc.nthreads = (uint32_t)im->threads.count;
    return 0;
}

static int write_core(struct ck_image *im, uint64_t pages_bytes, uint64_t *core_bytes)
{
    static struct ck_header h;
    struct ck_sigaction sigacts[64];
    struct ck_rlimit rlimits[16];
    struct {
        uint32_t type;
        const void *data;
        uint64_t size;
        uint32_t count;
    } secs[CK_MAX_SECTIONS];
    int ns = 0;

    for (int s = 1; s <= 64; s++) {
        struct ck_kernel_sigaction old;
        ck_memset(&old, 0, sizeof(old));
        ck_rt_sigaction(s, 0, &old);
        if (s == SIGTERM)
            ck_term_image_action(&old);  /* the program's SIG_DFL, not the shim's hidden handler */
        sigacts[s - 1].handler = old.handler;
        sigacts[s - 1].flags = old.flags;
        sigacts[s - 1].restorer = old.restorer;
        sigacts[s - 1].mask = old.mask;
    }
    for (int r = 0; r < 16; r++) {
        struct rlimit rl;
        if (ck_prlimit(r, 0, &rl) == 0) {
            rlimits[r].cur = rl.rlim_cur;
            rlimits[r].max = rl.rlim_max;
        } else {
            rlimits[r].cur = rlimits[r].max = RLIM_INFINITY;
        }
    }

#define ADD_SEC(t, d, sz, cnt) \
    do { secs[ns].type = (t); secs[ns].data = (d); secs[ns].size = (sz); secs[ns].count = (uint32_t)(cnt); ns++; } while (0)
#define ADD_TABLE(t, tab) ADD_SEC((t), (tab).base, (tab).count * (tab).elem, (tab).count)
    ADD_SEC(CK_SEC_PROC, &im->proc, sizeof(im->proc), 1);
    ADD_TABLE(CK_SEC_THREADS, im->threads);
    ADD_TABLE(CK_SEC_VMAS, im->vmas);
    ADD_TABLE(CK_SEC_RUNS, im->runs);
    ADD_TABLE(CK_SEC_FDS, im->fds);
    ADD_TABLE(CK_SEC_EPOLL, im->epoll);
    ADD_SEC(CK_SEC_SIGACTS, sigacts, sizeof(sigacts), 64);
    ADD_SEC(CK_SEC_RLIMITS, rlimits, sizeof(rlimits), 16);
    ADD_TABLE(CK_SEC_PENDING, im->pending);
    ADD_TABLE(CK_SEC_FILES, im->files);
    ADD_SEC(CK_SEC_AUXV, im->auxv, im->auxv_len, im->auxv_len);
    ADD_TABLE(CK_SEC_STRINGS, im->strings);
    ADD_TABLE(CK_SEC_BLOB, im->blob);
    ADD_TABLE(CK_SEC_SOURCES, im->sources);
#undef ADD_TABLE
#undef ADD_SEC

    ck_memset(&h, 0, sizeof(h));
    h.magic = CK_CORE_MAGIC;
    h.version = CK_CORE_VERSION;
    h.nsections = (uint32_t)ns;
    h.pages_size = pages_bytes;
    uint64_t off = sizeof(h);
    for (int i = 0; i < ns; i++) {
        h.sections[i].type = secs[i].type;
        h.sections[i].count = secs[i].count;
        h.sections[i].offset = off;
        h.sections[i].size = secs[i].size;
        off += (secs[i].size + 7) & ~7ull;
    }
    h.file_size = off;

    long fd = im->core_fd;  /* made before the pause (image_dir.c), or now */
    im->core_fd = -1;
    if (fd < 0)
        fd = ck_openat(im->dirfd, "core.img", O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
    if (fd < 0)
        return ck_image_fail(im, "cannot create core.img", 0, fd);
    /* one write: the header, then each section padded to 8 bytes */
    static const char zeros[8];
    struct ck_iov iov[1 + 2 * CK_MAX_SECTIONS];
    int n = 0;
    iov[n++] = (struct ck_iov){&h, sizeof(h)};
    for (int i = 0; i < ns; i++) {
        size_t pad = ((secs[i].size + 7) & ~7ull) - secs[i].size;
        if (secs[i].size)
            iov[n++] = (struct ck_iov){secs[i].data, secs[i].size};
        if (pad)
            iov[n++] = (struct ck_iov){zeros, pad};
    }
    int rc = ck_pwritev_all((int)fd, iov, n, 0);
    ck_close((int)fd);
    if (rc < 0)
        return ck_image_fail(im, "cannot write core.img", 0, rc);
    *core_bytes = off;
    return 0;
}

static void close_image_fds(struct ck_image *im)
{
    int *fds[] = {&im->dirfd, &im->core_fd, &im->pages_fd};
    for (size_t i = 0; i < sizeof(fds) / sizeof(fds[0]); i++)
        if (*fds[i] >= 0) {
            ck_close(*fds[i]);
            *fds[i] = -1;
        }
}

static int image_init(struct ck_image *im)
{
    ck_memset(&im->proc, 0, sizeof(im->proc));
    im->auxv_len = 0;
    if (ck_table_init(&im->threads, sizeof(struct ck_thread), CK_MAX_THREADS + 1) ||
        ck_table_init(&im->vmas, sizeof(struct ck_vma), 1 << 18) ||
        ck_table_init(&im->runs, sizeof(struct ck_page_run), 1 << 22) ||
        ck_table_init(&im->fds, sizeof(struct ck_fd), 1 << 16) ||
        ck_table_init(&im->epoll, sizeof(struct ck_epoll_target), 1 << 16) ||
        ck_table_init(&im->pending, sizeof(struct ck_pending), 4096) ||
        ck_table_init(&im->files, sizeof(struct ck_file), 1 << 14) ||
        ck_table_init(&im->strings, 1, 64u << 20) ||
        ck_table_init(&im->blob, 1, 64u << 20) ||
        ck_table_init(&im->sources, sizeof(struct ck_page_source), CK_MAX_SOURCES))
        return -1;
    ck_table_bytes_append(&im->strings, "", 1);  /* offset 0 = empty string */
    return 0;
}

int ck_dump(const struct ck_dump_args *a, struct ck_dump_stats *st, char *err, size_t errcap)
{
    /* static: this frame's locals do not survive the restore */
    static struct ck_image im;
    static struct ck_thread self;
    uint64_t mask = 0;

    ck_sigprocmask(SIG_BLOCK, 0, &mask);
    ck_fill_thread(&self, mask);
    self.flags |= CK_THREAD_CHECKPOINTER;
    if (ck_save_ctx(&self.ctx) != 0)
        return CK_DUMP_RESTORED;

    int64_t t0 = ck_now_ns(CLOCK_MONOTONIC);
    ck_memset(st, 0, sizeof(*st));
    ck_arena_reset();
    im.err = err;
    im.errcap = errcap;
    im.n_own_fds = 0;
    im.retry = 0;
    im.diag_fd = -1;
    im.core_fd = -1;
    im.pages_fd = -1;
    ck_image_add_own_fd(&im, ck_shim.agent_fd);
    /* made at PREMAP, before the pause (image_dir.c), or now */
    int staged = ck_image_dir_take(a->dir, &im) == 0;
    if (image_init(&im) < 0) {
        ck_image_fail(&im, "cannot allocate checkpoint scratch memory", 0, 0);
        close_image_fds(&im);
        return CK_DUMP_ERROR;
    }
    if (!staged)
        im.dirfd = (int)ck_open(a->dir, O_RDONLY | O_DIRECTORY | O_CLOEXEC, 0);
    if (im.dirfd < 0) {
        ck_image_fail(&im, "cannot open the image directory", a->dir, im.dirfd);
        return CK_DUMP_ERROR;
    }
    ck_image_add_own_fd(&im, im.dirfd);
    ck_image_add_own_fd(&im, im.core_fd);
    ck_image_add_own_fd(&im, im.pages_fd);
    /* A process that changed its ids is not dumpable: its /proc files are
     * root's, and it could not read its own auxv, pagemap or mem.  It is
     * parked: dumpable for the dump, as it was afterwards (and restored so). */
    long dumpable = ck_prctl(PR_GET_DUMPABLE, 0, 0, 0, 0);
    if (dumpable != 0 && dumpable != 1) {
        ck_image_fail(&im, "the process is dumpable only by root (suid_dumpable mode 2), which ckptd cannot set again", 0, 0);
        close_image_fds(&im);
        return CK_DUMP_ERROR;
    }
    im.proc.dumpable = (uint32_t)dumpable;
    if (!dumpable)
        ck_prctl(PR_SET_DUMPABLE, 1, 0, 0, 0);

    int bad_key;
    im.key = ck_seal_take_key(a->key_hex, &bad_key);  /* launch --encrypt (writeout.c) */
    if (im.key)
        ck_seal_scrub_stack();  /* the key schedule's traces on this stack, which the image holds */
    if (bad_key || ck_seal_begin(&im) < 0) {
        if (bad_key)
            ck_image_fail(&im, "cannot encrypt: the key is malformed or this CPU lacks AES-NI/PCLMULQDQ", 0, 0);
        if (!dumpable)
            ck_prctl(PR_SET_DUMPABLE, 0, 0, 0, 0);
        close_image_fds(&im);
        return CK_DUMP_ERROR;
    }
    ck_track_begin(&im, a->base, a->self);

    int rc = dump_proc(&im);
    im.proc.job_depth = a->depth;
    im.keep_cached = a->keep_cached;
    im.dedup = a->dedup;
    im.no_writer = a->no_writer;
    if (rc == 0)
        rc = dump_threads(&im, &self);
    if (rc == 0)
        rc = dump_attrs(&im);
    if (rc == 0)
        rc = ck_dump_fds(&im);
    if (rc == 0)
        rc = dump_files_keeping_locks(&im, &st->files_bytes);
    if (rc == 0)
        rc = ck_dump_memory(&im, &st->pages_bytes, &st->files_bytes, &st->ref_bytes);
    if (rc == 0)
        rc = capture_timers_and_pending(&im);
    if (rc == 0)
        rc = write_core(&im, st->pages_bytes, &st->core_bytes);
    if (rc == 0) {
        ck_track_commit(&im, st->pages_bytes);
        /* last: the writer forked here sees the memory core.img describes */
        rc = ck_writeout_start(&im, a->dir);
    }
    if (!dumpable)
        ck_prctl(PR_SET_DUMPABLE, 0, 0, 0, 0);
    ck_seal_end();
    close_image_fds(&im);  /* the writer holds its own copies */
    if (rc != 0)
        return im.retry ? CK_DUMP_RETRY : CK_DUMP_ERROR;
    st->nvmas = (uint32_t)im.vmas.count;
    st->nthreads = (uint32_t)im.threads.count;
    st->nfds = (uint32_t)im.fds.count;
    st->nfiles = (uint32_t)im.files.count;
    st->capture = (uint32_t)ck_writeout_mode();
    st->duration_ns = ck_now_ns(CLOCK_MONOTONIC) - t0;
    return CK_DUMP_OK;
}
