/*
 * SIGTERM under ckptd (issue 16, preemption; native/shim/sigterm.c).  A
 * process and its child, both checked at every step:
 *   default  SIGTERM at its default disposition: sigaction reads back
 *            SIG_DFL (never the shim's hidden handler), in both processes,
 *            before and after a restart;
 *   handler  the main process installs its own SIGTERM handler: it reads it
 *            back, and each SIGTERM it takes is printed at the next step;
 *   killchild at step 5 the main process SIGTERMs its child, which must die
 *            of it at once (a SIGTERM from inside the job is not held).
 * The child waits on a pipe the parent closes at the end, then exits.
 *
 *   sigterm_hold [STEPS] [default|handler|killchild]
 */
#define _GNU_SOURCE
#include "state_check.h"

#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

static volatile sig_atomic_t terms;
static int seen_terms, own_handler;

static void on_term(int sig)
{
    (void)sig;
    terms++;
}

static void check_disposition(int own)
{
    struct sigaction sa;
    CHECK(sigaction(SIGTERM, 0, &sa) == 0, "sigaction(SIGTERM) read");
    if (own)
        CHECK(sa.sa_handler == on_term, "SIGTERM reads back %p, not the program's own handler", (void *)sa.sa_handler);
    else
        CHECK(sa.sa_handler == SIG_DFL && !(sa.sa_flags & SA_SIGINFO), "SIGTERM reads back %p, not SIG_DFL",
              (void *)sa.sa_handler);
}

static void check(int step)
{
    (void)step;
    check_disposition(own_handler);
    if (terms != seen_terms) {
        seen_terms = terms;
        printf("got SIGTERM\n");
    }
}

int main(int argc, char **argv)
{
    own_handler = argc > 2 && !strcmp(argv[2], "handler");
    int kill_child = argc > 2 && !strcmp(argv[2], "killchild");
    int end[2], rep[2];
    CHECK(pipe(end) == 0 && pipe(rep) == 0, "pipe");
    pid_t child = fork();
    CHECK(child >= 0, "fork");
    if (child == 0) {
        close(end[1]);
        close(rep[0]);
        char c;
        /* one report per byte the parent asks for, until the pipe closes */
        while (read(end[0], &c, 1) == 1) {
            struct sigaction sa;
            int ok = sigaction(SIGTERM, 0, &sa) == 0 && sa.sa_handler == SIG_DFL;
            CHECK(write(rep[1], ok ? "y" : "n", 1) == 1, "child write");
        }
        _exit(0);
    }
    close(end[0]);
    close(rep[1]);
    if (own_handler) {
        struct sigaction sa;
        memset(&sa, 0, sizeof(sa));
        sa.sa_handler = on_term;
        CHECK(sigaction(SIGTERM, &sa, 0) == 0, "sigaction(SIGTERM, handler)");
    }
    int steps = steps_of(argc, argv);
    setvbuf(stdout, 0, _IOLBF, 0);
    int st;
    for (int i = 1; i <= steps; i++) {
        check(i);
        if (kill_child && i == 5) {
            struct timespec t0, t1;
            clock_gettime(CLOCK_MONOTONIC, &t0);
            CHECK(kill(child, SIGTERM) == 0 && waitpid(child, &st, 0) == child, "kill the child");
            clock_gettime(CLOCK_MONOTONIC, &t1);
            CHECK(WIFSIGNALED(st) && WTERMSIG(st) == SIGTERM, "the child ended with status %d, not of SIGTERM", st);
            CHECK(t1.tv_sec - t0.tv_sec < 2, "the child took %ld s to die of SIGTERM", (long)(t1.tv_sec - t0.tv_sec));
            printf("child killed\n");
            child = 0;
        }
        if (child) {
            char c;
            CHECK(write(end[1], "?", 1) == 1 && read(rep[0], &c, 1) == 1, "child report");
            CHECK(c == 'y', "the child reads back SIGTERM as something other than SIG_DFL");
        }
        printf("step %d ok\n", i);
        step_sleep_ms(100);
    }
    close(end[1]);
    if (child)
        CHECK(waitpid(child, &st, 0) == child && WIFEXITED(st) && WEXITSTATUS(st) == 0, "child ended with %d", st);
    printf("done\n");
    return 0;
}
