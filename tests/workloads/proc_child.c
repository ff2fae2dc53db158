/*
 * A job that keeps /proc/<pid>/status of its own grandchild open (a path
 * into the job's own pid namespace) and reads it again at every step: it
 * must still describe that process after a restart (issue 18), never
 * whatever process has that pid on the host.  A grandchild: on a restart
 * it is forked by the child while the main process reopens the file.
 *
 *   proc_child [STEPS]
 */
#define _GNU_SOURCE
#include "state_check.h"

#include <fcntl.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

static pid_t child, grandchild;
static int fd = -1;

/* the value of a "Key:\tN" line of the status file */
static long field(const char *buf, const char *key)
{
    const char *p = strstr(buf, key);
    return p ? strtol(p + strlen(key), 0, 10) : -1;
}

static void check(int step)
{
    (void)step;
    char buf[4096];
    ssize_t n = pread(fd, buf, sizeof(buf) - 1, 0);
    CHECK(n > 0, "pread /proc/<child>/status");
    buf[n] = 0;
    CHECK(field(buf, "\nPid:") == grandchild, "the file describes pid %ld", field(buf, "\nPid:"));
    CHECK(field(buf, "\nPPid:") == child, "the file describes a process whose parent is %ld", field(buf, "\nPPid:"));
}

/* under ckptd (pid 2 of the job's pid namespace): the child gets a pid that
 * the host almost surely does not use, so that a check against the host's
 * /proc would fail, not pass by chance on a kernel thread's pid */
static void high_pid(void)
{
    FILE *f = fopen("/proc/sys/kernel/pid_max", "r");
    long max = 0;
    if (f && fscanf(f, "%ld", &max) != 1)
        max = 0;
    if (f)
        fclose(f);
    f = fopen("/proc/sys/kernel/ns_last_pid", "w");
    CHECK(f && max > 2000 && fprintf(f, "%ld", max - 1000) > 0 && fclose(f) == 0, "ns_last_pid");
}

int main(int argc, char **argv)
{
    if (getpid() == 2)
        high_pid();
    int rep[2];
    CHECK(pipe(rep) == 0, "pipe");
    child = fork();
    if (child == 0) {
        pid_t c = getpid();
        pid_t g = fork();
        if (g == 0) {
            while (getppid() == c)  /* never outlives the test (a plain run has no pid namespace to end) */
                step_sleep_ms(50);
            _exit(0);
        }
        if (write(rep[1], &g, sizeof(g)) != sizeof(g))
            _exit(1);
        for (;;)
            pause();
    }
    CHECK(child > 0, "fork");
    CHECK(read(rep[0], &grandchild, sizeof(grandchild)) == sizeof(grandchild), "the grandchild's pid");
    close(rep[0]);
    close(rep[1]);
    char path[64];
    snprintf(path, sizeof(path), "/proc/%d/status", (int)grandchild);
    fd = open(path, O_RDONLY);
    CHECK(fd >= 0, "open %s", path);
    int rc = run_steps(steps_of(argc, argv), check);
    kill(grandchild, SIGKILL);
    kill(child, SIGKILL);
    waitpid(child, 0, 0);
    return rc;
}
