/* Process-wide state: limits, signal actions, cwd, umask, pending signals, timers. */
#include "restorer.h"

#include <errno.h>

void rst_restore_limits(const struct rst_image *im)
{
    for (int r = 0; r < 16; r++) {
        struct rlimit want = {im->rlimits[r].cur, im->rlimits[r].max}, now;
        if (ck_prlimit(r, 0, &now) < 0)
            continue;
        if (now.rlim_cur == want.rlim_cur && now.rlim_max == want.rlim_max)
            continue;
        if (ck_prlimit(r, &want, 0) == 0)
            continue;
        /* raising a hard limit needs CAP_SYS_RESOURCE: keep ours, clamp soft */
        want.rlim_max = now.rlim_max;
        if (want.rlim_cur > want.rlim_max)
            want.rlim_cur = want.rlim_max;
        ck_prlimit(r, &want, 0);
    }
}

void rst_restore_process(const struct rst_image *im)
{
    const struct ck_proc *p = im->proc;
    ck_umask((int)p->umask);
    long rc = ck_chdir(rst_str(im, p->cwd));
    if (rc < 0)
        rst_fail("cannot return to the working directory", rst_str(im, p->cwd), rc);
    ck_personality(p->personality);
    for (int s = 1; s <= 64; s++) {
        if (s == SIGKILL || s == SIGSTOP)
            continue;
        struct ck_kernel_sigaction act;
        act.handler = im->sigacts[s - 1].handler;
        act.flags = im->sigacts[s - 1].flags;
        act.restorer = im->sigacts[s - 1].restorer;
        act.mask = im->sigacts[s - 1].mask;
        rc = ck_rt_sigaction(s, &act, 0);
        if (rc < 0 && rc != -EINVAL)
            rst_fail("cannot restore a signal action", 0, rc);
    }
}

/* the kernel's siginfo for SI_TKILL (glibc's field names are macros) */
struct rst_siginfo {
    int signo, err, code, pad;
    int pid, uid;
    char rest[128 - 24];
};

void rst_queue_pending(const struct rst_image *im)
{
    int pid = (int)ck_getpid();
    /* signals that arrived during the restore (SIGCHLD from recreated
     * zombies, say) were not pending at checkpoint time: drop them */
    uint64_t all = ~0ull & ~((1ull << (SIGKILL - 1)) | (1ull << (SIGSTOP - 1)));
    struct timespec now = {0, 0};
    struct rst_siginfo drop;
    while (ck_rt_sigtimedwait(&all, &drop, &now) > 0)
        ;
    for (uint32_t i = 0; i < im->npending; i++) {
        struct rst_siginfo si;
        ck_memset(&si, 0, sizeof(si));
        si.signo = im->pending[i].signo;
        si.code = -6;  /* SI_TKILL: raised again by ckptd */
        si.pid = pid;
        int tid = im->pending[i].tid ? im->pending[i].tid : pid;
        long rc;
        if (im->pending[i].tid)
            rc = ck_rt_tgsigqueueinfo(pid, tid, si.signo, &si);
        else
            rc = ck_sc3(SYS_rt_sigqueueinfo, pid, si.signo, &si);
        if (rc < 0)
            rst_note("cannot raise a pending signal again", 0, rc);
    }
}

void rst_arm_timers(const struct rst_image *im)
{
    for (int i = 0; i < 3; i++) {
        const struct ck_itimer *t = &im->proc->itimers[i];
        struct itimerval v;
        v.it_interval.tv_sec = t->interval_sec;
        v.it_interval.tv_usec = t->interval_usec;
        v.it_value.tv_sec = t->value_sec;
        v.it_value.tv_usec = t->value_usec;
        if (!v.it_value.tv_sec && !v.it_value.tv_usec) {
            if (!v.it_interval.tv_sec && !v.it_interval.tv_usec)
                continue;  /* disarmed */
            /* periodic with its expiry pending (it re-arms when the signal
             * is taken): the pending signal is queued again, the next one
             * comes an interval later */
            v.it_value = v.it_interval;
        }
        long rc = ck_setitimer(i, &v);
        if (rc < 0)
            rst_fail("cannot re-arm an interval timer", 0, rc);
    }
}
