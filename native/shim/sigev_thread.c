/*
 * SIGEV_THREAD POSIX timers, run by the shim instead of glibc (issue 19).
 *
 * glibc runs a SIGEV_THREAD timer's function from a helper thread that
 * blocks every signal, the quiesce signal too, so a checkpoint could never
 * park it.  The shim takes such a timer_create (with no thread attributes:
 * one with attributes still goes to glibc, and its checkpoint is refused in
 * dump_timers.c) and does what glibc does with a helper of its own that
 * blocks every signal but the quiesce signal:
 *  - the kernel timer is a SIGEV_THREAD_ID timer aimed at that helper with
 *    signal 32 (glibc's SIGTIMER, which programs cannot use), its
 *    sigev_value a pointer to the slot that holds the function and value;
 *  - the helper waits for signal 32 and starts a detached thread for each
 *    expiry, which calls the function with the program's value;
 *  - the timer_t handed back is the kernel's id, as for any other timer:
 *    glibc's timer_settime/gettime/getoverrun/delete work on it unchanged.
 * A checkpoint saves and restores the timer as any SIGEV_THREAD_ID timer
 * (dump_timers.c, restorer/timers.c: the helper's tid is kept) and the
 * helper as any thread, parked in its wait; the slots are in its memory.
 * Timers are not inherited over fork: the child starts without a helper.
 */
#include "shim.h"
#include "../common/sys.h"
#include "../common/timers.h"

#include <dlfcn.h>
#include <errno.h>
#include <pthread.h>
#include <signal.h>
#include <stdlib.h>
#include <sys/prctl.h>
#include <time.h>

#define CK_EXPORT __attribute__((visibility("default")))
#define SIGEV_SIG 32   /* glibc's SIGTIMER: never a program's */
#define MAX_SLOTS 1024

struct slot {
    void (*fn)(union sigval);
    union sigval value;
    int32_t ktimer;  /* the kernel's id; -1: free */
};

typedef int (*timer_create_fn)(clockid_t, struct sigevent *, timer_t *);
typedef int (*timer_delete_fn)(timer_t);

static struct slot slots[MAX_SLOTS];
static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
static volatile int32_t helper_tid;  /* 0: not started in this process */

int32_t ck_sigev_helper_tid(void)
{
    return helper_tid;
}

static void *run_one(void *arg)
{
    struct slot s = *(struct slot *)arg;  /* copied by the helper: the timer may go meanwhile */
    free(arg);
    uint64_t none = 0;  /* the helper's mask was inherited: the program's threads start with none */
    ck_sigprocmask(SIG_SETMASK, &none, 0);
    s.fn(s.value);
    return 0;
}

static void *helper(void *arg)
{
    (void)arg;
    ck_prctl(PR_SET_NAME, (unsigned long)"ckptd-timers", 0, 0, 0);
    /* every signal blocked, as glibc's helper, but the quiesce signal */
    uint64_t mask = ~0ull & ~(1ull << (ck_shim.quiesce_signal - 1));
    ck_sigprocmask(SIG_SETMASK, &mask, 0);
    helper_tid = (int32_t)ck_gettid();
    ck_futex_wake_all((volatile uint32_t *)&helper_tid);
    uint64_t wait = 1ull << (SIGEV_SIG - 1);
    for (;;) {
        siginfo_t info;
        long rc = ck_sc4(SYS_rt_sigtimedwait, &wait, &info, 0, 8);
        if (rc != SIGEV_SIG || info.si_code != SI_TIMER)
            continue;  /* EINTR: a checkpoint parked this thread */
        struct slot *s = (struct slot *)info.si_value.sival_ptr;
        if (s < slots || s >= slots + MAX_SLOTS)
            continue;
        struct slot *copy = malloc(sizeof(*copy));
        if (!copy)
            continue;
        pthread_mutex_lock(&lock);
        *copy = *s;
        pthread_mutex_unlock(&lock);
        if (copy->ktimer < 0) {  /* deleted since it fired */
            free(copy);
            continue;
        }
        pthread_t th;
        pthread_attr_t attr;
        pthread_attr_init(&attr);
        pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
        if (pthread_create(&th, &attr, run_one, copy) != 0)
            free(copy);
        pthread_attr_destroy(&attr);
    }
    return 0;
}

/* the helper's tid, started on first use; 0 if it cannot start */
static int32_t start_helper(void)
{
    if (helper_tid)
        return helper_tid;
    pthread_t th;
    pthread_attr_t attr;
    pthread_attr_init(&attr);
    pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
    pthread_attr_setstacksize(&attr, 64 * 1024);
    int rc = pthread_create(&th, &attr, helper, 0);
    pthread_attr_destroy(&attr);
    if (rc != 0)
        return 0;
    while (!helper_tid)
        ck_futex_wait((volatile uint32_t *)&helper_tid, 0, 100);
    return helper_tid;
}

CK_EXPORT int timer_create(clockid_t clock, struct sigevent *sev, timer_t *out)
{
    static timer_create_fn real;
    if (!real)
        real = (timer_create_fn)dlsym(RTLD_NEXT, "timer_create");
    if (!ck_shim.active || !sev || sev->sigev_notify != SIGEV_THREAD || sev->sigev_notify_attributes)
        return real(clock, sev, out);
    pthread_mutex_lock(&lock);
    int32_t tid = start_helper();
    struct slot *s = 0;
    for (int i = 0; tid && i < MAX_SLOTS && !s; i++)
        if (!slots[i].fn)
            s = &slots[i];
    if (!s) {
        pthread_mutex_unlock(&lock);
        errno = EAGAIN;
        return -1;
    }
    struct ck_sigevent kev = {
        .value = (uint64_t)(uintptr_t)s, .signo = SIGEV_SIG, .notify = CK_SIGEV_THREAD_ID, .tid = tid};
    int32_t id = -1;
    long rc = ck_timer_create(clock, &kev, &id);
    if (rc < 0) {
        pthread_mutex_unlock(&lock);
        errno = (int)-rc;
        return -1;
    }
    s->fn = sev->sigev_notify_function;
    s->value = sev->sigev_value;
    s->ktimer = id;
    pthread_mutex_unlock(&lock);
    *out = (timer_t)(intptr_t)id;
    return 0;
}

CK_EXPORT int timer_delete(timer_t t)
{
    static timer_delete_fn real;
    if (!real)
        real = (timer_delete_fn)dlsym(RTLD_NEXT, "timer_delete");
    int rc = real(t);
    if (rc == 0 && (intptr_t)t >= 0) {
        pthread_mutex_lock(&lock);
        for (int i = 0; i < MAX_SLOTS; i++)
            if (slots[i].fn && slots[i].ktimer == (int32_t)(intptr_t)t) {
                slots[i].fn = 0;
                slots[i].ktimer = -1;
            }
        pthread_mutex_unlock(&lock);
    }
    return rc;
}

/* in a forked child: no timers, no helper (atfork, shim.c) */
void ck_sigev_after_fork(void)
{
    pthread_mutex_init(&lock, 0);
    helper_tid = 0;
    for (int i = 0; i < MAX_SLOTS; i++) {
        slots[i].fn = 0;
        slots[i].ktimer = -1;
    }
}
