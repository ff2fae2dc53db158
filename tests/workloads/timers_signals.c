/*
 * POSIX timers and signal queues, checked from inside at every step
 * (issue 19; tests/test_timers_signals.py).  argv: steps, mode.
 *
 *   signal    DMTCP's timer1 and more: two periodic SIGEV_SIGNAL timers on
 *             one signal, whose handler follows sival_ptr to the timer id
 *             and asks timer_getoverrun (it must equal si_overrun); a
 *             one-shot; a SIGEV_NONE "stopwatch" (1000 s, one-shot) whose
 *             remaining time is the job's own clock; ids with gaps (timers
 *             deleted); a timer created late, whose id is printed; a slow
 *             timer whose signal is taken late (with an overrun), whose
 *             timer_getoverrun() must then stay that overrun.  Every
 *             step: each periodic timer's expirations (signals + overruns)
 *             match the stopwatch, the one-shot fired when it should, the
 *             deleted ids are gone and the others answer.
 *   threads   three threads, each with a SIGEV_THREAD_ID timer aimed at
 *             itself, its signal blocked and taken with sigtimedwait every
 *             70 ms (so overruns pile up): expirations against the
 *             stopwatch, sigev_value, si_timerid, and timer_getoverrun
 *             (the last signal's overrun, while none is pending).
 *   sigev_thread  a SIGEV_THREAD timer (20 ms): its function runs in a
 *             thread of its own with the program's value, between every
 *             two steps; its interval and time left answer.
 *   sigev_thread_attr  one made with thread attributes: refused.
 *   rtqueue   RT signal queues at depth: the process-wide queue of one RT
 *             signal (16 deep, one taken and one queued per step, FIFO by
 *             payload), a standard signal with its payload, and a sender
 *             thread keeping 16 of another RT signal queued on each of
 *             three threads, which take them in order all the time; and
 *             a one-shot ITIMER_REAL re-armed every 2 ms, whose SIGALRM
 *             often arrives while the threads are parked (it must come
 *             back as the kernel's, not as a bare signal raised again).
 */
#define _GNU_SOURCE
#include "state_check.h"

#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <sys/syscall.h>
#include <sys/time.h>
#include <unistd.h>

#define MS 1000000LL

static timer_t stopwatch;
static int64_t ns_of(const struct timespec *t) { return (int64_t)t->tv_sec * 1000000000LL + t->tv_nsec; }

/* the job's own clock: 1000 s less the stopwatch's remaining time */
static int64_t elapsed(void)
{
    struct itimerspec v;
    CHECK(timer_gettime(stopwatch, &v) == 0, "timer_gettime(stopwatch)");
    return 1000000 * MS - ns_of(&v.it_value);
}

static void start_stopwatch(void)
{
    struct sigevent ev = {.sigev_notify = SIGEV_NONE};
    CHECK(timer_create(CLOCK_MONOTONIC, &ev, &stopwatch) == 0, "timer_create(stopwatch)");
    struct itimerspec v = {.it_value = {1000, 0}};
    CHECK(timer_settime(stopwatch, 0, &v, 0) == 0, "timer_settime(stopwatch)");
}

static void arm(timer_t t, int64_t value, int64_t interval)
{
    struct itimerspec v = {{interval / 1000000000LL, interval % 1000000000LL}, {value / 1000000000LL, value % 1000000000LL}};
    CHECK(timer_settime(t, 0, &v, 0) == 0, "timer_settime");
}

/* expirations so far of a timer of period p started with the stopwatch:
 * between what elapsed before the count was read (less `lag` periods, for
 * a handler the signal has not reached yet, and one for timers re-armed a
 * little apart) and after it */
static void check_count(const char *what, long count, int64_t before, int64_t after, int64_t p, long lag)
{
    long lo = (long)(before / p) - 1 - lag, hi = (long)(after / p) + 1;
    CHECK(count >= lo && count <= hi, "%s: %ld expirations, expected %ld..%ld", what, count, lo, hi);
}

