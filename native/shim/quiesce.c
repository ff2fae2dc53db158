/*
 * Parking every thread but the checkpoint thread.
 *
 * The checkpoint thread sends the quiesce signal to each thread with tgkill.
 * The handler records the thread's kernel-side state (TLS base, clear-tid
 * word, robust list, rseq area, capabilities), saves a resume point with
 * ck_save_ctx and sleeps on a futex until released.  The interrupted user
 * context sits in the kernel's signal frame on the thread's own stack, so
 * it is dumped with the rest of memory; a restored thread jumps back to the
 * saved resume point, waits for the release like the original did, and
 * returns from the handler: rt_sigreturn then restores its registers, FPU
 * and AVX state, signal mask and alternate stack exactly.
 *
 * The handler uses only raw system calls and never touches errno.  As it
 * returns it tells eintr.c (per-thread count and time parked), whose
 * wrappers resume the call the signal interrupted.
 */
#include "shim.h"
#include "../common/sys.h"
#include "../common/util.h"
#include "../common/maps.h"
#include "../common/timers.h"

#include <errno.h>
#include <sys/prctl.h>
#include <sys/resource.h>

#define PHASE_RUNNING 0
#define PHASE_PARKING 1

static volatile uint32_t phase;
static volatile uint32_t release_gen;  /* futex: bumped to release parked threads */
static volatile uint32_t parked;       /* futex: threads parked so far */
static volatile uint32_t nslots;       /* slots claimed (may exceed CK_MAX_THREADS) */
static struct ck_thread slots[CK_MAX_THREADS];

/* tids signalled in the current round; lives in the arena */
static int32_t *signalled;
static uint32_t nsignalled;

/* glibc >= 2.35 publishes where each thread's rseq area sits in its TCB */
extern const long __rseq_offset __attribute__((weak));
extern const unsigned int __rseq_size __attribute__((weak));

#define RSEQ_SIG_X86 0x53053053u
#define RSEQ_MIN_LEN 32u

/* a registration the program made itself (syscall(SYS_rseq), seen by
 * interpose.c), with glibc's own turned off (glibc.pthread.rseq=0) */
static __thread struct {
    uint64_t area;
    uint32_t len, sig;
} own_rseq __attribute__((tls_model("initial-exec")));

void ck_rseq_registered(long area, uint32_t len, int flags, uint32_t sig)
{
    own_rseq.area = (flags & 1) ? 0 : (uint64_t)area;  /* RSEQ_FLAG_UNREGISTER */
    own_rseq.len = len;
    own_rseq.sig = sig;
}

/* Whether (area, len, sig) is exactly this thread's rseq registration: the
 * kernel answers a second registration of the same one with EBUSY and
 * changes nothing; anything else differs in area, length or signature. */
static int rseq_is(uint64_t area, uint32_t len, uint32_t sig)
{
    return area && ck_rseq((void *)area, len, 0, sig) == -EBUSY;
}

/* Whether the thread has an rseq registration at all: for an aligned kernel
 * address the kernel answers EINVAL when another area is registered, EFAULT
 * when none is (and registers nothing either way). */
static int rseq_any(void)
{
    return ck_rseq((void *)0xffff800000000000ull, RSEQ_MIN_LEN, 0, RSEQ_SIG_X86) == -EINVAL;
}

static void fill_rseq(struct ck_thread *t)
{
    t->rseq_addr = 0;
    t->rseq_len = 0;
    t->rseq_sig = 0;
    if (rseq_is(own_rseq.area, own_rseq.len, own_rseq.sig)) {
        t->rseq_addr = own_rseq.area;
        t->rseq_len = own_rseq.len;
        t->rseq_sig = own_rseq.sig;
        return;
    }
    if (&__rseq_offset && &__rseq_size && __rseq_size > 0 && t->fs_base) {
        uint64_t area = t->fs_base + (uint64_t)__rseq_offset;
        /* glibc registers max(__rseq_size, 32) bytes, rounded to 32 since 2.40 */
        uint32_t lens[3] = {__rseq_size, RSEQ_MIN_LEN, (__rseq_size + 31) & ~31u};
        for (int i = 0; i < 3; i++)
            if (rseq_is(area, lens[i], RSEQ_SIG_X86)) {
                t->rseq_addr = area;
                t->rseq_len = lens[i];
                t->rseq_sig = RSEQ_SIG_X86;
                return;
            }
    }
    if (rseq_any())
        t->flags |= CK_THREAD_RSEQ_UNKNOWN;  /* the dump refuses it */
}

