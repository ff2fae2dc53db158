/*
 * Blocking calls resumed after a checkpoint: no EINTR, no short sleeps.
 *
 * A checkpoint parks every thread in the quiesce signal's handler
 * (quiesce.c, SA_RESTART).  The kernel restarts most interrupted calls
 * itself, but not those signal(7) lists as never restarted after a
 * handler ran: poll, ppoll, select, pselect, epoll_wait/pwait/pwait2,
 * nanosleep, clock_nanosleep, sigtimedwait, sigwaitinfo, sigsuspend,
 * pause, futex waits with a timeout, and socket calls under SO_RCVTIMEO or
 * SO_SNDTIMEO.  They return EINTR (sleeps: early), after a checkpoint and
 * after a restart too (a restored thread resumes in the handler's frame,
 * so its interrupted call returns then).  A program that does not retry
 * would fail.
 *
 * So the shim interposes those libc entry points (LD_PRELOAD; the real ones
 * come from dlsym(RTLD_NEXT), found in the constructor).  Per thread, in
 * initial-exec TLS (a fixed offset from %fs: async-signal-safe, and part of
 * the thread's memory, so saved and restored with it), it keeps:
 *   quiesces   bumped by the quiesce handler each time it returns;
 *   parked_ns  total CLOCK_MONOTONIC time spent parked (the handler adds
 *              unpark - park, both read with raw clock_gettime);
 *   user_sigs  bumped each time one of the program's own handlers runs
 *              (sigaction installs user_signal() in front of it).
 * A wrapper notes quiesces and user_sigs, calls the real function, and only
 * if that failed with EINTR (a sleep: returned early) does it look again:
 * if quiesces moved and user_sigs did not, the interruption was ckptd's
 * alone and the call is made again.  Fast path: one TLS read and the real
 * call; calls with a finite timeout also read the clock first.
 *
 * The time left is the timeout minus the time the call really ran:
 * elapsed = (now - start) - (parked_ns now - parked_ns at start), so the
 * pause does not count against the job's timeouts.  ckptd restores no time
 * namespace: CLOCK_MONOTONIC jumps on a restart on another boot, but the
 * jump is inside one park (unpark on the new clock - park on the old), so
 * it cancels out.  Absolute sleeps (TIMER_ABSTIME, FUTEX_WAIT_BITSET) keep
 * their deadline.  select() gets its timeval updated as Linux does;
 * pselect, ppoll, epoll_pwait2 and sigtimedwait leave the caller's timeout
 * alone; sleep() and usleep() are glibc's, on this nanosleep (glibc's call
 * its clock_nanosleep internally, past any interposition).  Socket calls
 * under SO_RCVTIMEO/SO_SNDTIMEO (recv*, send*, accept*, read, write) start
 * the full socket timeout again: a checkpoint can make them wait longer,
 * never fail.  Of raw syscall(), only futex waits are resumed (interpose.c
 * routes them here); calls the kernel restarts itself (read without a
 * timeout, wait/waitpid, futex without a timeout) need nothing.
 *
 * A program's own signal interrupting the call returns EINTR as without
 * ckptd, even in the same instant as the quiesce signal: user_sigs moved.
 * Handlers installed past the interposed sigaction (a raw rt_sigaction,
 * glibc-internal callers such as sigset/bsd_signal, or before the shim's
 * constructor ran) are not counted: such
 * a signal arriving during the very pause is then swallowed (the call goes
 * on instead of returning EINTR).  The masks that pselect, ppoll,
 * epoll_pwait(2) and sigsuspend install, and the sets sigtimedwait and
 * sigwaitinfo wait for, never include the quiesce signal (as interpose.c
 * does for sigprocmask).
 */
#include "shim.h"
#include "../common/sys.h"
#include "../common/util.h"

#include <dlfcn.h>
#include <errno.h>
#include <stdarg.h>
#include <poll.h>
#include <sys/epoll.h>
#include <sys/select.h>
#include <sys/msg.h>
#include <sys/sem.h>
#include <sys/socket.h>
#include <threads.h>
#include <unistd.h>

#define CK_EXPORT __attribute__((visibility("default")))

extern void __chk_fail(void) __attribute__((noreturn));

struct ck_eintr_tls {
    volatile uint64_t quiesces;
    volatile uint64_t user_sigs;
    volatile int64_t parked_ns;
};
static __thread struct ck_eintr_tls T __attribute__((tls_model("initial-exec")));