/* ---- signal ---- */
#define P1 (20 * MS)
#define P2 (30 * MS)
#define ONESHOT (4050 * MS)
#define PSLOW (1500 * MS)
static timer_t ids[2], oneshot, gap[2], slow;
static long slow_count, slow_last;
static volatile long counts[2];
static volatile int oneshot_fired, bad_overrun;

static void on_timer(int sig, siginfo_t *si, void *uc)
{
    (void)sig, (void)uc;
    timer_t *t = si->si_value.sival_ptr;  /* as DMTCP's timer1 */
    int i = t == &ids[0] ? 0 : t == &ids[1] ? 1 : -1;
    if (i < 0 || si->si_code != SI_TIMER || timer_getoverrun(*t) != si->si_overrun) {
        bad_overrun = 1;
        return;
    }
    counts[i] += 1 + si->si_overrun;
}

static void on_oneshot(int sig, siginfo_t *si, void *uc)
{
    (void)sig, (void)uc;
    if (si->si_value.sival_int != 77)
        bad_overrun = 1;
    oneshot_fired++;
}

static void setup_signal(void)
{
    struct sigaction sa = {.sa_sigaction = on_timer, .sa_flags = SA_SIGINFO | SA_RESTART};
    sigemptyset(&sa.sa_mask);
    CHECK(sigaction(SIGRTMIN, &sa, 0) == 0, "sigaction");
    sa.sa_sigaction = on_oneshot;
    CHECK(sigaction(SIGRTMIN + 1, &sa, 0) == 0, "sigaction");
    start_stopwatch();                     /* id 0 */
    struct sigevent ev = {.sigev_notify = SIGEV_SIGNAL, .sigev_signo = SIGRTMIN};
    CHECK(timer_create(CLOCK_MONOTONIC, &ev, &gap[0]) == 0, "timer_create");  /* id 1, deleted */
    ev.sigev_value.sival_ptr = &ids[0];
    CHECK(timer_create(CLOCK_REALTIME, &ev, &ids[0]) == 0, "timer_create");   /* id 2 */
    CHECK(timer_create(CLOCK_MONOTONIC, &ev, &gap[1]) == 0, "timer_create");  /* id 3, deleted */
    CHECK(timer_create(CLOCK_MONOTONIC, &ev, &gap[1]) == 0, "timer_create");  /* id 4, deleted */
    ev.sigev_value.sival_ptr = &ids[1];
    CHECK(timer_create(CLOCK_BOOTTIME, &ev, &ids[1]) == 0, "timer_create");   /* id 5 */
    ev.sigev_signo = SIGRTMIN + 1;
    ev.sigev_value.sival_int = 77;
    CHECK(timer_create(CLOCK_MONOTONIC, &ev, &oneshot) == 0, "timer_create"); /* id 6 */
    ev.sigev_signo = SIGRTMIN + 2;
    ev.sigev_value.sival_int = 88;
    CHECK(timer_create(CLOCK_MONOTONIC, &ev, &slow) == 0, "timer_create");    /* id 7 */
    sigset_t set;
    sigemptyset(&set);
    sigaddset(&set, SIGRTMIN + 2);
    CHECK(sigprocmask(SIG_BLOCK, &set, 0) == 0, "sigprocmask");
    timer_delete(gap[0]);
    timer_delete(gap[1]);
    timer_delete((timer_t)(long)3);
    printf("timer ids %ld %ld %ld %ld %ld\n", (long)stopwatch, (long)ids[0], (long)ids[1], (long)oneshot, (long)slow);
    arm(ids[0], P1, P1);
    arm(ids[1], P2, P2);
    arm(oneshot, ONESHOT, 0);
    arm(slow, PSLOW, PSLOW);
}

/* The slow timer's signal stays blocked until step 32 (two expirations
 * by then: it is taken with an overrun), then is taken whenever pending;
 * in between, timer_getoverrun() must say the last signal's overrun (the
 * test checkpoints at step 33, while it is not pending). */