/* its nice value, policy and CPUs; which of them it chose itself, against
 * ckptd-init's (pid 1 of the job's pid namespace: what the node gave it) */
static void fill_sched(struct ck_thread *t)
{
    long prio = ck_getpriority(PRIO_PROCESS, 0);  /* the raw call: 20 - nice */
    long init_prio = ck_getpriority(PRIO_PROCESS, 1);
    t->nice = prio > 0 ? (int32_t)(20 - prio) : 0;
    if (prio > 0 && prio != init_prio)
        t->flags |= CK_THREAD_OWN_NICE;
    long policy = ck_sched_getscheduler(0);
    t->sched_policy = policy > 0 ? (uint32_t)policy : 0;
    int rt = 0;
    t->sched_priority = policy > 0 && ck_sched_getparam(0, &rt) == 0 ? (uint32_t)rt : 0;
    uint64_t init_cpus[16];
    ck_memset(t->cpus, 0, sizeof(t->cpus));
    long n = ck_sched_getaffinity(0, sizeof(t->cpus), t->cpus);
    t->cpus_bytes = n > 0 ? (uint32_t)n : 0;
    ck_memset(init_cpus, 0, sizeof(init_cpus));
    long m = ck_sched_getaffinity(1, sizeof(init_cpus), init_cpus);
    if (n > 0 && (m != n || ck_memcmp(init_cpus, t->cpus, (size_t)n) != 0))
        t->flags |= CK_THREAD_OWN_CPUS;
}

void ck_fill_thread(struct ck_thread *t, uint64_t sigmask)
{
    unsigned long v = 0;
    t->tid = (int32_t)ck_gettid();
    t->flags = t->tid == (int32_t)ck_getpid() ? CK_THREAD_MAIN : 0;
    if (ck_arch_prctl(ARCH_GET_FS, (unsigned long)&v) == 0)
        t->fs_base = v;
    v = 0;
    if (ck_arch_prctl(ARCH_GET_GS, (unsigned long)&v) == 0)
        t->gs_base = v;
    v = 0;
    if (ck_prctl(PR_GET_TID_ADDRESS, (unsigned long)&v, 0, 0, 0) == 0)
        t->clear_child_tid = v;
    void *head = 0;
    size_t len = 0;
    if (ck_get_robust_list(0, &head, &len) == 0) {
        t->robust_list = (uint64_t)head;
        t->robust_len = len;
    }
    fill_rseq(t);
    /* credentials and the other attributes the kernel keeps per task */
    ck_getresuid(&t->uid[0], &t->uid[1], &t->uid[2]);
    ck_getresgid(&t->gid[0], &t->gid[1], &t->gid[2]);
    t->uid[3] = (uint32_t)ck_setfsuid(~0u);  /* an invalid id changes nothing and returns the current one */
    t->gid[3] = (uint32_t)ck_setfsgid(~0u);
    t->cap_bounding = t->cap_ambient = 0;
    for (int c = 0; c < 64; c++) {
        long in = ck_prctl(PR_CAPBSET_READ, (unsigned long)c, 0, 0, 0);
        if (in < 0)
            break;  /* past the kernel's last capability */
        if (in > 0)
            t->cap_bounding |= 1ull << c;
        if (ck_prctl(PR_CAP_AMBIENT, PR_CAP_AMBIENT_IS_SET, (unsigned long)c, 0, 0) > 0)
            t->cap_ambient |= 1ull << c;
    }
    long slack = ck_prctl(PR_GET_TIMERSLACK, 0, 0, 0, 0);
    t->timer_slack_ns = slack > 0 ? (uint64_t)slack : 0;
    long bits = ck_prctl(PR_GET_SECUREBITS, 0, 0, 0, 0);
    t->securebits = bits > 0 ? (uint32_t)bits : 0;
    int pdeath = 0;
    ck_prctl(PR_GET_PDEATHSIG, (unsigned long)&pdeath, 0, 0, 0);
    t->pdeathsig = pdeath;
    t->no_new_privs = ck_prctl(PR_GET_NO_NEW_PRIVS, 0, 0, 0, 0) == 1;
    fill_sched(t);
    t->sigmask = sigmask;
    struct ck_cap_header h = {CK_CAP_VERSION_3, 0};
    struct ck_cap_data d[2];
    ck_memset(d, 0, sizeof(d));
    if (ck_capget(&h, d) == 0) {
        for (int i = 0; i < 2; i++) {
            t->cap_effective[i] = d[i].effective;
            t->cap_permitted[i] = d[i].permitted;
            t->cap_inheritable[i] = d[i].inheritable;
        }
    }
    ck_prctl(PR_GET_NAME, (unsigned long)t->comm, 0, 0, 0);
}