void ck_eintr_quiesced(int64_t parked_at)
{
    if (parked_at > 0) {
        int64_t now = ck_now_ns(CLOCK_MONOTONIC);
        if (now > 0)
            T.parked_ns += now - parked_at;
    }
    __atomic_signal_fence(__ATOMIC_SEQ_CST);
    T.quiesces++;
}

/* ---- the program's own signal handlers, counted ---- */

typedef void (*ck_sig3)(int, siginfo_t *, void *);
typedef void (*ck_sig1)(int);
static ck_sig3 volatile user_handler[_NSIG];
static volatile unsigned char user_siginfo[_NSIG];

static void user_signal(int sig, siginfo_t *si, void *uc)
{
    T.user_sigs++;
    __atomic_signal_fence(__ATOMIC_SEQ_CST);
    ck_sig3 h = user_handler[sig];
    if (user_siginfo[sig])
        h(sig, si, uc);
    else
        ((ck_sig1)(void *)h)(sig);
}

static int counted(int sig, const struct sigaction *act)
{
    void *h = act->sa_flags & SA_SIGINFO ? (void *)act->sa_sigaction : (void *)act->sa_handler;
    return ck_shim.active && sig > 0 && sig < _NSIG && h != (void *)SIG_DFL && h != (void *)SIG_IGN &&
           h != (void *)user_signal;
}

int ck_eintr_sigaction(int sig, const struct sigaction *act, struct sigaction *old, ck_sigaction_fn real)
{
    if (sig <= 0 || sig >= _NSIG)
        return real(sig, act, old);
    ck_sig3 prev = user_handler[sig];
    unsigned char prev_info = user_siginfo[sig];
    struct sigaction copy;
    int swapped = act && counted(sig, act);
    if (swapped) {
        copy = *act;
        user_siginfo[sig] = (act->sa_flags & SA_SIGINFO) != 0;
        user_handler[sig] = act->sa_flags & SA_SIGINFO ? act->sa_sigaction : (ck_sig3)(void *)act->sa_handler;
        copy.sa_sigaction = user_signal;
        copy.sa_flags |= SA_SIGINFO;
        act = &copy;
    }
    int rc = real(sig, act, old);
    if (rc < 0 && swapped) {
        user_handler[sig] = prev;
        user_siginfo[sig] = prev_info;
    }
    if (rc == 0 && old && old->sa_sigaction == user_signal) {
        old->sa_sigaction = prev;
        if (!prev_info)
            old->sa_flags &= ~SA_SIGINFO;
    }
    return rc;
}

/* ---- the real functions ---- */

#define REAL_DECL(fn) static __typeof__(&fn) real_##fn
#define REAL(fn) ((__typeof__(real_##fn))resolve((void **)&real_##fn, #fn))

/* found once in the constructor (ck_eintr_init); here for calls before it */
static void *resolve(void **slot, const char *name)
{
    void *p = __atomic_load_n(slot, __ATOMIC_RELAXED);
    if (!p) {
        p = dlsym(RTLD_NEXT, name);
        __atomic_store_n(slot, p, __ATOMIC_RELAXED);
    }
    return p;
}
#define REAL_INIT(fn) (void)REAL(fn)

REAL_DECL(poll);
REAL_DECL(ppoll);
REAL_DECL(select);
REAL_DECL(pselect);
REAL_DECL(epoll_wait);
REAL_DECL(epoll_pwait);
REAL_DECL(epoll_pwait2);
REAL_DECL(nanosleep);
REAL_DECL(clock_nanosleep);
REAL_DECL(sigtimedwait);
REAL_DECL(sigwaitinfo);
REAL_DECL(sigsuspend);
REAL_DECL(pause);
REAL_DECL(recv);
REAL_DECL(recvfrom);
REAL_DECL(recvmsg);
REAL_DECL(send);
REAL_DECL(sendto);
REAL_DECL(sendmsg);
REAL_DECL(accept);
REAL_DECL(accept4);
REAL_DECL(read);
REAL_DECL(write);
REAL_DECL(semop);
REAL_DECL(semtimedop);
REAL_DECL(semctl);
REAL_DECL(msgrcv);
REAL_DECL(msgsnd);