static void check_slow(int step)
{
    sigset_t pend, set;
    sigpending(&pend);
    sigemptyset(&set);
    sigaddset(&set, SIGRTMIN + 2);
    if (step >= 32 && sigismember(&pend, SIGRTMIN + 2)) {
        int64_t before = elapsed();
        siginfo_t si;
        struct timespec zero = {0, 0};
        CHECK(sigtimedwait(&set, &si, &zero) == SIGRTMIN + 2, "sigtimedwait");
        CHECK(si.si_code == SI_TIMER && si.si_value.sival_int == 88, "the slow timer's signal: code %d, value %d",
              si.si_code, si.si_value.sival_int);
        CHECK(timer_getoverrun(slow) == si.si_overrun, "the slow timer: timer_getoverrun differs from si_overrun");
        slow_count += 1 + si.si_overrun;
        slow_last = si.si_overrun;
        check_count("the slow timer", slow_count, before, elapsed(), PSLOW, 0);
    } else if (slow_count) {
        CHECK(timer_getoverrun(slow) == slow_last, "the slow timer: timer_getoverrun %d, its last signal said %ld",
              timer_getoverrun(slow), slow_last);
    }
}

static void check_signal(int step)
{
    CHECK(!bad_overrun, "a timer's signal came with a wrong sigev_value, code or overrun");
    check_slow(step);
    int64_t before = elapsed();
    long c0 = counts[0], c1 = counts[1];
    int fired = oneshot_fired;
    int64_t after = elapsed();
    check_count("timer 1", c0, before, after, P1, 10);
    check_count("timer 2", c1, before, after, P2, 10);
    CHECK(fired <= 1, "the one-shot fired %d times", fired);
    if (after < ONESHOT)
        CHECK(!fired, "the one-shot fired early (at %lld ms of %lld)", (long long)(after / MS), (long long)(ONESHOT / MS));
    if (before > ONESHOT + 200 * MS)
        CHECK(fired, "the one-shot has not fired (at %lld ms of %lld)", (long long)(before / MS), (long long)(ONESHOT / MS));
    struct itimerspec v;
    for (long gone = 1; gone <= 4; gone += gone == 1 ? 2 : 1)
        CHECK(timer_gettime((timer_t)gone, &v) < 0 && errno == EINVAL, "deleted timer %ld answers", gone);
    CHECK(timer_gettime(ids[0], &v) == 0 && ns_of(&v.it_interval) == P1, "timer 1's interval");
    CHECK(timer_gettime(ids[1], &v) == 0 && ns_of(&v.it_interval) == P2, "timer 2's interval");
    if (step == 40) {
        struct sigevent ev = {.sigev_notify = SIGEV_NONE};
        timer_t late;
        CHECK(timer_create(CLOCK_MONOTONIC, &ev, &late) == 0, "timer_create");
        printf("late timer id %ld\n", (long)late);
    }
}

/* ---- threads ---- */
#define NTHREADS 3
static atomic_int stop;
static atomic_long tchecks[NTHREADS];

static void *timer_thread(void *arg)
{
    int i = (int)(long)arg, sig = SIGRTMIN + 2 + i;
    int64_t p = (15 + 5 * i) * MS;
    sigset_t set;
    sigemptyset(&set);
    sigaddset(&set, sig);
    CHECK(pthread_sigmask(SIG_BLOCK, &set, 0) == 0, "pthread_sigmask");
    timer_t t;
    struct sigevent ev = {.sigev_notify = SIGEV_THREAD_ID, .sigev_signo = sig};
    ev.sigev_value.sival_int = 100 + i;
    ev._sigev_un._tid = gettid();
    CHECK(timer_create(CLOCK_MONOTONIC, &ev, &t) == 0, "timer_create");
    int64_t start = elapsed();
    arm(t, p, p);
    long count = 0, last_overrun = 0;
    struct timespec zero = {0, 0};
    while (!atomic_load(&stop)) {
        step_sleep_ms(70);
        sigset_t pend;
        sigpending(&pend);
        if (!sigismember(&pend, sig) && count)
            CHECK(timer_getoverrun(t) == last_overrun, "thread %d: timer_getoverrun %d, the last signal said %ld", i,
                  timer_getoverrun(t), last_overrun);
        int64_t before = elapsed() - start;
        siginfo_t si;
        while (sigtimedwait(&set, &si, &zero) == sig) {
            CHECK(si.si_code == SI_TIMER && si.si_value.sival_int == 100 + i && si.si_timerid == (int)(long)t,
                  "thread %d: a signal with code %d, value %d, timer %d", i, si.si_code, si.si_value.sival_int,
                  si.si_timerid);
            CHECK(timer_getoverrun(t) == si.si_overrun, "thread %d: timer_getoverrun differs from si_overrun", i);
            count += 1 + si.si_overrun;
            last_overrun = si.si_overrun;
        }
        int64_t after = elapsed() - start;
        char what[32];
        snprintf(what, sizeof(what), "thread %d", i);
        check_count(what, count, before, after, p, 0);
        atomic_fetch_add(&tchecks[i], 1);
    }
    return 0;
}

