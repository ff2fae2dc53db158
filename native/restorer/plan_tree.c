/*
 * The process tree in the restore plan (plan.c has the format), built once
 * every shared object exists:
 *   proc PID PPID PGID SID DIR     zombie PID PPID PGID SID WSTATUS
 *   helper PID SID                 a session or group whose leader had exited:
 *                                  made again by a temporary child of init
 *   ctty SID SLAVE SLOT PGRP       session SID's controlling terminal: the pty
 *                                  at SLOT (its slave if SLAVE is 1), PGRP in front
 * Each process forks its children with their old pids (clone3 set_tid),
 * takes its session and process group, then execs `ckptd-restore IMAGE_DIR
 * --plan PLAN` for its own image.  Zombies are recreated by a child that
 * exits at once.  Orphans are forked with CLONE_PARENT by a child of init
 * in their session; a session or group whose leader had exited by a helper
 * process with the leader's pid, gone before the job runs.  Nobody execs
 * its restorer before the whole tree exists (wait_tree).  A session
 * leader takes its controlling terminal back (TIOCSCTTY) before it forks,
 * so the members of its session inherit it, and puts its foreground group
 * back once every group exists.
 */
#include "plan.h"
#include "../common/pty.h"

#include <errno.h>

#ifndef CLONE_PARENT
#define CLONE_PARENT 0x00008000
#endif
#define MAX_PROCS 1024

struct rst_clone_args {
    uint64_t flags, pidfd, child_tid, parent_tid, exit_signal, stack, stack_size, tls, set_tid, set_tid_size, cgroup;
};

struct plan_proc {
    int pid, ppid, pgid, sid;
    int zombie, helper, wstatus;
    char dir[1024];
};

static struct plan_proc *procs;
static int nprocs;

#define MAX_CTTYS 64
static struct {
    int sid, slave, fd, pgrp;
} cttys[MAX_CTTYS];
static int ncttys;
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
    while (plan_next_line(&cur, buf + size, &l)) {
        if (!l.ntok)
            continue;
        if (!ck_strcmp(l.tok[0], "ctty")) {
            if (ncttys >= MAX_CTTYS)
                rst_fail("too many controlling terminals in the restore plan", 0, 0);
            cttys[ncttys].sid = (int)num(&l, 1);
            cttys[ncttys].slave = (int)num(&l, 2);
            cttys[ncttys].fd = slot_fd(&l, 3);
            cttys[ncttys++].pgrp = (int)num(&l, 4);
            continue;
        }
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
 * CLONE_PARENT: a child of init in its session (ckptd/image/plan/tree.py checks there is one) */
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

/* a session leader's controlling terminal, taken back (TIOCSCTTY): the
 * descriptor it was taken through, or -1 (no ctty line for its session) */
static int take_ctty(const struct plan_proc *p, int *pgrp)
{
    for (int i = 0; i < ncttys; i++) {
        if (cttys[i].sid != p->pid)
            continue;
        long fd = cttys[i].fd;
        if (cttys[i].slave)
            fd = ck_ioctl(cttys[i].fd, CK_TIOCGPTPEER, (void *)(long)(O_RDWR | O_NOCTTY | O_CLOEXEC));
        long rc = fd < 0 ? fd : ck_ioctl((int)fd, CK_TIOCSCTTY, 0);
        if (rc < 0)
            rst_fail("cannot give a session its controlling terminal again (TIOCSCTTY)", 0, rc);
        *pgrp = cttys[i].pgrp;
        return cttys[i].slave ? (int)fd : -2;
    }
    return -1;
}

/* its foreground process group, once every group exists; fd: take_ctty's */
static void set_foreground(const struct plan_proc *p, int fd, int pgrp)
{
    int peer = fd >= 0;
    for (int i = 0; i < ncttys && !peer; i++)
        if (cttys[i].sid == p->pid)
            fd = cttys[i].fd;
    if (pgrp > 0 && pgrp != p->pgid) {
        long rc = ck_ioctl(fd, CK_TIOCSPGRP, &pgrp);
        if (rc < 0)
            rst_fail("cannot give a controlling terminal its foreground process group again (TIOCSPGRP)", 0, rc);
    }
    if (peer)
        ck_close(fd);
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
    int ctty_pgrp = 0, ctty = p->sid == p->pid && !p->zombie && !p->helper ? take_ctty(p, &ctty_pgrp) : -1;
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
    if (ctty != -1)
        set_foreground(p, ctty, ctty_pgrp);
    exec_restorer(p);
}

/* the proc, zombie and helper lines; this process is pid 2 */
void plan_build_tree(char *buf, uint64_t size)
{
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
