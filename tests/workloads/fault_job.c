/*
 * The job of the fault-injection matrix (tests/test_fault_matrix_process.py):
 * two processes joined by a pipe, the parent with 24 MiB of memory it
 * rewrites a slice of at every step (so each checkpoint forks a writer
 * with something to write).  Every step checks, from inside, the whole
 * memory against its expected sum and the number the pipe carried.  At
 * step 4 it waits until the file argv[1] exists, at step 7 until
 * argv[1] with a "2" appended does: the test's faults happen while it
 * waits, so a slow machine cannot let it run past them or finish first.
 */
#include "state_check.h"

#include <signal.h>
#include <stdint.h>
#include <sys/wait.h>
#include <unistd.h>

#define SIZE (24u << 20)
#define SLICE (SIZE / 64)

static const char *go;
static char go2[4096];
static unsigned char *mem;
static uint64_t expected;
static int to_child;

static uint64_t sum(void)
{
    uint64_t s = 0;
    for (size_t i = 0; i < SIZE; i += 512)
        s = s * 31 + mem[i];
    return s;
}

static void check(int step)
{
    const char *wait_for = step == 4 ? go : step == 7 ? go2 : NULL;
    while (wait_for && access(wait_for, F_OK) != 0)
        step_sleep_ms(20);
    CHECK(sum() == expected, "memory changed under the job at step %d", step);
    memset(mem + (size_t)(step % 64) * SLICE, step & 0xff, SLICE);
    expected = sum();
    CHECK(write(to_child, &step, sizeof(step)) == sizeof(step), "pipe write at step %d", step);
}

int main(int argc, char **argv)
{
    go = argc > 1 ? argv[1] : "/";
    int steps = argc > 2 ? atoi(argv[2]) : 9;
    snprintf(go2, sizeof(go2), "%s2", go);
    int fds[2];
    CHECK(pipe(fds) == 0, "pipe");
    pid_t child = fork();
    CHECK(child >= 0, "fork");
    if (child == 0) {
        close(fds[1]);
        for (int want = 1;; want++) {
            int got;
            ssize_t n = read(fds[0], &got, sizeof(got));
            if (n == 0)
                _exit(0);
            if (n != sizeof(got) || got != want) {
                printf("BAD child: step %d read %d (%zd bytes)\n", want, got, n);
                fflush(stdout);
                _exit(1);
            }
        }
    }
    close(fds[0]);
    to_child = fds[1];
    mem = malloc(SIZE);
    CHECK(mem != NULL, "malloc");
    for (size_t i = 0; i < SIZE; i++)
        mem[i] = (unsigned char)(i * 7);
    expected = sum();
    int rc = run_steps(steps, check);
    close(to_child);
    int status;
    CHECK(waitpid(child, &status, 0) == child && WIFEXITED(status) && WEXITSTATUS(status) == 0, "child");
    return rc;
}
