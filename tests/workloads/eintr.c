/*
 * Blocking calls that never retry on EINTR (test_eintr.py).
 *
 * One thread per call; each round every thread makes its call once, then
 * all meet at a barrier and the main thread prints "round N ok".  Any EINTR,
 * any unexpected result and any timed call that returns before its full
 * timeout (CLOCK_MONOTONIC, nothing subtracted) prints FAIL and exits 1.
 *
 * A control thread makes the same kind of call through a raw system call,
 * which the shim does not resume: it counts the EINTRs it sees and prints
 * the count on stderr at the end ("control: N interrupted"), proof that the
 * checkpoints did interrupt blocking calls.
 *
 * usage: eintr ROUNDS
 *
 * eintr --same-instant (under ckptd only): ckptd's quiesce signal alone
 * must not end a ppoll; with SIGUSR1 in the same instant it must (EINTR).
 */
#define _GNU_SOURCE
#include <errno.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/epoll.h>
#include <sys/select.h>
#include <sys/socket.h>
#include <sys/syscall.h>
#include <linux/futex.h>
#include <time.h>
#include <unistd.h>

#define MS 1000000LL

static int rounds;
static pthread_barrier_t barrier;
static int idle_pipe[2];    /* never written: timeouts */
static int wake_pipe[2];    /* one byte per round: poll(-1) */
static int sock[2];         /* never written: SO_RCVTIMEO */
static pthread_t susp_thread;
static volatile sig_atomic_t got_usr1;
static atomic_int stop_control;

static long long now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

static void fail(const char *what, long rc, int err, long long took, long long want)
{
    printf("FAIL %s: rc=%ld errno=%d (%s) took %lld ms of %lld ms\n", what, rc, err, strerror(err), took / MS,
           want / MS);
    fflush(stdout);
    exit(1);
}

/* a timed call must return `expect` (errno `experr` if -1) after >= want_ns */
static void check(const char *what, long rc, long expect, int experr, long long t0, long long want_ns)
{
    int err = errno;
    long long took = now_ns() - t0;
    if (rc != expect || (rc == -1 && err != experr) || took < want_ns)
        fail(what, rc, rc == -1 ? err : 0, took, want_ns);
}

typedef void (*call_fn)(void);

static void c_poll(void)
{
    struct pollfd p = {idle_pipe[0], POLLIN, 0};
    long long t0 = now_ns();
    check("poll", poll(&p, 1, 170), 0, 0, t0, 170 * MS);
}

static void c_poll_inf(void)
{
    struct pollfd p = {wake_pipe[0], POLLIN, 0};
    long long t0 = now_ns();
    check("poll(-1)", poll(&p, 1, -1), 1, 0, t0, 0);
    char c;
    if (read(wake_pipe[0], &c, 1) != 1)
        fail("read", -1, errno, 0, 0);
}

static void c_nanosleep(void)
{
    struct timespec ts = {0, 130 * MS};
    long long t0 = now_ns();
    check("nanosleep", nanosleep(&ts, NULL), 0, 0, t0, 130 * MS);
    /* wakes poll(-1) */
    if (write(wake_pipe[1], "x", 1) != 1)
        fail("write", -1, errno, 0, 0);
}

static void c_epoll(void)
{
    static int ep = -1;
    if (ep < 0) {
        ep = epoll_create1(EPOLL_CLOEXEC);
        struct epoll_event ev = {.events = EPOLLIN, .data.fd = idle_pipe[0]};
        if (ep < 0 || epoll_ctl(ep, EPOLL_CTL_ADD, idle_pipe[0], &ev) < 0)
            fail("epoll setup", -1, errno, 0, 0);
    }
    struct epoll_event out;
    long long t0 = now_ns();
    check("epoll_wait", epoll_wait(ep, &out, 1, 190), 0, 0, t0, 190 * MS);
    t0 = now_ns();
    check("epoll_pwait", epoll_pwait(ep, &out, 1, 60, NULL), 0, 0, t0, 60 * MS);
}

static void c_select(void)
{
    fd_set r;
    FD_ZERO(&r);
    FD_SET(idle_pipe[0], &r);
    struct timeval tv = {0, 150000};
    long long t0 = now_ns();
    check("select", select(idle_pipe[0] + 1, &r, NULL, NULL, &tv), 0, 0, t0, 150 * MS);
    if (tv.tv_sec || tv.tv_usec)
        fail("select left time in its timeval", 0, 0, 0, 0);
}

