/*
 * Threads come back with their own thread ids (clone3 set_tid inside the
 * job's fresh pid namespace), so the tids glibc caches in each TCB stay
 * true.  Each gets its TLS base, clear-tid word (what pthread_join waits
 * on), robust futex list and rseq registration back, then jumps to its
 * saved resume point.  The restorer's own thread becomes the main thread.
 */
#include "restorer.h"

#include <errno.h>
#include <sched.h>
#include <sys/prctl.h>
#include <sys/resource.h>
#include <linux/securebits.h>

struct rst_clone_args {
    uint64_t flags, pidfd, child_tid, parent_tid, exit_signal;
    uint64_t stack, stack_size, tls, set_tid, set_tid_size, cgroup;
};

static volatile uint32_t ready;  /* futex: threads set up and waiting */
static volatile uint32_t go;     /* futex: everything is in place */
static volatile uint32_t timers_made;  /* futex: POSIX timers exist (they may aim at any thread) */
static volatile uint32_t queued;       /* futex: threads that queued their own signals */

static const struct rst_image *cur_im;  /* for the cloned threads */
static const uint32_t *saved_groups;  /* the process's supplementary groups (in the core image) */
static uint32_t saved_ngroups;

static void thread_fail(const char *what, const struct ck_thread *t, long rc)
{
    char detail[32];
    struct ck_buf b;
    ck_buf_init(&b, detail, sizeof(detail));
    ck_buf_str(&b, "tid ");
    ck_buf_i64(&b, t->tid);
    rst_fail(what, detail, rc);
}

/* Raw calls: each changes the calling thread only, and every thread sets
 * its own.  While the restorer is privileged: the bounding set first (it
 * needs CAP_SETPCAP), groups, gids, then uids, keeping the permitted
 * capabilities across the change (keep-caps) so that jump_when_told can
 * set the recorded ones. */
static void restore_creds(const struct ck_thread *t)
{
    for (int c = 0; c < 64; c++) {
        long in = ck_prctl(PR_CAPBSET_READ, (unsigned long)c, 0, 0, 0);
        if (in < 0)
            break;
        if (in > 0 && !(t->cap_bounding & (1ull << c))) {
            long rc = ck_prctl(PR_CAPBSET_DROP, (unsigned long)c, 0, 0, 0);
            if (rc < 0)
                thread_fail("cannot drop a capability from the bounding set again (needs CAP_SETPCAP)", t, rc);
        }
    }
    long rc = ck_setgroups(saved_ngroups, saved_groups);
    if (rc < 0) {
        /* no CAP_SETGID (a user's job): only the same list will do */
        uint32_t now[256];
        long n = saved_ngroups <= 256 ? ck_getgroups(256, now) : -1;
        if (n != (long)saved_ngroups || ck_memcmp(now, saved_groups, (size_t)n * 4) != 0)
            thread_fail("cannot set the supplementary groups again (needs CAP_SETGID)", t, rc);
    }
    uint32_t u[4], g[4];
    ck_getresuid(&u[0], &u[1], &u[2]);
    ck_getresgid(&g[0], &g[1], &g[2]);
    u[3] = (uint32_t)ck_setfsuid(~0u);
    g[3] = (uint32_t)ck_setfsgid(~0u);
    if (!ck_memcmp(u, t->uid, sizeof(u)) && !ck_memcmp(g, t->gid, sizeof(g)))
        return;
    ck_prctl(PR_SET_KEEPCAPS, 1, 0, 0, 0);
    rc = ck_setresgid(t->gid[0], t->gid[1], t->gid[2]);
    if (rc < 0)
        thread_fail("cannot take the process's group ids again (needs CAP_SETGID)", t, rc);
    ck_setfsgid(t->gid[3]);
    rc = ck_setresuid(t->uid[0], t->uid[1], t->uid[2]);
    if (rc < 0)
        thread_fail("cannot take the process's user ids again (needs CAP_SETUID)", t, rc);
    /* a change of uid empties the effective set: take it back from the
     * permitted one for what is left (setfsuid, the restore's last steps) */
    struct ck_cap_header h = {CK_CAP_VERSION_3, 0};
    struct ck_cap_data d[2];
    if (ck_capget(&h, d) == 0) {
        d[0].effective = d[0].permitted;
        d[1].effective = d[1].permitted;
        ck_capset(&h, d);
    }
    ck_setfsuid(t->uid[3]);
    if ((uint32_t)ck_setfsuid(~0u) != t->uid[3] || (uint32_t)ck_setfsgid(~0u) != t->gid[3])
        thread_fail("cannot take the process's filesystem ids again", t, 0);
}

/* what the thread chose of its scheduling (image_format.h, CK_THREAD_OWN_*),
 * exactly, or the restore fails; while the restorer's privileges last (a
 * lower nice value or a real-time policy needs CAP_SYS_NICE) */
