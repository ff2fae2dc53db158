/*
 * Process states ckptd cannot restore exactly, so a checkpoint must be
 * refused with the real cause while the job runs on (issue 18):
 *
 *   exact_refused stopped [STEPS]     a child stopped by SIGSTOP (its parent
 *                                     saw it stop, and continues it at the end)
 *   exact_refused novdso [STEPS]      the process unmapped its [vdso]
 *   exact_refused clonefiles [STEPS]  a child made by clone(CLONE_FILES): two
 *                                     processes with one descriptor table
 *
 * Then the usual steps (state_check.h), checking the state still holds.
 */
#define _GNU_SOURCE
#include "state_check.h"

#include <fcntl.h>
#include <sched.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

static pid_t child;
static int child_fd = -1;  /* clonefiles: opened by the child, seen by the parent */

static int idle(void *arg)
{
    int *fd = arg;
    if (fd)
        *fd = open("/dev/null", O_RDONLY);  /* in the shared table; the parent finds it by number */
    for (;;)
        pause();
    return 0;
}

static int proc_state(pid_t pid)
{
    char path[64], buf[512];
    snprintf(path, sizeof(path), "/proc/%d/stat", pid);
    int fd = open(path, O_RDONLY);
    if (fd < 0)
        return '?';
    ssize_t n = read(fd, buf, sizeof(buf) - 1);
    close(fd);
    if (n <= 0)
        return '?';
    buf[n] = 0;
    char *p = strrchr(buf, ')');
    return p ? p[2] : '?';
}

static int has_vdso(void)
{
    FILE *f = fopen("/proc/self/maps", "r");
    char line[512];
    int found = 0;
    while (f && fgets(line, sizeof(line), f))
        if (strstr(line, "[vdso]"))
            found = 1;
    if (f)
        fclose(f);
    return found;
}

static void unmap_vdso(void)
{
    FILE *f = fopen("/proc/self/maps", "r");
    char line[512];
    unsigned long start = 0, end = 0;
    while (f && fgets(line, sizeof(line), f))
        if (strstr(line, "[vdso]"))
            sscanf(line, "%lx-%lx", &start, &end);
    CHECK(f && start, "no [vdso] to unmap");
    fclose(f);
    CHECK(munmap((void *)start, end - start) == 0, "munmap [vdso]");
}

static const char *mode;

static void check(int step)
{
    (void)step;
    if (!strcmp(mode, "stopped")) {
        CHECK(proc_state(child) == 'T', "the child is not stopped");
    } else if (!strcmp(mode, "novdso")) {
        CHECK(!has_vdso(), "a [vdso] is back");
    } else {
        CHECK(fcntl(child_fd, F_GETFD) >= 0, "the child's descriptor is not in the shared table");
    }
}

int main(int argc, char **argv)
{
    if (argc < 2) {
        fprintf(stderr, "usage: exact_refused stopped|novdso|clonefiles [STEPS]\n");
        return 2;
    }
    mode = argv[1];
    if (!strcmp(mode, "stopped")) {
        child = fork();
        if (child == 0)
            idle(0);
        CHECK(child > 0, "fork");
        CHECK(kill(child, SIGSTOP) == 0, "SIGSTOP");
        int st;
        CHECK(waitpid(child, &st, WUNTRACED) == child && WIFSTOPPED(st), "the parent did not see it stop");
    } else if (!strcmp(mode, "novdso")) {
        unmap_vdso();
    } else if (!strcmp(mode, "clonefiles")) {
        static char stack[64 << 10];
        static int fd = -1;
        child_fd = dup(0);  /* the lowest free number: where the child's open lands */
        close(child_fd);
        child = clone(idle, stack + sizeof(stack), CLONE_FILES | SIGCHLD, &fd);
        CHECK(child > 0, "clone(CLONE_FILES)");
        for (int i = 0; i < 500 && fcntl(child_fd, F_GETFD) < 0; i++)
            step_sleep_ms(10);
    } else {
        fprintf(stderr, "unknown mode %s\n", mode);
        return 2;
    }
    printf("%s ready\n", mode);
    int rc = run_steps(steps_of(argc - 1, argv + 1), check);
    if (child > 0) {
        kill(child, SIGKILL);
        kill(child, SIGCONT);
        waitpid(child, 0, 0);
    }
    return rc;
}