static void c_pselect(void)
{
    fd_set r;
    FD_ZERO(&r);
    FD_SET(idle_pipe[0], &r);
    struct timespec ts = {0, 140 * MS};
    long long t0 = now_ns();
    check("pselect", pselect(idle_pipe[0] + 1, &r, NULL, NULL, &ts, NULL), 0, 0, t0, 140 * MS);
    if (ts.tv_nsec != 140 * MS)
        fail("pselect changed its timeout", 0, 0, 0, 0);
}

static void c_ppoll(void)
{
    struct pollfd p = {idle_pipe[0], POLLIN, 0};
    struct timespec ts = {0, 160 * MS};
    long long t0 = now_ns();
    check("ppoll", ppoll(&p, 1, &ts, NULL), 0, 0, t0, 160 * MS);
}

static void c_sigtimedwait(void)
{
    sigset_t s;
    sigemptyset(&s);
    sigaddset(&s, SIGUSR2);  /* blocked everywhere, never sent */
    struct timespec ts = {0, 180 * MS};
    long long t0 = now_ns();
    check("sigtimedwait", sigtimedwait(&s, NULL, &ts), -1, EAGAIN, t0, 180 * MS);
}

static void c_sleep(void)
{
    long long t0 = now_ns();
    check("sleep", (long)sleep(1), 0, 0, t0, 1000 * MS);
}

static void c_usleep(void)
{
    long long t0 = now_ns();
    check("usleep", usleep(120000), 0, 0, t0, 120 * MS);
    /* wakes sigsuspend */
    pthread_kill(susp_thread, SIGUSR1);
}

static void c_clock_nanosleep(void)
{
    struct timespec ts = {0, 110 * MS};
    long long t0 = now_ns();
    int rc = clock_nanosleep(CLOCK_MONOTONIC, 0, &ts, NULL);
    errno = rc;
    check("clock_nanosleep", rc ? -1 : 0, 0, 0, t0, 110 * MS);
    struct timespec dl;
    clock_gettime(CLOCK_MONOTONIC, &dl);
    t0 = dl.tv_sec * 1000000000LL + dl.tv_nsec;
    dl.tv_nsec += 90 * MS;
    if (dl.tv_nsec >= 1000000000L) {
        dl.tv_sec++;
        dl.tv_nsec -= 1000000000L;
    }
    rc = clock_nanosleep(CLOCK_MONOTONIC, TIMER_ABSTIME, &dl, NULL);
    errno = rc;
    check("clock_nanosleep(TIMER_ABSTIME)", rc ? -1 : 0, 0, 0, t0, 90 * MS);
}

static void on_usr1(int sig)
{
    (void)sig;
    got_usr1 = 1;
}

/* returns EINTR only once SIGUSR1's handler ran: anything else is a FAIL */
static void c_sigsuspend(void)
{
    sigset_t none;
    sigemptyset(&none);
    long long t0 = now_ns();
    int rc = sigsuspend(&none);
    if (rc != -1 || errno != EINTR || !got_usr1)
        fail("sigsuspend returned without SIGUSR1", rc, errno, now_ns() - t0, 0);
    got_usr1 = 0;
}

static void c_futex(void)
{
    static int word;
    struct timespec ts = {0, 100 * MS};
    long long t0 = now_ns();
    check("futex", syscall(SYS_futex, &word, FUTEX_WAIT_PRIVATE, 0, &ts, NULL, 0), -1, ETIMEDOUT, t0, 100 * MS);
}

static void c_recv(void)
{
    char c;
    long long t0 = now_ns();
    /* the kernel counts SO_RCVTIMEO in jiffies (4 ms at HZ=250) from a jiffies value that can lag the
     * clock on a tickless CPU: without ckptd it was seen ending at 95 ms, so 90 ms is "not early" */
    check("recv(SO_RCVTIMEO)", recv(sock[0], &c, 1, 0), -1, EAGAIN, t0, 90 * MS);
}

static const struct {
    const char *name;
    call_fn fn;
} calls[] = {
    {"poll", c_poll},           {"poll_inf", c_poll_inf},     {"nanosleep", c_nanosleep},
    {"epoll", c_epoll},         {"select", c_select},         {"pselect", c_pselect},
    {"ppoll", c_ppoll},         {"sigtimedwait", c_sigtimedwait}, {"sleep", c_sleep},
    {"usleep", c_usleep},       {"clock_nanosleep", c_clock_nanosleep}, {"sigsuspend", c_sigsuspend},
    {"futex", c_futex},         {"recv", c_recv},
};
#define NCALLS (sizeof(calls) / sizeof(calls[0]))

static size_t ncalls = NCALLS;

/* Both signals are made pending while blocked (the quiesce signal with a
 * raw rt_sigprocmask, which the shim does not filter), then ppoll's empty
 * mask lets them in together, as when a signal lands during a pause. */