/*
 * Pending signals with their siginfo.  A signal's siginfo can only be read
 * by taking it (rt_sigtimedwait), and a thread's own queue only by that
 * thread: at the dump's instant (ck_take_all_pending), each parked thread
 * takes its private ones, the main thread the process-wide ones too, the
 * checkpoint thread its own.  Everything taken is queued again at once, in
 * the same order (an aborted checkpoint loses nothing), and recorded here:
 * a POSIX timer's own signal by making the timer fire again with its
 * overrun (dump_timers.c), which rt_sigqueueinfo could not (the timer would
 * queue a second signal instead of counting an overrun).  The kernel's
 * SigPnd and ShdPnd masks say when a queue is empty; a periodic
 * ITIMER_REAL's SIGALRM is left alone (taking it re-arms the timer):
 * recorded without siginfo.
 */
#define CK_PENDING_POOL 4096
static struct ck_pending pend_pool[CK_PENDING_POOL];
static int64_t pend_at[CK_PENDING_POOL];  /* a timer's signal: the expiry it was put back at */
static uint32_t npend;
static volatile uint32_t pend_lock;
static volatile uint32_t pend_failed;  /* 1: pool full, 2: a signal could not be queued again */

/* the dump asks the parked threads to take their queues (a futex bump) */
static volatile uint32_t service_gen;
static volatile uint32_t served;

static uint64_t pending_mask(int shared)
{
    char buf[4096];
    long n = ck_read_file(shared ? "/proc/self/status" : "/proc/thread-self/status", buf, sizeof(buf) - 1);
    if (n <= 0)
        return 0;
    buf[n] = 0;
    const char *key = shared ? "ShdPnd:" : "SigPnd:";
    for (const char *p = buf; *p;) {
        if (ck_strncmp(p, key, 7) == 0)
            return ck_parse_u64(ck_skip_spaces(p + 7), 16, 0);
        while (*p && *p != '\n')
            p++;
        if (*p)
            p++;
    }
    return 0;
}

static int alarm_is_periodic(void)
{
    struct itimerval v;
    return ck_getitimer(ITIMER_REAL, &v) == 0 && (v.it_interval.tv_sec || v.it_interval.tv_usec);
}

void ck_take_pending(int which)
{
    /* the common case, cheaply: nothing pending here or process-wide (the
     * caller blocks every signal, so this is the union of both queues) */
    uint64_t any = 0;
    if (ck_sc2(SYS_rt_sigpending, &any, sizeof(any)) == 0 && !(any & ~(1ull << (ck_shim.quiesce_signal - 1))))
        return;
    int pid = (int)ck_getpid(), tid = (int)ck_gettid();
    while (__atomic_exchange_n(&pend_lock, 1, __ATOMIC_ACQUIRE))
        ck_sc0(SYS_sched_yield);
    uint32_t first = npend;
    /* the thread's own queue first: rt_sigtimedwait takes from it before the
     * process-wide one, which it reaches only once the own one is held here */
    for (int shared = 0; shared <= 1; shared++) {
        if (!(which & (shared ? CK_TAKE_SHARED : CK_TAKE_OWN)))
            continue;
        uint64_t set = pending_mask(shared);
        for (int s = 1; s <= 64; s++) {
            uint64_t bit = 1ull << (s - 1);
            if (!(set & bit) || s == ck_shim.quiesce_signal || s == SIGKILL || s == SIGSTOP ||
                (s == SIGALRM && alarm_is_periodic()) || (s == SIGTERM && ck_term_hidden()))
                continue;
            while (pending_mask(shared) & bit) {
                if (npend >= CK_PENDING_POOL) {
                    pend_failed = 1;
                    break;
                }
                struct ck_pending *r = &pend_pool[npend];
                struct timespec zero = {0, 0};
                ck_memset(r, 0, sizeof(*r));
                if (ck_rt_sigtimedwait(&bit, r->info, &zero) != s)
                    break;
                r->tid = shared ? 0 : tid;
                r->signo = s;
                r->has_info = 1;
                /* a timer fired again as its signal was taken: one signal
                 * of the kernel's counting 1 + overrun more expirations */
                struct ck_pending *same = 0;
                for (uint32_t k = first; k < npend && CK_SIGINFO_CODE(r->info) == CK_SI_TIMER; k++)
                    if (pend_pool[k].tid == r->tid && pend_pool[k].signo == s &&
                        CK_SIGINFO_CODE(pend_pool[k].info) == CK_SI_TIMER &&
                        CK_SIGINFO_TIMERID(pend_pool[k].info) == CK_SIGINFO_TIMERID(r->info))
                        same = &pend_pool[k];
                if (same)
                    CK_SIGINFO_OVERRUN(same->info) += 1 + CK_SIGINFO_OVERRUN(r->info);
                else
                    npend++;
            }
        }
    }
    for (uint32_t i = first; i < npend; i++) {
        struct ck_pending *r = &pend_pool[i];
        long rc = -ENOENT;
        if (CK_SIGINFO_CODE(r->info) == CK_SI_TIMER)
            rc = ck_timer_requeue_taken(r->info, &pend_at[i]);
        if (rc != -ENOENT) {
            /* a timer's own signal; one it could not put back is queued
             * all the same (not lost), and the checkpoint fails */
            if (rc < 0 && r->tid)
                ck_rt_tgsigqueueinfo(pid, tid, r->signo, r->info);
            else if (rc < 0)
                ck_sc3(SYS_rt_sigqueueinfo, pid, r->signo, r->info);
        } else if (r->tid) {
            rc = ck_rt_tgsigqueueinfo(pid, tid, r->signo, r->info);
        } else {
            rc = ck_sc3(SYS_rt_sigqueueinfo, pid, r->signo, r->info);
        }
        if (rc < 0)
            pend_failed = 2;
    }
    __atomic_store_n(&pend_lock, 0, __ATOMIC_RELEASE);
}