static void restore_sched(const struct ck_thread *t)
{
    long rc;
    if (t->flags & CK_THREAD_OWN_CPUS) {
        uint64_t now[16];
        ck_memset(now, 0, sizeof(now));
        rc = ck_sched_setaffinity(0, t->cpus_bytes, t->cpus);
        if (rc >= 0)
            rc = ck_sched_getaffinity(0, sizeof(now), now);
        if (rc < 0 || ck_memcmp(now, t->cpus, sizeof(now)) != 0)
            thread_fail("cannot bind the thread to its CPUs again (it set its affinity: taskset, sched_setaffinity): "
                        "this node lacks some of them or does not give them to the job; restart it on a node that does",
                        t, rc < 0 ? rc : 0);
    }
    if (t->flags & CK_THREAD_OWN_NICE) {
        rc = ck_setpriority(PRIO_PROCESS, 0, t->nice);
        if (rc < 0)
            thread_fail("cannot give the thread its nice value again (lower than the node gives the job: needs CAP_SYS_NICE)", t, rc);
    }
    if (t->sched_policy != SCHED_OTHER) {
        int prio = (int)t->sched_priority;
        rc = ck_sched_setscheduler(0, (int)t->sched_policy, &prio);
        if (rc < 0)
            thread_fail("cannot give the thread its scheduling policy again (a real-time one needs CAP_SYS_NICE)", t, rc);
    }
}

static void thread_setup(const struct ck_thread *t)
{
    if (t->robust_list)
        ck_set_robust_list((void *)t->robust_list, t->robust_len);
    if (t->gs_base)
        ck_arch_prctl(ARCH_SET_GS, t->gs_base);
    if (t->rseq_addr) {
        /* exactly the recorded registration, or no restart: a program that
         * checks its own (a second rseq() answering EBUSY) would see it gone */
        long rc = ck_rseq((void *)t->rseq_addr, t->rseq_len, 0, t->rseq_sig);
        if (rc < 0)
            thread_fail("cannot register the thread's rseq area again", t, rc);
    }
    if (t->comm[0])
        ck_prctl(PR_SET_NAME, (unsigned long)t->comm, 0, 0, 0);
    restore_sched(t);
    restore_creds(t);
    /* after the credentials: a change of effective ids clears the parent-death signal */
    long rc = ck_prctl(PR_SET_PDEATHSIG, (unsigned long)t->pdeathsig, 0, 0, 0);
    if (rc < 0)
        thread_fail("cannot set the parent-death signal again", t, rc);
    if (t->timer_slack_ns && (uint64_t)ck_prctl(PR_GET_TIMERSLACK, 0, 0, 0, 0) != t->timer_slack_ns) {
        rc = ck_prctl(PR_SET_TIMERSLACK, t->timer_slack_ns, 0, 0, 0);
        if (rc < 0)
            thread_fail("cannot set the timer slack again", t, rc);
    }
    if (t->no_new_privs) {
        rc = ck_prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0);
        if (rc < 0)
            thread_fail("cannot set no_new_privs again", t, rc);
    }
}

__attribute__((noreturn)) static void jump_when_told(const struct ck_thread *t)
{
    while (__atomic_load_n(&go, __ATOMIC_ACQUIRE) == 0)
        ck_futex_wait(&go, 0, -1);
    /* parked threads return through their signal frame, which restores
     * their real mask; until then everything stays blocked */
    uint64_t mask = (t->flags & CK_THREAD_CHECKPOINTER) ? t->sigmask : ~0ull;
    ck_sigprocmask(SIG_SETMASK, &mask, 0);
    ck_prctl(PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL, 0, 0, 0);
    struct ck_cap_header h = {CK_CAP_VERSION_3, 0};
    struct ck_cap_data d[2];
    for (int i = 0; i < 2; i++) {
        d[i].effective = t->cap_effective[i];
        d[i].permitted = t->cap_permitted[i];
        d[i].inheritable = t->cap_inheritable[i];
    }
    if (ck_capset(&h, d) < 0)
        ck_exit_group(1);  /* never run the job with the restorer's privileges */
    for (int c = 0; c < 64; c++)
        if ((t->cap_ambient & (1ull << c)) && ck_prctl(PR_CAP_AMBIENT, PR_CAP_AMBIENT_RAISE, (unsigned long)c, 0, 0) < 0)
            ck_exit_group(1);  /* what the job had, or it does not run */
    if (ck_prctl(PR_SET_KEEPCAPS, (t->securebits & SECBIT_KEEP_CAPS) != 0, 0, 0, 0) < 0)
        ck_exit_group(1);
    rst_jump_ctx(&t->ctx);
}

__attribute__((noreturn)) static void thread_entry(const struct ck_thread *t)
{
    thread_setup(t);
    __atomic_fetch_add(&ready, 1, __ATOMIC_ACQ_REL);
    ck_futex_wake_all(&ready);
    while (__atomic_load_n(&timers_made, __ATOMIC_ACQUIRE) == 0)
        ck_futex_wait(&timers_made, 0, -1);
    rst_timer_overruns(cur_im, t->tid);    /* of the timers aimed at it (timers.c) */
    rst_queue_pending_of(cur_im, t->tid);  /* its own: only it may (proc.c) */
    __atomic_fetch_add(&queued, 1, __ATOMIC_ACQ_REL);
    ck_futex_wake_all(&queued);
    jump_when_told(t);
}

