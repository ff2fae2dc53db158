/* Process-wide state: limits, signal actions, cwd, umask, pending signals, timers,
 * and the attributes of issue 18 (oom_score_adj, loginuid, subreaper, THP, groups,
 * credentials, dumpable). */
#include "restorer.h"

#include <errno.h>
#include <sys/prctl.h>

#ifndef PR_SET_THP_DISABLE
#define PR_SET_THP_DISABLE 41
#endif

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
    long rc;
    if (p->cwd_deleted) {
        /* removed while the job was in it: an empty one, entered and removed again */
        long dir = rst_recreate_deleted(rst_str(im, p->cwd), p->cwd_mode, p->cwd_uid, p->cwd_gid, -1, 0);
        rc = ck_sc1(SYS_fchdir, dir);
        ck_close((int)dir);
    } else {
        rc = ck_chdir(rst_str(im, p->cwd));
    }
    if (rc < 0)
        rst_fail("cannot return to the working directory", rst_str(im, p->cwd), rc);
    ck_personality(p->personality);
    rst_restore_attrs(im);
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

/* Queue the image's pending signals for thread tid (0: process-wide) again,
 * with their siginfo, in order.  The kernel takes a siginfo of any origin
 * (si_code >= 0: the kernel's, kill()'s; SI_TKILL) only from the thread
 * itself, and process-wide only from the thread-group leader: each thread
 * queues its own (threads.c), the main thread its own and the process's. */
void rst_queue_pending_of(const struct rst_image *im, int tid)
{
    int pid = (int)ck_getpid();
    for (uint32_t i = 0; i < im->npending; i++) {
        if (im->pending[i].tid != tid)
            continue;
        if (im->pending[i].has_info && rst_timer_pending(im, im->pending[i].info))
            continue;  /* a POSIX timer's own signal: the timer fired again (timers.c) */
        struct rst_siginfo si;
        ck_memset(&si, 0, sizeof(si));
        if (im->pending[i].has_info) {
            ck_memcpy(&si, im->pending[i].info, sizeof(si));  /* as the kernel had queued it */
        } else {
            si.code = -6;  /* SI_TKILL: raised again by ckptd */
            si.pid = pid;
        }
        si.signo = im->pending[i].signo;
        long rc = tid ? ck_rt_tgsigqueueinfo(pid, tid, si.signo, &si) : ck_sc3(SYS_rt_sigqueueinfo, pid, si.signo, &si);
        if (rc < 0) {
            char what[16];
            struct ck_buf b;
            ck_buf_init(&b, what, sizeof(what));
            ck_buf_str(&b, "signal ");
            ck_buf_i64(&b, si.signo);
            rst_fail("cannot queue a pending signal again", what, rc);
        }
    }
}

void rst_queue_pending(const struct rst_image *im)
{
    /* signals that arrived during the restore (SIGCHLD from recreated
     * zombies, say) were not pending at checkpoint time: drop them */
    uint64_t all = ~0ull & ~((1ull << (SIGKILL - 1)) | (1ull << (SIGSTOP - 1)));
    struct timespec now = {0, 0};
    struct rst_siginfo drop;
    while (ck_rt_sigtimedwait(&all, &drop, &now) > 0)
        ;
    rst_timer_overruns(im, (int)ck_getpid());
    rst_timer_overruns(im, 0);
    rst_queue_pending_of(im, (int)ck_getpid());
    rst_queue_pending_of(im, 0);
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
    rst_arm_posix_timers(im);
}

/* THP-disable first, before memory is mapped again: it decides how the
 * pages read back are faulted in.  Bit 0 of PR_GET_THP_DISABLE is the flag,
 * the bits above it (6.18: PR_THP_DISABLE_EXCEPT_ADVISED) its mode. */
void rst_restore_thp(const struct rst_image *im)
{
    uint32_t v = im->proc->thp_disable;
    long rc = ck_prctl(PR_SET_THP_DISABLE, v & 1, v & ~1u, 0, 0);
    if (rc < 0)
        rst_fail("cannot set THP-disable again (PR_SET_THP_DISABLE)", 0, rc);
}

static long read_int(const char *path, int64_t *out)
{
    char buf[32];
    long n = ck_read_file(path, buf, sizeof(buf) - 1);
    if (n <= 0)
        return n < 0 ? n : -EIO;
    buf[n] = 0;
    *out = ck_parse_i64(buf, 0);
    return 0;
}

static long write_int(const char *path, int64_t v)
{
    char buf[32];
    struct ck_buf b;
    ck_buf_init(&b, buf, sizeof(buf));
    ck_buf_i64(&b, v);
    long fd = ck_open(path, O_WRONLY | O_CLOEXEC, 0);
    if (fd < 0)
        return fd;
    long rc = ck_write((int)fd, b.data, b.len);
    ck_close((int)fd);
    return rc < 0 ? rc : 0;
}

/* oom_score_adj and the audit login uid are written only when they differ:
 * lowering the first needs CAP_SYS_RESOURCE, any change of the second
 * CAP_AUDIT_CONTROL, and a restart without them fails rather than run the
 * job with other values. */
void rst_restore_attrs(const struct rst_image *im)
{
    const struct ck_proc *p = im->proc;
    int64_t now;
    char what[32];
    struct ck_buf b;
    long rc;
    if (read_int("/proc/self/oom_score_adj", &now) == 0 && now != p->oom_score_adj) {
        rc = write_int("/proc/self/oom_score_adj", p->oom_score_adj);
        if (rc < 0) {
            ck_buf_init(&b, what, sizeof(what));
            ck_buf_i64(&b, p->oom_score_adj);
            rst_fail("cannot set oom_score_adj again (lowering it needs CAP_SYS_RESOURCE)", what, rc);
        }
    }
    if (read_int("/proc/self/loginuid", &now) == 0 && (uint32_t)now != p->loginuid) {
        rc = write_int("/proc/self/loginuid", p->loginuid);
        if (rc < 0) {
            ck_buf_init(&b, what, sizeof(what));
            ck_buf_u64(&b, p->loginuid);
            rst_fail("cannot set the audit login uid again (/proc/self/loginuid needs CAP_AUDIT_CONTROL)", what, rc);
        }
    }
    rc = ck_prctl(PR_SET_CHILD_SUBREAPER, p->child_subreaper, 0, 0, 0);
    if (rc < 0)
        rst_fail("cannot set the child-subreaper flag again", 0, rc);
}

/* The supplementary groups, valid inside the core buffer, or rst_fail. */
const uint32_t *rst_groups(const struct rst_image *im)
{
    const struct ck_proc *p = im->proc;
    if (p->ngroups > 65536 || p->groups_off > im->blob_size ||
        (uint64_t)p->ngroups * 4 > im->blob_size - p->groups_off)
        rst_fail("corrupt image: the supplementary groups lie outside the image", 0, 0);
    return (const uint32_t *)(im->blob + p->groups_off);
}

/* Last, once every thread has its credentials (a change of the effective
 * ids resets it to the suid_dumpable setting). */
void rst_restore_dumpable(const struct rst_image *im)
{
    long rc = ck_prctl(PR_SET_DUMPABLE, im->proc->dumpable, 0, 0, 0);
    if (rc < 0)
        rst_fail("cannot set the dumpable flag again", 0, rc);
}