struct ck_pending *ck_taken_pending(uint32_t *n, uint32_t *failed, const int64_t **at)
{
    *n = npend;
    *failed = pend_failed;
    *at = pend_at;
    return pend_pool;
}

/* At the dump's instant, with every other thread parked: each takes its own
 * queue (the main thread the process-wide one too), then the caller its own.
 * -1 if a parked thread has not done so within 10 s. */
int ck_take_all_pending(void)
{
    int64_t deadline = ck_now_ns(CLOCK_MONOTONIC) + 10000000000LL;
    uint32_t want = __atomic_load_n(&nslots, __ATOMIC_ACQUIRE);
    if (want > CK_MAX_THREADS)
        want = CK_MAX_THREADS;
    npend = 0;
    pend_failed = 0;
    __atomic_store_n(&served, 0, __ATOMIC_RELEASE);
    __atomic_fetch_add(&service_gen, 1, __ATOMIC_ACQ_REL);
    for (;;) {
        /* parked threads sleep on release_gen: a wake makes them look */
        ck_futex_wake_all(&release_gen);
        uint32_t got = __atomic_load_n(&served, __ATOMIC_ACQUIRE);
        if (got >= want)
            break;
        if (ck_now_ns(CLOCK_MONOTONIC) > deadline)
            return -1;
        ck_futex_wait(&served, got, 2);
    }
    ck_take_pending(CK_TAKE_OWN);
    return 0;
}