static pthread_t threads[NTHREADS + 2];

static void setup_threads(void)
{
    start_stopwatch();
    for (long i = 0; i < NTHREADS; i++)
        CHECK(pthread_create(&threads[i], 0, timer_thread, (void *)i) == 0, "pthread_create");
}

static void check_threads(int step)
{
    (void)step;
    elapsed();  /* the stopwatch answers */
}

/* ---- rtqueue ---- */
#define DEPTH 16
static int next_in = 0, next_out = 0;  /* process-wide SIGRTMIN+5, by main */
static atomic_int thread_tid[NTHREADS];
static atomic_int sent[NTHREADS], taken[NTHREADS];

static void *queue_taker(void *arg)
{
    int i = (int)(long)arg, sig = SIGRTMIN + 6;
    atomic_store(&thread_tid[i], gettid());
    sigset_t set;
    sigemptyset(&set);
    sigaddset(&set, sig);
    struct timespec wait = {0, 2 * MS};
    while (!atomic_load(&stop)) {
        siginfo_t si;
        if (sigtimedwait(&set, &si, &wait) != sig)
            continue;
        int want = atomic_load(&taken[i]);
        CHECK(si.si_code == SI_QUEUE && si.si_value.sival_int == i * 1000000 + want,
              "thread %d: got payload %d (code %d), expected %d", i, si.si_value.sival_int, si.si_code,
              i * 1000000 + want);
        atomic_fetch_add(&taken[i], 1);
        step_sleep_ms(3);  /* slower than the sender: the queue stays near its depth */
    }
    return 0;
}

/* keeps DEPTH signals queued on each taker, all the time */
static void *queue_sender(void *arg)
{
    (void)arg;
    while (!atomic_load(&stop)) {
        int busy = 0;
        for (int i = 0; i < NTHREADS; i++) {
            int tid = atomic_load(&thread_tid[i]);
            if (!tid || atomic_load(&sent[i]) - atomic_load(&taken[i]) >= DEPTH)
                continue;
            siginfo_t si;
            memset(&si, 0, sizeof(si));
            si.si_signo = SIGRTMIN + 6;
            si.si_code = SI_QUEUE;
            si.si_pid = getpid();
            si.si_uid = getuid();
            si.si_value.sival_int = i * 1000000 + atomic_load(&sent[i]);
            CHECK(syscall(SYS_rt_tgsigqueueinfo, getpid(), tid, SIGRTMIN + 6, &si) == 0, "rt_tgsigqueueinfo");
            atomic_fetch_add(&sent[i], 1);
            busy = 1;
        }
        (void)busy;
        step_sleep_ms(1);
    }
    return 0;
}

/* a one-shot ITIMER_REAL re-armed every 2 ms: its SIGALRM (the kernel's,
 * si_code SI_KERNEL) often lands while the checkpoint has the threads parked */
static atomic_int alarms;