void ck_eintr_init(void)
{
    REAL_INIT(poll);
    REAL_INIT(ppoll);
    REAL_INIT(select);
    REAL_INIT(pselect);
    REAL_INIT(epoll_wait);
    REAL_INIT(epoll_pwait);
    REAL_INIT(epoll_pwait2);
    REAL_INIT(nanosleep);
    REAL_INIT(clock_nanosleep);
    REAL_INIT(sigtimedwait);
    REAL_INIT(sigwaitinfo);
    REAL_INIT(sigsuspend);
    REAL_INIT(pause);
    REAL_INIT(recv);
    REAL_INIT(recvfrom);
    REAL_INIT(recvmsg);
    REAL_INIT(send);
    REAL_INIT(sendto);
    REAL_INIT(sendmsg);
    REAL_INIT(accept);
    REAL_INIT(accept4);
    REAL_INIT(read);
    REAL_INIT(write);
    REAL_INIT(semop);
    REAL_INIT(semtimedop);
    REAL_INIT(semctl);
    REAL_INIT(msgrcv);
    REAL_INIT(msgsnd);
}

/* ---- one call, maybe interrupted by checkpoints ---- */

struct span {
    uint64_t q, u;  /* quiesces and user_sigs before the call */
    int64_t p0, t0; /* parked_ns and CLOCK_MONOTONIC at the start */
};

static inline void span_start(struct span *s)
{
    s->q = T.quiesces;
    s->u = T.user_sigs;
}

