/*
 * The frame of the kernel-state programs (tests/test_exact_*.py, issue 18
 * "Exact or refused").  A program sets some kernel state up, then checks
 * it from inside, once per step, while the test checkpoints it, SIGKILLs
 * it and restarts it (conftest.exact_round_trip).  A difference prints
 * "BAD file:line: what" and exits 1; every good step prints "step N ok",
 * and the last line is "done": an uninterrupted run prints the same bytes.
 */
#ifndef CKPTD_TEST_STATE_CHECK_H
#define CKPTD_TEST_STATE_CHECK_H

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#define CHECK(cond, ...)                                                   \
    do {                                                                   \
        if (!(cond)) {                                                     \
            printf("BAD %s:%d: ", __FILE__, __LINE__);                     \
            printf(__VA_ARGS__);                                           \
            printf(" (errno %d)\n", errno);                                \
            fflush(stdout);                                                \
            exit(1);                                                       \
        }                                                                  \
    } while (0)

static inline void step_sleep_ms(long ms)
{
    struct timespec ts = {ms / 1000, (ms % 1000) * 1000000L};
    while (nanosleep(&ts, &ts) < 0 && errno == EINTR)
        ;
}

/* argv[1]: the number of steps (default 60), one every 100 ms */
static inline int steps_of(int argc, char **argv)
{
    return argc > 1 ? atoi(argv[1]) : 60;
}

/* check(step) once per step; returns the program's exit status */
static inline int run_steps(int nsteps, void (*check)(int step))
{
    setvbuf(stdout, 0, _IOLBF, 0);
    for (int i = 1; i <= nsteps; i++) {
        check(i);
        printf("step %d ok\n", i);
        step_sleep_ms(100);
    }
    printf("done\n");
    return 0;
}

#endif
