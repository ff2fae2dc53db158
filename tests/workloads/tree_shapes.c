/*
 * Process-tree shapes a restart must give back exactly (issue 18), checked
 * from inside with state_check.h:
 *
 *   tree_shapes SHAPE [STEPS]
 *
 * The main process makes SHAPE, then checks at every step the pid, parent,
 * process group and session of every process of it (from /proc), and that
 * the sessions and groups whose leader has exited still have none:
 *
 *   setsid      an orphan that made its own session (sh -c '(setsid sleep &)')
 *   pgleader    an orphan leading a process group of its own in the main
 *               process's session, with a child in that group
 *   lostsession an orphan (with a child, and a grandchild leading another
 *               group) in a session whose leader has exited
 *   lostgroup   an orphan (with a child) in a process group whose leader
 *               has exited, in the main process's session
 *   nested      an orphan leading its own session, and an orphan in that
 *               session (its parent, the leader's child, exited)
 *   daemon      a double-forked daemon: fork, exit, setsid, fork, exit
 *
 * Each long-lived process reports its pid once the process it waits to see
 * exit is gone, then idles with its output on /dev/null until the main
 * process ends.
 */
#define _GNU_SOURCE
#include "state_check.h"

#include <fcntl.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#define MAX 8

struct ids {
    int pid, ppid, pgid, sid;
};

static int report_w = -1;
static pid_t main_pid;
static struct ids seen[MAX];
static int nseen;
static int gone[2 * MAX];  /* the groups and sessions without a live member as leader */
static int ngone;

static int ids_of(int pid, struct ids *out)
{
    char path[64], buf[512];
    snprintf(path, sizeof(path), "/proc/%d/stat", pid);
    int fd = open(path, O_RDONLY);
    if (fd < 0)
        return -1;
    ssize_t n = read(fd, buf, sizeof(buf) - 1);
    close(fd);
    if (n <= 0)
        return -1;
    buf[n] = 0;
    char *p = strrchr(buf, ')');
    char state;
    out->pid = pid;
    if (!p || sscanf(p + 1, " %c %d %d %d", &state, &out->ppid, &out->pgid, &out->sid) != 4)
        return -1;
    return 0;
}

/* idle until the main process is gone, reporting this process once `wait_for` has exited */
static void live(pid_t wait_for) __attribute__((noreturn));
static void live(pid_t wait_for)
{
    while (wait_for > 0 && getppid() == wait_for)
        step_sleep_ms(5);
    int me = getpid();
    if (write(report_w, &me, sizeof(me)) != sizeof(me))
        _exit(3);
    close(report_w);
    int null = open("/dev/null", O_RDWR);
    dup2(null, 1);
    dup2(null, 2);
    close(null);
    while (kill(main_pid, 0) == 0)
        step_sleep_ms(50);
    _exit(0);
}

static pid_t fork_or_die(void)
{
    pid_t p = fork();
    if (p < 0) {
        perror("fork");
        exit(2);
    }
    return p;
}

/* makes the shape in children; returns how many processes report */
static int make(const char *shape)
{
    pid_t a = fork_or_die();
    if (a > 0) {
        waitpid(a, 0, 0);
        return !strcmp(shape, "setsid") || !strcmp(shape, "daemon") ? 1 : !strcmp(shape, "lostsession") ? 3 : 2;  /* nested: 2 */
    }
    /* in the intermediate process A, which exits once its descendants are made */
    pid_t self = getpid();
    if (!strcmp(shape, "setsid")) {
        if (fork_or_die() == 0) {
            while (getppid() == self)
                step_sleep_ms(5);
            setsid();
            live(0);
        }
    } else if (!strcmp(shape, "pgleader")) {
        if (fork_or_die() == 0) {
            setpgid(0, 0);
            if (fork_or_die() == 0)
                live(0);
            live(self);
        }
    } else if (!strcmp(shape, "lostsession")) {
        setsid();
        if (fork_or_die() == 0) {
            if (fork_or_die() == 0) {
                if (fork_or_die() == 0) {
                    setpgid(0, 0);
                    live(0);
                }
                live(0);
            }
            live(self);
        }
    } else if (!strcmp(shape, "lostgroup")) {
        setpgid(0, 0);
        if (fork_or_die() == 0) {
            if (fork_or_die() == 0)
                live(0);
            live(self);
        }
    } else if (!strcmp(shape, "nested")) {
        if (fork_or_die() == 0) {
            while (getppid() == self)
                step_sleep_ms(5);
            setsid();
            if (fork_or_die() == 0) {
                pid_t c = getpid();
                if (fork_or_die() == 0)
                    live(c);
                step_sleep_ms(20);
                _exit(0);
            }
            live(0);
        }
    } else if (!strcmp(shape, "daemon")) {
        if (fork_or_die() == 0) {
            pid_t b = getpid();
            while (getppid() == self)
                step_sleep_ms(5);
            setsid();
            if (fork_or_die() == 0)
                live(b);
            _exit(0);
        }
    } else {
        _exit(2);
    }
    step_sleep_ms(20);
    _exit(0);
}

static void check(int step)
{
    (void)step;
    for (int i = 0; i < nseen; i++) {
        struct ids now;
        CHECK(ids_of(seen[i].pid, &now) == 0, "process %d is gone", i);
        CHECK(now.ppid == seen[i].ppid, "process %d: parent %d, not %d", i, now.ppid, seen[i].ppid);
        CHECK(now.pgid == seen[i].pgid, "process %d: process group %d, not %d", i, now.pgid, seen[i].pgid);
        CHECK(now.sid == seen[i].sid, "process %d: session %d, not %d", i, now.sid, seen[i].sid);
    }
    for (int i = 0; i < ngone; i++)
        CHECK(kill(gone[i], 0) < 0 && errno == ESRCH, "a process has the id of an exited leader");
}

static int known(int id)
{
    for (int i = 0; i < nseen; i++)
        if (seen[i].pid == id)
            return 1;
    for (int i = 0; i < ngone; i++)
        if (gone[i] == id)
            return 1;
    return 0;
}

int main(int argc, char **argv)
{
    if (argc < 2) {
        fprintf(stderr, "usage: tree_shapes SHAPE [STEPS]\n");
        return 2;
    }
    main_pid = getpid();
    setsid();  /* as the job's first process is, under ckptd */
    int rep[2];
    CHECK(pipe(rep) == 0, "pipe");
    report_w = rep[1];
    int n = make(argv[1]);
    close(rep[1]);
    CHECK(ids_of(main_pid, &seen[nseen++]) == 0, "own /proc");
    for (int i = 0; i < n; i++) {
        int pid;
        CHECK(read(rep[0], &pid, sizeof(pid)) == sizeof(pid), "a process did not report");
        CHECK(ids_of(pid, &seen[nseen++]) == 0, "/proc of a reported process");
    }
    close(rep[0]);
    for (int i = 0; i < nseen; i++)
        for (int k = 0; k < 2; k++) {
            int id = k ? seen[i].sid : seen[i].pgid;
            /* an exited leader orphaned to the host's init may not be reaped yet */
            for (int t = 0; !known(id) && t < 500; t++) {
                if (kill(id, 0) < 0 && errno == ESRCH)
                    gone[ngone++] = id;
                else
                    step_sleep_ms(10);
            }
        }
    printf("shape %s: %d processes, %d exited leaders\n", argv[1], nseen, ngone);
    int rc = run_steps(steps_of(argc - 1, argv + 1), check);
    for (int i = 1; i < nseen; i++)
        kill(seen[i].pid, SIGKILL);
    return rc;
}