/* the raw call, not the vdso's: a program may have unmapped its [vdso] */
static int64_t mono_ns(void)
{
    struct timespec ts;
    ck_clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

/* a call with a finite timeout: parked_ns before the clock, so that a park
 * in between makes the time left longer, never shorter */
static inline void span_start_timed(struct span *s)
{
    span_start(s);
    s->p0 = T.parked_ns;
    __atomic_signal_fence(__ATOMIC_SEQ_CST);
    s->t0 = mono_ns();
}

/* timed: the call has a finite timeout, whose time left span_left tells */
static inline void span_begin(struct span *s, int timed)
{
    if (timed)
        span_start_timed(s);
    else
        span_start(s);
}

/* 1: the call was interrupted by checkpoints alone: make it again */
static int span_again(struct span *s, int interrupted)
{
    if (!interrupted)
        return 0;
    uint64_t q = T.quiesces;
    if (q == s->q || T.user_sigs != s->u)
        return 0;
    s->q = q;
    return 1;
}

/* of a timeout of total_ns from the start, what is left (>= 0) */
static int64_t span_left(const struct span *s, int64_t total_ns)
{
    int64_t now = mono_ns();
    __atomic_signal_fence(__ATOMIC_SEQ_CST);
    int64_t elapsed = (now - s->t0) - (T.parked_ns - s->p0);
    if (elapsed < 0)
        elapsed = 0;
    return elapsed >= total_ns ? 0 : total_ns - elapsed;
}

static int64_t ts_ns(const struct timespec *ts) { return (int64_t)ts->tv_sec * 1000000000LL + ts->tv_nsec; }
static struct timespec ns_ts(int64_t ns) { return (struct timespec){ns / 1000000000LL, ns % 1000000000LL}; }
static int ms_ceil(int64_t ns) { return (int)((ns + 999999) / 1000000); }
static int eintr(long rc) { return rc < 0 && errno == EINTR; }

/* a mask the call installs, without the quiesce signal */
static const sigset_t *open_quiesce(const sigset_t *m, sigset_t *copy)
{
    if (!m || !ck_shim.active || !sigismember(m, ck_shim.quiesce_signal))
        return m;
    *copy = *m;
    sigdelset(copy, ck_shim.quiesce_signal);
    return copy;
}

/* ---- poll, select, epoll ---- */

CK_EXPORT int poll(struct pollfd *fds, nfds_t n, int timeout)
{
    struct span s;
    span_begin(&s, timeout > 0);
    int t = timeout, rc;
    while (span_again(&s, eintr(rc = REAL(poll)(fds, n, t))))
        if (timeout > 0)
            t = ms_ceil(span_left(&s, (int64_t)timeout * 1000000LL));
    return rc;
}

CK_EXPORT int __poll_chk(struct pollfd *fds, nfds_t n, int timeout, size_t fdslen)
{
    if (fdslen / sizeof(*fds) < n)
        __chk_fail();
    return poll(fds, n, timeout);
}

CK_EXPORT int ppoll(struct pollfd *fds, nfds_t n, const struct timespec *timeout, const sigset_t *mask)
{
    struct span s;
    sigset_t m;
    mask = open_quiesce(mask, &m);
    span_begin(&s, timeout != NULL);
    struct timespec left, *t = timeout ? (left = *timeout, &left) : 0;
    int rc;
    while (span_again(&s, eintr(rc = REAL(ppoll)(fds, n, t, mask))))
        if (timeout)
            left = ns_ts(span_left(&s, ts_ns(timeout)));
    return rc;
}

CK_EXPORT int __ppoll_chk(struct pollfd *fds, nfds_t n, const struct timespec *timeout, const sigset_t *mask,
                          size_t fdslen)
{
    if (fdslen / sizeof(*fds) < n)
        __chk_fail();
    return ppoll(fds, n, timeout, mask);
}

/* Linux leaves the time not slept in *tv: so does this, over all tries */
/* select's sets are in-out: a retry needs the ones asked for */
struct fd_sets {
    fd_set r, w, e;
    size_t bytes;
};

static void sets_save(struct fd_sets *k, int n, const fd_set *r, const fd_set *w, const fd_set *e)
{
    k->bytes = n > 0 ? ((size_t)n + 7) / 8 : 0;
    if (k->bytes > sizeof(fd_set))
        k->bytes = sizeof(fd_set);
    if (r)
        __builtin_memcpy(&k->r, r, k->bytes);
    if (w)
        __builtin_memcpy(&k->w, w, k->bytes);
    if (e)
        __builtin_memcpy(&k->e, e, k->bytes);
}

static void sets_restore(const struct fd_sets *k, fd_set *r, fd_set *w, fd_set *e)
{
    if (r)
        __builtin_memcpy(r, &k->r, k->bytes);
    if (w)
        __builtin_memcpy(w, &k->w, k->bytes);
    if (e)
        __builtin_memcpy(e, &k->e, k->bytes);
}

CK_EXPORT int select(int n, fd_set *r, fd_set *w, fd_set *e, struct timeval *tv)
{
    struct span s;
    span_begin(&s, tv != NULL);
    int64_t total = tv ? (int64_t)tv->tv_sec * 1000000000LL + (int64_t)tv->tv_usec * 1000 : 0;
    struct fd_sets asked;
    sets_save(&asked, n, r, w, e);
    int rc;
    while (span_again(&s, eintr(rc = REAL(select)(n, r, w, e, tv)))) {
        sets_restore(&asked, r, w, e);
        if (tv) {
            int64_t left = span_left(&s, total);
            tv->tv_sec = left / 1000000000LL;
            tv->tv_usec = (left % 1000000000LL + 999) / 1000;
        }
    }
    return rc;
}

CK_EXPORT int pselect(int n, fd_set *r, fd_set *w, fd_set *e, const struct timespec *timeout, const sigset_t *mask)
{
    struct span s;
    sigset_t m;
    mask = open_quiesce(mask, &m);
    span_begin(&s, timeout != NULL);
    struct timespec left, *t = timeout ? (left = *timeout, &left) : 0;
    struct fd_sets asked;
    sets_save(&asked, n, r, w, e);
    int rc;
    while (span_again(&s, eintr(rc = REAL(pselect)(n, r, w, e, t, mask)))) {
        sets_restore(&asked, r, w, e);
        if (timeout)
            left = ns_ts(span_left(&s, ts_ns(timeout)));
    }
    return rc;
}

CK_EXPORT int epoll_wait(int ep, struct epoll_event *ev, int max, int timeout)
{
    struct span s;
    span_begin(&s, timeout > 0);
    int t = timeout, rc;
    while (span_again(&s, eintr(rc = REAL(epoll_wait)(ep, ev, max, t))))
        if (timeout > 0)
            t = ms_ceil(span_left(&s, (int64_t)timeout * 1000000LL));
    return rc;
}

CK_EXPORT int epoll_pwait(int ep, struct epoll_event *ev, int max, int timeout, const sigset_t *mask)
{
    struct span s;
    sigset_t m;
    mask = open_quiesce(mask, &m);
    span_begin(&s, timeout > 0);
    int t = timeout, rc;
    while (span_again(&s, eintr(rc = REAL(epoll_pwait)(ep, ev, max, t, mask))))
        if (timeout > 0)
            t = ms_ceil(span_left(&s, (int64_t)timeout * 1000000LL));
    return rc;
}

CK_EXPORT int epoll_pwait2(int ep, struct epoll_event *ev, int max, const struct timespec *timeout,
                           const sigset_t *mask)
{
    struct span s;
    sigset_t m;
    mask = open_quiesce(mask, &m);
    span_begin(&s, timeout != NULL);
    struct timespec left, *t = timeout ? (left = *timeout, &left) : 0;
    int rc;
    while (span_again(&s, eintr(rc = REAL(epoll_pwait2)(ep, ev, max, t, mask))))
        if (timeout)
            left = ns_ts(span_left(&s, ts_ns(timeout)));
    return rc;
}

/* ---- sleeps ---- */

static int is_cpu_clock(clockid_t c) { return c < 0 || c == CLOCK_PROCESS_CPUTIME_ID || c == CLOCK_THREAD_CPUTIME_ID; }

/* clock_nanosleep's contract: 0 or an error number, errno untouched */
static int sleep_on(clockid_t clk, int flags, const struct timespec *req, struct timespec *rem, int is_nanosleep)
{
    struct span s;
    int relative = !(flags & TIMER_ABSTIME);
    span_begin(&s, relative);
    const struct timespec want = *req; /* sleep() passes req as rem too */
    struct timespec left = want, mine;
    const struct timespec *t = &want;
    struct timespec *r = rem ? rem : &mine;
    for (;;) {
        int rc = is_nanosleep ? (REAL(nanosleep)(t, r) < 0 ? errno : 0) : REAL(clock_nanosleep)(clk, flags, t, r);
        if (!span_again(&s, rc == EINTR))
            return rc;
        if (relative) {
            /* CPU-time clocks do not advance while parked: the kernel's own
             * remainder is right for them */
            left = is_cpu_clock(clk) ? *r : ns_ts(span_left(&s, ts_ns(&want)));
            t = &left;
        }
    }
}

CK_EXPORT int nanosleep(const struct timespec *req, struct timespec *rem)
{
    int saved = errno;
    int rc = sleep_on(CLOCK_MONOTONIC, 0, req, rem, 1);
    errno = rc ? rc : saved;
    return rc ? -1 : 0;
}

CK_EXPORT int clock_nanosleep(clockid_t clk, int flags, const struct timespec *req, struct timespec *rem)
{
    return sleep_on(clk, flags, req, rem, 0);
}

/* glibc's own, on the nanosleep above */
CK_EXPORT unsigned int sleep(unsigned int seconds)
{
    int saved = errno;
    struct timespec ts = {(time_t)seconds, 0};
    if (nanosleep(&ts, &ts) < 0)
        return (unsigned int)ts.tv_sec;
    errno = saved;
    return 0;
}

CK_EXPORT int usleep(useconds_t us)
{
    struct timespec ts = {(time_t)(us / 1000000), (long)(us % 1000000) * 1000};
    return nanosleep(&ts, 0);
}

CK_EXPORT int thrd_sleep(const struct timespec *req, struct timespec *rem)
{
    int rc = clock_nanosleep(CLOCK_REALTIME, 0, req, rem);
    return rc == 0 ? 0 : rc == EINTR ? -1 : -2;
}

/* ---- signals ---- */

static const sigset_t *wait_set(const sigset_t *set, sigset_t *copy)
{
    return open_quiesce(set, copy);
}

CK_EXPORT int sigtimedwait(const sigset_t *set, siginfo_t *info, const struct timespec *timeout)
{
    struct span s;
    sigset_t m;
    set = wait_set(set, &m);
    span_begin(&s, timeout != NULL);
    struct timespec left, *t = timeout ? (left = *timeout, &left) : 0;
    int rc;
    while (span_again(&s, eintr(rc = REAL(sigtimedwait)(set, info, t))))
        if (timeout)
            left = ns_ts(span_left(&s, ts_ns(timeout)));
    return rc;
}

CK_EXPORT int sigwaitinfo(const sigset_t *set, siginfo_t *info)
{
    struct span s;
    sigset_t m;
    set = wait_set(set, &m);
    span_start(&s);
    int rc;
    while (span_again(&s, eintr(rc = REAL(sigwaitinfo)(set, info))))
        ;
    return rc;
}

/* returns when one of the program's own handlers ran, as without ckptd */
CK_EXPORT int sigsuspend(const sigset_t *mask)
{
    struct span s;
    sigset_t m;
    mask = open_quiesce(mask, &m);
    span_start(&s);
    int rc;
    while (span_again(&s, eintr(rc = REAL(sigsuspend)(mask))))
        ;
    return rc;
}

CK_EXPORT int pause(void)
{
    struct span s;
    span_start(&s);
    int rc;
    while (span_again(&s, eintr(rc = REAL(pause)())))
        ;
    return rc;
}

/* ---- futex waits through syscall() (interpose.c); raw result ---- */

long ck_eintr_futex(long uaddr, long op, long val, long timeout, long a4, long a5)
{
    int cmd = (int)op & FUTEX_CMD_MASK;
    if (!timeout || (cmd != FUTEX_WAIT && cmd != FUTEX_WAIT_BITSET))
        return ck_sc6(SYS_futex, uaddr, op, val, timeout, a4, a5);
    /* FUTEX_WAIT's timeout is relative; FUTEX_WAIT_BITSET's a deadline */
    struct span s;
    int relative = cmd == FUTEX_WAIT;
    span_begin(&s, relative);
    const struct timespec *req = (const struct timespec *)timeout;
    struct timespec left = *req;
    long t = relative ? (long)&left : timeout, rc;
    while (span_again(&s, (rc = ck_sc6(SYS_futex, uaddr, op, val, t, a4, a5)) == -EINTR))
        if (relative)
            left = ns_ts(span_left(&s, ts_ns(req)));
    return rc;
}

/* ---- socket calls under SO_RCVTIMEO / SO_SNDTIMEO: the full timeout again ---- */

#define RETRY(type, call)                      \
    do {                                       \
        struct span s;                         \
        span_start(&s);                        \
        type rc;                               \
        while (span_again(&s, eintr(rc = call))) \
            ;                                  \
        return rc;                             \
    } while (0)

/* ---- System V IPC: semop, semtimedop, msgrcv, msgsnd are never restarted ---- */

/* SEM_UNDO: the kernel keeps an adjustment per process (semadj) that no
 * interface reads, so the shim keeps its own copy (as DMTCP does): each
 * semop with SEM_UNDO that succeeds subtracts its sem_op, a SETVAL, SETALL
 * or IPC_RMID of this process clears it, and dump.c saves what is not zero
 * (ck_sem_undo in the image).  A SETVAL in ANOTHER process clears ours in
 * the kernel without our knowing: each adjustment keeps the CLOCK_MONOTONIC
 * time it became non-zero (taken before the semop) and each process the
 * time of its last clear of a set (taken after the semctl); the agent
 * refuses a checkpoint where a clear came after another process's
 * adjustment began (agent/sysv_ipc.py).  Fixed tables: no malloc in a
 * signal handler; a full table of adjustments marks the process, refused
 * at checkpoint.
 * A forked child starts without adjustments (shim.c calls
 * ck_sem_undo_after_fork).  An exec keeps the kernel's adjustments but not
 * these tables: the job's environment holds CKPTD_SEM_UNDO=0 (agent/
 * runtime.py), whose digit the shim sets in place to 1 while the process
 * has adjustments, so a program exec'd with that environment starts marked
 * and is refused at checkpoint (a vfork child's exec inherits the parent's
 * mark: refused too, though it has none). */
#define UNDO_MAX 256
#define CLEAR_MAX 64
static struct ck_sem_undo undo[UNDO_MAX];  /* kind CK_SEM_UNDO_ADJ, adj 0: a free slot */
static struct ck_sem_undo clears[CLEAR_MAX];  /* kind CK_SEM_UNDO_CLEAR; kind 0: a free slot */
static volatile int undo_lock;
volatile int ck_sem_undo_used;  /* 1: a table was full (an adjustment not known) */
static int undo_before_exec;    /* CKPTD_SEM_UNDO was 1 at start: adjustments from before an exec */
static char *undo_mark;         /* the digit of CKPTD_SEM_UNDO in the environment, or 0 */

void ck_sem_undo_init(void)
{
    extern char **environ;
    static const char name[] = "CKPTD_SEM_UNDO=";
    for (char **e = environ; e && *e; e++)
        if (!ck_strncmp(*e, name, sizeof(name) - 1) && (*e)[sizeof(name) - 1] && !(*e)[sizeof(name)]) {
            undo_mark = *e + sizeof(name) - 1;
            undo_before_exec = *undo_mark == '1';
        }
}

/* with the lock held: the mark says whether an exec now would lose adjustments */
static void undo_marked(void)
{
    int any = ck_sem_undo_used || undo_before_exec;
    for (int k = 0; k < UNDO_MAX && !any; k++)
        any = undo[k].adj != 0;
    if (undo_mark)
        *undo_mark = any ? '1' : '0';
}

/* every signal blocked while the tables change: neither a handler's semop
 * nor a checkpoint (whose quiesce signal parks threads where they are, and
 * whose dump takes the lock) can find the lock held by its own thread or
 * by a parked one */
static void undo_take(uint64_t *old)
{
    uint64_t all = ~0ull;
    ck_sigprocmask(SIG_BLOCK, &all, old);
    while (__atomic_exchange_n(&undo_lock, 1, __ATOMIC_ACQUIRE))
        ;
}
static void undo_give(const uint64_t *old)
{
    __atomic_store_n(&undo_lock, 0, __ATOMIC_RELEASE);
    ck_sigprocmask(SIG_SETMASK, old, 0);
}

void ck_sem_undo_after_fork(void)
{
    __builtin_memset(undo, 0, sizeof(undo));
    __builtin_memset(clears, 0, sizeof(clears));
    undo_lock = 0;
    ck_sem_undo_used = 0;
    undo_before_exec = 0;
    if (undo_mark)
        *undo_mark = '0';
}

static void note_undo(int id, const struct sembuf *ops, size_t n, int rc, int64_t before)
{
    size_t undoing = 0;
    for (size_t i = 0; rc == 0 && i < n; i++)
        undoing += (ops[i].sem_flg & SEM_UNDO) && ops[i].sem_op;
    if (!undoing)
        return;  /* no lock, no signal mask: the common semop costs nothing more */
    uint64_t mask;
    undo_take(&mask);
    for (size_t i = 0; i < n; i++) {
        if (!(ops[i].sem_flg & SEM_UNDO) || !ops[i].sem_op)
            continue;
        struct ck_sem_undo *u = 0, *free_slot = 0;
        for (int k = 0; k < UNDO_MAX && !u; k++)
            if (undo[k].adj && undo[k].semid == id && undo[k].semnum == ops[i].sem_num)
                u = &undo[k];
            else if (!undo[k].adj && !free_slot)
                free_slot = &undo[k];
        if (!u) {
            if (!free_slot) {
                ck_sem_undo_used = 1;
                continue;
            }
            u = free_slot;
            u->kind = CK_SEM_UNDO_ADJ;
            u->semid = id;
            u->semnum = ops[i].sem_num;
            u->ns = before;
        }
        u->adj -= ops[i].sem_op;  /* 0 again: the slot is free */
    }
    undo_marked();
    undo_give(&mask);
}

/* semctl's SETVAL (semnum) or SETALL (semnum -1) cleared the set's
 * adjustments in every process, IPC_RMID removed them with the set */
static void note_clear(int id, int semnum)
{
    int64_t now = ck_now_ns(CLOCK_MONOTONIC);
    uint64_t mask;
    undo_take(&mask);
    for (int k = 0; k < UNDO_MAX; k++)
        if (undo[k].adj && undo[k].semid == id && (semnum < 0 || undo[k].semnum == semnum))
            undo[k].adj = 0;
    /* clears[0]: the latest of the clears evicted from a full table, for
     * any set (semid -1), so that many sets cost a refusal only where one
     * of them could hide a clear from another process */
    struct ck_sem_undo *c = 0, *slot = 0;
    for (int k = 1; k < CLEAR_MAX && !c; k++)
        if (clears[k].kind && clears[k].semid == id)
            c = &clears[k];
        else if (!slot || (slot->kind && (!clears[k].kind || clears[k].ns < slot->ns)))
            slot = &clears[k];  /* a free slot, else the oldest */
    if (!c) {
        c = slot;
        if (c->kind && c->ns > clears[0].ns) {
            clears[0] = *c;
            clears[0].semid = -1;
        }
    }
    c->kind = CK_SEM_UNDO_CLEAR;
    c->semid = id;
    c->semnum = -1;
    c->ns = now;
    undo_marked();
    undo_give(&mask);
}

CK_EXPORT int semop(int id, struct sembuf *ops, size_t n)
{
    struct span s;
    span_start(&s);
    int64_t before = ck_now_ns(CLOCK_MONOTONIC);
    int rc;
    while (span_again(&s, eintr(rc = REAL(semop)(id, ops, n))))
        ;
    note_undo(id, ops, n, rc, before);
    return rc;
}

CK_EXPORT int semtimedop(int id, struct sembuf *ops, size_t n, const struct timespec *timeout)
{
    struct span s;
    span_begin(&s, timeout != NULL);
    struct timespec left, *t = timeout ? (left = *timeout, &left) : 0;
    int64_t before = ck_now_ns(CLOCK_MONOTONIC);
    int rc;
    while (span_again(&s, eintr(rc = REAL(semtimedop)(id, ops, n, t))))
        if (timeout)
            left = ns_ts(span_left(&s, ts_ns(timeout)));
    note_undo(id, ops, n, rc, before);
    return rc;
}

/* the fourth argument is a union semun (an int or a pointer), passed on as a word */
CK_EXPORT int semctl(int id, int semnum, int cmd, ...)
{
    va_list ap;
    va_start(ap, cmd);
    unsigned long arg = va_arg(ap, unsigned long);
    va_end(ap);
    int rc = REAL(semctl)(id, semnum, cmd, arg);
    if (rc >= 0 && (cmd == SETVAL || cmd == SETALL || cmd == IPC_RMID))
        note_clear(id, cmd == SETVAL ? semnum : -1);
    return rc;
}

/* this process's adjustments and clears, for its image (dump.c) */
int ck_dump_sem_undo(struct ck_image *im)
{
    if (undo_before_exec)
        return ck_image_fail(im, "the process exec'd while it held System V semaphore undo adjustments (SEM_UNDO, "
                                 "or its parent did, before a vfork): ckptd's record of them does not survive an exec",
                             0, 0);
    if (ck_sem_undo_used)
        return ck_image_fail(im, "the process changed more than 256 System V semaphores with SEM_UNDO: "
                                 "ckptd cannot track that many undo adjustments", 0, 0);
    struct ck_sem_undo list[UNDO_MAX + CLEAR_MAX];
    uint32_t n = 0;
    uint64_t mask;
    undo_take(&mask);
    for (int k = 0; k < UNDO_MAX; k++)
        if (undo[k].adj)
            list[n++] = undo[k];
    for (int k = 0; k < CLEAR_MAX; k++)
        if (clears[k].kind)
            list[n++] = clears[k];
    undo_give(&mask);
    im->proc.nsemundo = n;
    if (n) {
        im->proc.semundo_off = ck_table_bytes_append(&im->blob, list, (size_t)n * sizeof(list[0]));
        if (im->proc.semundo_off == UINT64_MAX)
            return ck_image_fail(im, "too much data to checkpoint", 0, 0);
    }
    return 0;
}

CK_EXPORT ssize_t msgrcv(int id, void *msg, size_t n, long type, int flags)
{
    RETRY(ssize_t, REAL(msgrcv)(id, msg, n, type, flags));
}

CK_EXPORT int msgsnd(int id, const void *msg, size_t n, int flags) { RETRY(int, REAL(msgsnd)(id, msg, n, flags)); }

CK_EXPORT ssize_t recv(int fd, void *buf, size_t n, int flags) { RETRY(ssize_t, REAL(recv)(fd, buf, n, flags)); }
CK_EXPORT ssize_t recvfrom(int fd, void *restrict buf, size_t n, int flags, __SOCKADDR_ARG addr,
                           socklen_t *restrict len)
{
    RETRY(ssize_t, REAL(recvfrom)(fd, buf, n, flags, addr, len));
}
CK_EXPORT ssize_t recvmsg(int fd, struct msghdr *msg, int flags) { RETRY(ssize_t, REAL(recvmsg)(fd, msg, flags)); }
CK_EXPORT ssize_t send(int fd, const void *buf, size_t n, int flags) { RETRY(ssize_t, REAL(send)(fd, buf, n, flags)); }
CK_EXPORT ssize_t sendto(int fd, const void *buf, size_t n, int flags, __CONST_SOCKADDR_ARG addr, socklen_t len)
{
    RETRY(ssize_t, REAL(sendto)(fd, buf, n, flags, addr, len));
}
CK_EXPORT ssize_t sendmsg(int fd, const struct msghdr *msg, int flags) { RETRY(ssize_t, REAL(sendmsg)(fd, msg, flags)); }
CK_EXPORT int accept(int fd, __SOCKADDR_ARG addr, socklen_t *restrict len) { RETRY(int, REAL(accept)(fd, addr, len)); }
CK_EXPORT int accept4(int fd, __SOCKADDR_ARG addr, socklen_t *restrict len, int flags)
{
    RETRY(int, REAL(accept4)(fd, addr, len, flags));
}
CK_EXPORT ssize_t read(int fd, void *buf, size_t n) { RETRY(ssize_t, REAL(read)(fd, buf, n)); }
CK_EXPORT ssize_t write(int fd, const void *buf, size_t n) { RETRY(ssize_t, REAL(write)(fd, buf, n)); }

/* _FORTIFY_SOURCE variants: glibc's call the inner function directly */
CK_EXPORT ssize_t __read_chk(int fd, void *buf, size_t n, size_t buflen)
{
    if (n > buflen)
        __chk_fail();
    return read(fd, buf, n);
}
CK_EXPORT ssize_t __recv_chk(int fd, void *buf, size_t n, size_t buflen, int flags)
{
    if (n > buflen)
        __chk_fail();
    return recv(fd, buf, n, flags);
}
CK_EXPORT ssize_t __recvfrom_chk(int fd, void *restrict buf, size_t n, size_t buflen, int flags, __SOCKADDR_ARG addr,
                                 socklen_t *restrict len)
{
    if (n > buflen)
        __chk_fail();
    return recvfrom(fd, buf, n, flags, addr, len);
}