static void *alarm_taker(void *arg)
{
    (void)arg;
    sigset_t set;
    sigemptyset(&set);
    sigaddset(&set, SIGALRM);
    struct timespec wait = {0, 5 * MS};
    struct itimerval two_ms = {{0, 0}, {0, 2000}};
    CHECK(setitimer(ITIMER_REAL, &two_ms, 0) == 0, "setitimer");
    while (!atomic_load(&stop)) {
        siginfo_t si;
        if (sigtimedwait(&set, &si, &wait) != SIGALRM)
            continue;
        CHECK(si.si_code == SI_KERNEL, "SIGALRM with si_code %d, not the kernel's", si.si_code);
        atomic_fetch_add(&alarms, 1);
        CHECK(setitimer(ITIMER_REAL, &two_ms, 0) == 0, "setitimer");
    }
    return 0;
}

static void setup_rtqueue(void)
{
    /* blocked everywhere: every thread inherits the mask */
    sigset_t set;
    sigemptyset(&set);
    sigaddset(&set, SIGRTMIN + 5);
    sigaddset(&set, SIGRTMIN + 6);
    sigaddset(&set, SIGUSR2);
    sigaddset(&set, SIGALRM);
    CHECK(sigprocmask(SIG_BLOCK, &set, 0) == 0, "sigprocmask");
    for (; next_in < DEPTH; next_in++)
        CHECK(sigqueue(getpid(), SIGRTMIN + 5, (union sigval){.sival_int = 5000 + next_in}) == 0, "sigqueue");
    CHECK(sigqueue(getpid(), SIGUSR2, (union sigval){.sival_int = 4242}) == 0, "sigqueue");
    for (long i = 0; i < NTHREADS; i++)
        CHECK(pthread_create(&threads[i], 0, queue_taker, (void *)i) == 0, "pthread_create");
    CHECK(pthread_create(&threads[NTHREADS], 0, queue_sender, 0) == 0, "pthread_create");
    CHECK(pthread_create(&threads[NTHREADS + 1], 0, alarm_taker, 0) == 0, "pthread_create");
}

static void check_rtqueue(int step)
{
    (void)step;
    sigset_t one, pend;
    sigemptyset(&one);
    sigaddset(&one, SIGRTMIN + 5);
    siginfo_t si;
    struct timespec zero = {0, 0};
    CHECK(sigtimedwait(&one, &si, &zero) == SIGRTMIN + 5, "the process-wide RT queue is empty");
    CHECK(si.si_code == SI_QUEUE && si.si_value.sival_int == 5000 + next_out, "process-wide: payload %d, expected %d",
          si.si_value.sival_int, 5000 + next_out);
    next_out++;
    CHECK(sigqueue(getpid(), SIGRTMIN + 5, (union sigval){.sival_int = 5000 + next_in++}) == 0, "sigqueue");
    sigpending(&pend);
    CHECK(sigismember(&pend, SIGUSR2), "SIGUSR2 is no longer pending");
    for (int i = 0; i < NTHREADS; i++)
        CHECK(atomic_load(&sent[i]) - atomic_load(&taken[i]) <= DEPTH, "thread %d has more than %d queued", i, DEPTH);
}

static void end_rtqueue(void)
{
    sigset_t one;
    sigemptyset(&one);
    sigaddset(&one, SIGUSR2);
    siginfo_t si;
    struct timespec zero = {0, 0};
    CHECK(sigtimedwait(&one, &si, &zero) == SIGUSR2 && si.si_code == SI_QUEUE && si.si_value.sival_int == 4242,
          "SIGUSR2 lost its payload");
    sigemptyset(&one);
    sigaddset(&one, SIGRTMIN + 5);
    for (int n = 0; n < DEPTH; n++) {
        CHECK(sigtimedwait(&one, &si, &zero) == SIGRTMIN + 5 && si.si_value.sival_int == 5000 + next_out,
              "process-wide queue at the end: payload %d, expected %d", si.si_value.sival_int, 5000 + next_out);
        next_out++;
    }
    CHECK(sigtimedwait(&one, &si, &zero) < 0, "more process-wide RT signals than queued");
}