static void quiesce_handler(int sig, siginfo_t *si, void *ucv)
{
    (void)sig;
    (void)si;
    if (__atomic_load_n(&phase, __ATOMIC_ACQUIRE) != PHASE_PARKING) {
        ck_eintr_quiesced(0);  /* stray signal outside a checkpoint: still ours */
        return;
    }
    ucontext_t *uc = ucv;
    /* on the stack: a restored thread reads it after the restart */
    volatile int64_t parked_at = ck_now_ns(CLOCK_MONOTONIC);
    volatile uint32_t gen = __atomic_load_n(&release_gen, __ATOMIC_ACQUIRE);
    uint32_t idx = __atomic_fetch_add(&nslots, 1, __ATOMIC_ACQ_REL);
    if (idx < CK_MAX_THREADS) {
        struct ck_thread *t = &slots[idx];
        uint64_t mask;
        ck_memcpy(&mask, &uc->uc_sigmask, sizeof(mask));
        ck_fill_thread(t, mask);
        /* the process-wide queue is the leader's to take: the kernel lets a
         * siginfo of any origin be queued again process-wide only by it */
        volatile int which = (t->flags & CK_THREAD_MAIN) ? CK_TAKE_OWN | CK_TAKE_SHARED : CK_TAKE_OWN;
        /* in memory, not a register: a restored thread must not serve again */
        volatile uint32_t seen = __atomic_load_n(&service_gen, __ATOMIC_ACQUIRE);
        if (ck_save_ctx(&t->ctx) == 0) {
            __atomic_fetch_add(&parked, 1, __ATOMIC_RELEASE);
            ck_futex_wake_all(&parked);
        } else {
            /* restored: we are back in shim code, off the restorer's stack */
            seen = __atomic_load_n(&service_gen, __ATOMIC_ACQUIRE);
            __atomic_fetch_add(&ck_restart.arrived, 1, __ATOMIC_RELEASE);
            ck_futex_wake_all(&ck_restart.arrived);
        }
        while (__atomic_load_n(&release_gen, __ATOMIC_ACQUIRE) == gen) {
            uint32_t s = __atomic_load_n(&service_gen, __ATOMIC_ACQUIRE);
            if (s != seen) {
                seen = s;
                ck_take_pending(which);
                __atomic_fetch_add(&served, 1, __ATOMIC_RELEASE);
                ck_futex_wake_all(&served);
            }
            ck_futex_wait(&release_gen, gen, -1);
        }
    } else {
        __atomic_fetch_add(&parked, 1, __ATOMIC_RELEASE);
        ck_futex_wake_all(&parked);
    }
    while (__atomic_load_n(&release_gen, __ATOMIC_ACQUIRE) == gen)
        ck_futex_wait(&release_gen, gen, -1);
    /* the call this signal interrupted is resumed (eintr.c) */
    ck_eintr_quiesced(parked_at);
}

int ck_quiesce_install(int sig)
{
    struct ck_kernel_sigaction act, old;
    extern void ck_sigreturn_trampoline(void) CK_HIDDEN;
    ck_memset(&act, 0, sizeof(act));
    act.handler = (uint64_t)quiesce_handler;
    act.flags = SA_SIGINFO | SA_RESTART | SA_RESTORER;
    act.restorer = (uint64_t)ck_sigreturn_trampoline;
    act.mask = ~0ull;  /* nothing else runs on a parked thread */
    return (int)ck_rt_sigaction(sig, &act, &old);
}

static int task_exists(int tid)
{
    char path[64];
    struct ck_buf b;
    struct stat st;
    ck_buf_init(&b, path, sizeof(path));
    ck_buf_str(&b, "/proc/self/task/");
    ck_buf_u64(&b, (uint64_t)tid);
    return ck_stat(path, &st) == 0;
}

static int already_signalled(int tid)
{
    for (uint32_t i = 0; i < nsignalled; i++)
        if (signalled[i] == tid)
            return 1;
    return 0;
}

/* signal every task not yet signalled; returns how many new ones, or -errno */
static long signal_new_tasks(int self, int pid, int sig)
{
    char buf[4096];
    long fd = ck_open("/proc/self/task", O_RDONLY | O_DIRECTORY | O_CLOEXEC, 0);
    if (fd < 0)
        return fd;
    long added = 0;
    for (;;) {
        long n = ck_getdents64((int)fd, buf, sizeof(buf));
        if (n < 0) {
            ck_close((int)fd);
            return n;
        }
        if (n == 0)
            break;
        for (long off = 0; off < n;) {
            struct ck_linux_dirent64 *d = (void *)(buf + off);
            off += d->d_reclen;
            if (d->d_name[0] < '0' || d->d_name[0] > '9')
                continue;
            int tid = (int)ck_parse_u64(d->d_name, 10, 0);
            if (tid == self || already_signalled(tid))
                continue;
            if (nsignalled >= CK_MAX_THREADS) {
                ck_close((int)fd);
                return -E2BIG;
            }
            long rc = ck_tgkill(pid, tid, sig);
            if (rc == -ESRCH)
                continue;  /* exited meanwhile */
            if (rc < 0) {
                ck_close((int)fd);
                return rc;
            }
            signalled[nsignalled++] = tid;
            added++;
        }
    }
    ck_close((int)fd);
    return added;
}

/* how many signalled threads are gone without parking */
static uint32_t count_vanished(void)
{
    uint32_t gone = 0;
    for (uint32_t i = 0; i < nsignalled; i++) {
        int tid = signalled[i];
        int found = 0;
        uint32_t n = __atomic_load_n(&nslots, __ATOMIC_ACQUIRE);
        for (uint32_t j = 0; j < n && j < CK_MAX_THREADS; j++)
            if (slots[j].tid == tid)
                found = 1;
        if (!found && !task_exists(tid))
            gone++;
    }
    return gone;
}

