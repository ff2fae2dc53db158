/*
 * SIGTERM held for the agent's decision (issue 16: preemption).
 *
 * Slurm's scancel and scontrol requeue signal every process of the job at
 * once: the launcher and its daemon take a final checkpoint, but a program
 * whose SIGTERM is at its default would die before it.  So while a process
 * runs under ckptd and its program-visible SIGTERM disposition is SIG_DFL,
 * the kernel's is a hidden handler of the shim's:
 *
 *  - The program never sees it: sigaction(SIGTERM) reads back what the
 *    program last set (SIG_DFL), a handler or SIG_IGN the program installs
 *    replaces it for real (and is called as before, eintr.c), SIG_DFL set
 *    again hides it again.  Masks are untouched: a program that blocks
 *    SIGTERM to sigwait() or signalfd() it never reaches this handler.
 *    exec resets it, and the shim of the new image installs it again.
 *  - On a SIGTERM the thread that took it sends "TERM" to the agent on the
 *    shim's connection (one small send: atomic beside the checkpoint
 *    thread's replies) and waits.  The agent answers TERM_HOLD (a final
 *    checkpoint is under way, after which the job is stopped: the thread is
 *    parked in here like any other and killed with the job) or
 *    TERM_DELIVER (the launcher said --sigterm forward, or no launcher
 *    holds the job): the signal is then delivered for real, the default
 *    disposition put back, and the process dies of it as it would have.
 *  - It is delivered as well when no agent answers within TERM_ANSWER_MS
 *    (time the checkpoint thread spends on a command not counted), when
 *    the connection drops, or CKPTD_SIGTERM_HOLD_S (default 300) after it
 *    came in any case: a job never becomes unkillable.
 *  - A checkpoint records SIG_DFL (dump.c) and no pending SIGTERM
 *    (quiesce.c, dump.c): a restored process's shim installs the handler
 *    again and a thread restored inside a hold returns from it as if the
 *    signal never came (term_gen): a restarted job does not die of the
 *    preemption signal of its previous incarnation.
 * SIGKILL is SIGKILL.
 */
#include "shim.h"
#include "../common/sys.h"
#include "../common/util.h"

#include <errno.h>
#include <signal.h>
#include <stdlib.h>
#include <sys/socket.h>

#define TERM_ANSWER_MS 3000

enum { TERM_WAITING = 0, TERM_HOLD = 1, TERM_DELIVER = 2 };

static volatile int term_hidden;        /* the kernel's SIGTERM action is term_handler */
static struct sigaction term_view;      /* what the program set last (SIG_DFL), as it reads it back */
static volatile uint32_t term_decision; /* futex: TERM_* */
static volatile uint32_t term_gen;      /* futex too: bumped by a restore, which ends every hold */
static long hold_ms = 300000;

int ck_term_hidden(void) { return __atomic_load_n(&term_hidden, __ATOMIC_ACQUIRE); }

static void deliver(void)
{
    struct ck_kernel_sigaction dfl;
    ck_memset(&dfl, 0, sizeof(dfl));
    __atomic_store_n(&term_hidden, 0, __ATOMIC_RELEASE);
    ck_rt_sigaction(SIGTERM, &dfl, 0);
    /* blocked while this handler runs: pending on this thread, then let in */
    uint64_t term = 1ull << (SIGTERM - 1);
    ck_tgkill((int)ck_getpid(), (int)ck_gettid(), SIGTERM);
    ck_sigprocmask(SIG_UNBLOCK, &term, 0);
}

static int send_term(int tid, int sender)
{
    char line[128];
    struct ck_buf b;
    int fd = ck_shim.agent_fd;
    if (fd < 0)
        return -1;
    ck_buf_init(&b, line, sizeof(line));
    ck_buf_str(&b, "TERM\ttid=");
    ck_buf_u64(&b, (uint64_t)tid);
    ck_buf_str(&b, "\tsender=");
    ck_buf_u64(&b, (uint64_t)(sender > 0 ? sender : 0));
    ck_buf_char(&b, '\n');
    long w;
    do
        w = ck_sc4(SYS_sendto, fd, b.data, b.len, MSG_NOSIGNAL);
    while (w == -EINTR);
    return w == (long)b.len ? 0 : -1;
}