static void same_instant(void)
{
    const char *e = getenv("CKPTD_QUIESCE_SIGNAL");
    int q = e && *e ? atoi(e) : SIGRTMAX - 1;
    sigset_t both, none;
    sigemptyset(&both);
    sigaddset(&both, q);
    sigaddset(&both, SIGUSR1);
    sigemptyset(&none);
    if (syscall(SYS_rt_sigprocmask, SIG_BLOCK, &both, NULL, 8) < 0)
        fail("rt_sigprocmask", -1, errno, 0, 0);
    struct pollfd p = {idle_pipe[0], POLLIN, 0};
    struct timespec ts = {0, 100 * MS};
    syscall(SYS_tgkill, getpid(), gettid(), q);
    long long t0 = now_ns();
    check("ppoll after ckptd's signal alone", ppoll(&p, 1, &ts, &none), 0, 0, t0, 100 * MS);
    printf("ckptd's signal alone: ppoll timed out\n");
    got_usr1 = 0;
    syscall(SYS_tgkill, getpid(), gettid(), q);
    syscall(SYS_tgkill, getpid(), gettid(), SIGUSR1);
    t0 = now_ns();
    int rc = ppoll(&p, 1, NULL, &none);
    if (rc != -1 || errno != EINTR || !got_usr1)
        fail("ppoll with SIGUSR1 in the same instant", rc, errno, now_ns() - t0, 0);
    printf("with SIGUSR1 in the same instant: EINTR\n");
}

static void *worker(void *arg)
{
    call_fn fn = (call_fn)arg;
    for (int r = 0; r < rounds; r++) {
        fn();
        pthread_barrier_wait(&barrier);  /* main prints the round */
        pthread_barrier_wait(&barrier);
    }
    return NULL;
}

/* the same kind of wait, as a raw system call the shim does not resume */
static void *control(void *arg)
{
    long *interrupted = arg;
    while (!atomic_load(&stop_control)) {
        struct timespec ts = {0, 50 * MS};
        if (syscall(SYS_ppoll, NULL, 0, &ts, NULL, 8) < 0 && errno == EINTR)
            (*interrupted)++;
    }
    return NULL;
}

int main(int argc, char **argv)
{
    rounds = argc > 1 ? atoi(argv[1]) : 10;
    sigset_t s;
    sigemptyset(&s);
    sigaddset(&s, SIGUSR1);
    sigaddset(&s, SIGUSR2);
    pthread_sigmask(SIG_BLOCK, &s, NULL);  /* every thread inherits it */
    struct sigaction sa;
    memset(&sa, 0, sizeof(sa));
    sa.sa_handler = on_usr1;
    sigemptyset(&sa.sa_mask);
    if (sigaction(SIGUSR1, &sa, NULL) < 0 || pipe(idle_pipe) < 0 || pipe(wake_pipe) < 0 ||
        socketpair(AF_UNIX, SOCK_STREAM, 0, sock) < 0)
        fail("setup", -1, errno, 0, 0);
    /* the shim counts the program's handlers behind its back: the program
     * still reads back the handler it installed */
    struct sigaction back;
    if (sigaction(SIGUSR1, NULL, &back) < 0 || back.sa_handler != on_usr1 || (back.sa_flags & SA_SIGINFO))
        fail("sigaction reads back another handler", 0, 0, 0, 0);
    if (argc > 1 && !strcmp(argv[1], "--same-instant")) {
        same_instant();
        return 0;
    }
    struct timeval tv = {0, 100000};
    if (setsockopt(sock[0], SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv)) < 0)
        fail("setsockopt", -1, errno, 0, 0);
    pthread_barrier_init(&barrier, NULL, (unsigned)ncalls + 1);
    pthread_t t[NCALLS], ctl;
    long interrupted = 0;
    for (size_t i = 0; i < ncalls; i++) {
        pthread_create(&t[i], NULL, worker, (void *)calls[i].fn);
        if (calls[i].fn == c_sigsuspend)
            susp_thread = t[i];
    }
    pthread_create(&ctl, NULL, control, &interrupted);
    for (int r = 0; r < rounds; r++) {
        pthread_barrier_wait(&barrier);
        printf("round %d ok:", r);
        for (size_t i = 0; i < ncalls; i++)
            printf(" %s", calls[i].name);
        printf("\n");
        fflush(stdout);
        pthread_barrier_wait(&barrier);
    }
    for (size_t i = 0; i < ncalls; i++)
        pthread_join(t[i], NULL);
    atomic_store(&stop_control, 1);
    pthread_join(ctl, NULL);
    printf("done: %d rounds\n", rounds);
    fprintf(stderr, "control: %ld interrupted\n", interrupted);
    return 0;
}