static void write_restart_info(const struct rst_image *im)
{
    uint64_t addr = im->proc->restart_info;
    int ok = 0;
    for (uint32_t i = 0; i < im->nvmas; i++) {
        const struct ck_vma *v = &im->vmas[i];
        if (addr >= v->start && addr + sizeof(struct ck_restart_info) <= v->end && (v->prot & PROT_WRITE))
            ok = 1;
    }
    if (!ok)
        rst_fail("corrupt image: the shim's restart record is not in writable memory", 0, 0);
    struct ck_restart_info *ri = (void *)addr;
    ri->magic = CK_RESTART_MAGIC;
    ri->hole_start = rst.hole_start;
    ri->hole_len = rst.hole_len;
    ri->nthreads = im->nthreads - 1;  /* all but the checkpoint thread report in */
    ri->arrived = 0;
    ck_strlcpy(ri->agent_socket, rst.agent_socket, sizeof(ri->agent_socket));
    ck_strlcpy(ri->checkpoint_id, rst.checkpoint_id, sizeof(ri->checkpoint_id));
    ri->lazy_uffd = rst.lazy_uffd;
    ri->track_uffd = rst.track_uffd;
}

void rst_restore_threads(const struct rst_image *im)
{
    const struct ck_thread *main = 0;
    int pid = (int)ck_getpid();
    for (uint32_t i = 0; i < im->nthreads; i++)
        if (im->threads[i].flags & CK_THREAD_MAIN)
            main = &im->threads[i];
    if (!main || main->tid != pid)
        rst_fail("corrupt image: no main thread with the process id", 0, 0);

    cur_im = im;
    saved_groups = rst_groups(im);
    saved_ngroups = im->proc->ngroups;
    uint32_t clones = 0;
    for (uint32_t i = 0; i < im->nthreads; i++) {
        const struct ck_thread *t = &im->threads[i];
        if (t == main)
            continue;
        struct rst_clone_args a;
        int32_t tid = t->tid;
        ck_memset(&a, 0, sizeof(a));
        a.flags = CLONE_VM | CLONE_FS | CLONE_FILES | CLONE_SIGHAND | CLONE_THREAD | CLONE_SYSVSEM | CLONE_SETTLS;
        if (t->clear_child_tid) {
            a.flags |= CLONE_CHILD_CLEARTID;
            a.child_tid = t->clear_child_tid;
        }
        a.tls = t->fs_base;
        a.stack = rst.hole_start + rst.stacks_off + RST_MAIN_STACK + (uint64_t)clones * RST_THREAD_STACK;
        a.stack_size = RST_THREAD_STACK;
        a.set_tid = (uint64_t)&tid;
        a.set_tid_size = 1;
        long rc = rst_clone3_thread(&a, sizeof(a), thread_entry, t);
        /* the memory fill's helper borrowed one of these ids (mem.c): it has
         * exited, but its id may take a moment more to be released */
        for (int tries = 0; rc == -EEXIST && tries < 100; tries++) {
            ck_nanosleep_ms(1);
            rc = rst_clone3_thread(&a, sizeof(a), thread_entry, t);
        }
        if (rc < 0) {
            char what[32];
            struct ck_buf b;
            ck_buf_init(&b, what, sizeof(what));
            ck_buf_str(&b, "tid ");
            ck_buf_i64(&b, tid);
            rst_fail(rc == -EEXIST ? "thread id already taken (not a fresh pid namespace?)"
                                   : "cannot recreate a thread with its id", what, rc);
        }
        clones++;
    }
    for (;;) {
        uint32_t r = __atomic_load_n(&ready, __ATOMIC_ACQUIRE);
        if (r >= clones)
            break;
        ck_futex_wait(&ready, r, 100);
    }
    rst_create_timers(im);
    __atomic_store_n(&timers_made, 1, __ATOMIC_RELEASE);
    ck_futex_wake_all(&timers_made);
    for (;;) {
        uint32_t q = __atomic_load_n(&queued, __ATOMIC_ACQUIRE);
        if (q >= clones)
            break;
        ck_futex_wait(&queued, q, 100);
    }

    ck_set_tid_address((void *)main->clear_child_tid);
    long rc = ck_arch_prctl(ARCH_SET_FS, main->fs_base);
    if (rc < 0)
        rst_fail("cannot restore the main thread's TLS base", 0, rc);
    rst_restore_limits(im);  /* while privileged: raising a hard limit needs CAP_SYS_RESOURCE */
    thread_setup(main);
    rst_restore_fd_owners(im);  /* a thread may be a SIGIO owner: now they all exist */
    rst_restore_dumpable(im);  /* every thread has its credentials now */
    rst_queue_pending(im);
    write_restart_info(im);
    rst_arm_timers(im);
    ck_close(rst.status_fd);  /* an empty status file means success */
    __atomic_store_n(&go, 1, __ATOMIC_RELEASE);
    ck_futex_wake_all(&go);
    jump_when_told(main);
}