int ck_quiesce(long timeout_ms, char *err, size_t errcap)
{
    struct ck_buf eb;
    ck_buf_init(&eb, err, errcap);
    if (phase != PHASE_RUNNING) {
        ck_buf_str(&eb, "a checkpoint is already in progress in this process");
        return -1;
    }
    if (!signalled) {
        signalled = ck_arena_alloc(CK_MAX_THREADS * sizeof(int32_t));
        if (!signalled) {
            ck_buf_str(&eb, "cannot allocate checkpoint scratch memory");
            return -1;
        }
    }
    const char *timers = ck_timers_refusal(0);
    if (timers) {
        ck_buf_str(&eb, timers);
        return -1;
    }
    int self = (int)ck_gettid(), pid = (int)ck_getpid();
    nsignalled = 0;
    npend = 0;
    pend_failed = 0;
    __atomic_store_n(&nslots, 0, __ATOMIC_RELEASE);
    __atomic_store_n(&parked, 0, __ATOMIC_RELEASE);
    __atomic_store_n(&phase, PHASE_PARKING, __ATOMIC_RELEASE);

    int64_t deadline = ck_now_ns(CLOCK_MONOTONIC) + timeout_ms * 1000000LL;
    uint32_t vanished = 0;
    for (;;) {
        long added = signal_new_tasks(self, pid, ck_shim.quiesce_signal);
        if (added < 0) {
            ck_buf_str(&eb, "cannot signal the threads of the process: errno ");
            ck_buf_i64(&eb, -added);
            ck_release();
            return -1;
        }
        uint32_t p = __atomic_load_n(&parked, __ATOMIC_ACQUIRE);
        if (added == 0 && p + vanished >= nsignalled) {
            /* every thread we know of is parked: a parked thread cannot
             * create new ones, so one more scan settles it */
            if (signal_new_tasks(self, pid, ck_shim.quiesce_signal) == 0)
                break;
            continue;
        }
        if (ck_now_ns(CLOCK_MONOTONIC) > deadline) {
            ck_buf_str(&eb, "timed out after ");
            ck_buf_i64(&eb, timeout_ms);
            ck_buf_str(&eb, " ms: ");
            ck_buf_u64(&eb, nsignalled - p - vanished);
            ck_buf_str(&eb, " of ");
            ck_buf_u64(&eb, nsignalled);
            ck_buf_str(&eb, " threads did not respond to the quiesce signal (is it blocked?)");
            ck_release();
            return -1;
        }
        ck_futex_wait(&parked, p, 5);
        vanished = count_vanished();
    }
    if (__atomic_load_n(&nslots, __ATOMIC_ACQUIRE) > CK_MAX_THREADS) {
        ck_buf_str(&eb, "too many threads (limit 4096)");
        ck_release();
        return -1;
    }
    return 0;
}

void ck_release(void)
{
    __atomic_store_n(&phase, PHASE_RUNNING, __ATOMIC_RELEASE);
    __atomic_fetch_add(&release_gen, 1, __ATOMIC_ACQ_REL);
    ck_futex_wake_all(&release_gen);
}

int ck_is_parked(void) { return __atomic_load_n(&phase, __ATOMIC_ACQUIRE) == PHASE_PARKING; }

/* In a forked child: a fork that raced with its parent's QUIESCE (the
 * phase set, the forking thread not yet signalled) must not leave the
 * child believing a checkpoint of its own is under way. */
void ck_quiesce_after_fork(void)
{
    __atomic_store_n(&phase, PHASE_RUNNING, __ATOMIC_RELEASE);
    __atomic_store_n(&nslots, 0, __ATOMIC_RELEASE);
    __atomic_store_n(&parked, 0, __ATOMIC_RELEASE);
    nsignalled = 0;
}

struct ck_thread *ck_parked_threads(uint32_t *n)
{
    *n = __atomic_load_n(&nslots, __ATOMIC_ACQUIRE);
    return slots;
}

void ck_wait_threads_arrived(uint32_t n)
{
    for (;;) {
        uint32_t a = __atomic_load_n(&ck_restart.arrived, __ATOMIC_ACQUIRE);
        if (a >= n)
            return;
        ck_futex_wait(&ck_restart.arrived, a, 100);
    }
}