/* ---- sigev_thread ---- */
static timer_t sev_timer;
static _Atomic long sev_runs, sev_bad;
static pid_t sev_main;
static long sev_seen;

static void on_thread_timer(union sigval v)
{
    /* a thread of its own each time, with the program's value */
    if (v.sival_int != 4242 || gettid() == sev_main)
        sev_bad++;
    sev_runs++;
}

static void setup_sigev_thread(void)
{
    sev_main = gettid();
    struct sigevent ev = {.sigev_notify = SIGEV_THREAD, .sigev_notify_function = on_thread_timer,
                          .sigev_value = {.sival_int = 4242}};
    CHECK(timer_create(CLOCK_MONOTONIC, &ev, &sev_timer) == 0, "timer_create");
    arm(sev_timer, 20 * MS, 20 * MS);
    for (int i = 0; i < 200 && !sev_runs; i++)
        step_sleep_ms(5);
}

static void check_sigev_thread(int step)
{
    (void)step;
    struct itimerspec its;
    CHECK(timer_gettime(sev_timer, &its) == 0, "timer_gettime");
    CHECK(its.it_interval.tv_sec == 0 && its.it_interval.tv_nsec == 20 * MS, "interval");
    CHECK(its.it_value.tv_sec == 0 && its.it_value.tv_nsec > 0 && its.it_value.tv_nsec <= 20 * MS, "left");
    CHECK(sev_bad == 0, "a run with the wrong value or in the main thread");
    long runs = sev_runs;
    CHECK(runs > sev_seen, "the timer's function ran since the last step (%ld, %ld)", runs, sev_seen);
    sev_seen = runs;
}

/* with thread attributes: glibc's helper runs it, and the checkpoint is refused */
static void setup_sigev_thread_attr(void)
{
    static pthread_attr_t attr;
    pthread_attr_init(&attr);
    pthread_attr_setstacksize(&attr, 1 << 20);
    struct sigevent ev = {.sigev_notify = SIGEV_THREAD, .sigev_notify_function = on_thread_timer,
                          .sigev_notify_attributes = &attr, .sigev_value = {.sival_int = 4242}};
    CHECK(timer_create(CLOCK_MONOTONIC, &ev, &sev_timer) == 0, "timer_create");
    arm(sev_timer, 50 * MS, 50 * MS);
}

static void check_nothing(int step) { (void)step; }

int main(int argc, char **argv)
{
    int steps = steps_of(argc, argv);
    const char *mode = argc > 2 ? argv[2] : "signal";
    void (*check)(int) = check_nothing;
    setvbuf(stdout, 0, _IOLBF, 0);
    if (!strcmp(mode, "signal")) {
        setup_signal();
        check = check_signal;
    } else if (!strcmp(mode, "threads")) {
        setup_threads();
        check = check_threads;
    } else if (!strcmp(mode, "rtqueue")) {
        setup_rtqueue();
        check = check_rtqueue;
    } else if (!strcmp(mode, "sigev_thread")) {
        setup_sigev_thread();
        check = check_sigev_thread;
    } else if (!strcmp(mode, "sigev_thread_attr")) {
        setup_sigev_thread_attr();
    } else {
        CHECK(0, "unknown mode %s", mode);
    }
    int rc = run_steps(steps, check);
    atomic_store(&stop, 1);
    for (int i = 0; i < NTHREADS + 2; i++)
        if (threads[i])
            pthread_join(threads[i], 0);
    if (!strcmp(mode, "threads"))
        for (int i = 0; i < NTHREADS; i++)
            CHECK(atomic_load(&tchecks[i]) > 0, "thread %d never checked", i);
    if (!strcmp(mode, "rtqueue")) {
        end_rtqueue();
        for (int i = 0; i < NTHREADS; i++)
            CHECK(atomic_load(&taken[i]) > DEPTH, "thread %d took only %d signals", i, atomic_load(&taken[i]));
        CHECK(atomic_load(&alarms) > 0, "no SIGALRM taken");
    }
    printf("end\n");
    return rc;
}