static void term_handler(int sig, siginfo_t *si, void *uc)
{
    (void)sig;
    (void)uc;
    int64_t start = ck_now_ns(CLOCK_MONOTONIC), last = start, waited = 0;  /* ns */
    uint32_t gen = __atomic_load_n(&term_gen, __ATOMIC_ACQUIRE);
    __atomic_store_n(&term_decision, TERM_WAITING, __ATOMIC_RELEASE);
    if (!ck_shim.active || send_term((int)ck_gettid(), si ? si->si_pid : 0) < 0) {
        deliver();
        return;
    }
    for (;;) {
        uint32_t d = __atomic_load_n(&term_decision, __ATOMIC_ACQUIRE);
        if (__atomic_load_n(&term_gen, __ATOMIC_ACQUIRE) != gen)
            break;  /* restored: the signal was the previous incarnation's */
        /* the time the checkpoint thread spends on a command (a FLUSH, a
         * DUMP) does not count: the agent's answer waits behind it */
        int64_t now = ck_now_ns(CLOCK_MONOTONIC);
        if (!__atomic_load_n(&ck_shim.busy, __ATOMIC_ACQUIRE))
            waited += now - last;
        last = now;
        int64_t bound = (d == TERM_HOLD ? hold_ms : TERM_ANSWER_MS) * 1000000LL;
        /* hold_ms bounds it all, busy or not: a stuck command never makes SIGTERM harmless */
        if (d == TERM_DELIVER || waited >= bound || now - start >= hold_ms * 1000000LL) {
            deliver();
            return;
        }
        /* woken by the decision, a restore (term_gen), or the quiesce
         * signal of the final checkpoint, which parks this thread here */
        ck_futex_wait(&term_decision, d, bound - waited < 200000000LL ? (bound - waited) / 1000000 + 1 : 200);
    }
    ck_eintr_quiesced(0);  /* the call SIGTERM interrupted is resumed, as after a checkpoint */
}

static void hide(void)
{
    struct ck_kernel_sigaction act;
    extern void ck_sigreturn_trampoline(void) CK_HIDDEN;
    ck_memset(&act, 0, sizeof(act));
    act.handler = (uint64_t)term_handler;
    act.flags = SA_SIGINFO | SA_RESTART | SA_RESTORER;
    act.restorer = (uint64_t)ck_sigreturn_trampoline;
    act.mask = ~0ull & ~(1ull << (ck_shim.quiesce_signal - 1));  /* the final checkpoint can park it */
    if (ck_rt_sigaction(SIGTERM, &act, 0) == 0)
        __atomic_store_n(&term_hidden, 1, __ATOMIC_RELEASE);
}

void ck_term_install(void)
{
    const char *h = getenv("CKPTD_SIGTERM_HOLD_S");
    if (h && *h)
        hold_ms = (long)ck_parse_u64(h, 10, 0) * 1000;
    struct ck_kernel_sigaction cur;
    ck_memset(&cur, 0, sizeof(cur));
    if (ck_rt_sigaction(SIGTERM, 0, &cur) == 0 && cur.handler == (uint64_t)SIG_DFL)
        hide();
}

void ck_term_restored(void)
{
    __atomic_store_n(&term_decision, TERM_WAITING, __ATOMIC_RELEASE);
    __atomic_fetch_add(&term_gen, 1, __ATOMIC_ACQ_REL);
    ck_futex_wake_all(&term_gen);
    ck_futex_wake_all(&term_decision);
    if (ck_term_hidden())
        hide();  /* the image said SIG_DFL */
}

void ck_term_decide(int hold)
{
    __atomic_store_n(&term_decision, hold ? TERM_HOLD : TERM_DELIVER, __ATOMIC_RELEASE);
    ck_futex_wake_all(&term_decision);
}

void ck_term_image_action(struct ck_kernel_sigaction *k)
{
    if (k->handler != (uint64_t)term_handler)
        return;
    ck_memset(k, 0, sizeof(*k));
    k->flags = (uint64_t)term_view.sa_flags;
    ck_memcpy(&k->mask, &term_view.sa_mask, sizeof(k->mask));
}

static int is_default(const struct sigaction *act)
{
    void *h = act->sa_flags & SA_SIGINFO ? (void *)act->sa_sigaction : (void *)act->sa_handler;
    return h == (void *)SIG_DFL;
}

/* the interposed sigaction(SIGTERM, ...) (interpose.c) */
int ck_term_sigaction(const struct sigaction *act, struct sigaction *old, ck_sigaction_fn real)
{
    if (!ck_shim.active)
        return ck_eintr_sigaction(SIGTERM, act, old, real);
    if (ck_term_hidden()) {
        struct sigaction view = term_view;
        if (act && !is_default(act)) {
            int rc = ck_eintr_sigaction(SIGTERM, act, 0, real);  /* the program's own, for real */
            if (rc < 0)
                return rc;
            __atomic_store_n(&term_hidden, 0, __ATOMIC_RELEASE);
        } else if (act) {
            term_view = *act;
        }
        if (old)
            *old = view;
        return 0;
    }
    if (act && is_default(act)) {  /* back to the default: hidden again */
        int rc = ck_eintr_sigaction(SIGTERM, 0, old, real);
        if (rc < 0)
            return rc;
        term_view = *act;
        hide();
        return 0;
    }
    return ck_eintr_sigaction(SIGTERM, act, old, real);
}
