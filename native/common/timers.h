/*
 * POSIX timers (timer_create) through raw system calls, shared by the shim
 * (native/shim/dump_timers.c: saving them, and putting a timer's pending
 * signal back after the checkpoint took it) and the freestanding restorer
 * (native/restorer/timers.c: creating them again).
 *
 * What the kernel lets us set, and how (Linux 6.13+ semantics):
 * - the id: PR_TIMER_CREATE_RESTORE_IDS (Linux 6.15+) makes timer_create
 *   take the id from *created_timer_id, and sets the process's next id to
 *   it plus one; without it, ids are handed out in order and gaps are made
 *   with fillers created and deleted again (ck_timer_create_as);
 * - a timer's own signal pending with its overrun O: timer_settime with
 *   TIMER_ABSTIME at (next expiry - (O + 1) intervals), in the past, fires
 *   at once and queues the timer's signal; when it is taken, the kernel
 *   forwards the timer over the intervals missed since that time, which
 *   counts exactly O plus what expired meanwhile (ck_timer_fire_at);
 * - timer_getoverrun() (the overrun of the last signal taken): only the
 *   delivery of a signal sets it, and every timer_settime resets it to 0,
 *   so the restorer makes the timer fire at (next expiry - (L + 1)
 *   intervals) and takes that signal itself (native/restorer/timers.c).
 */
#ifndef CKPTD_TIMERS_H
#define CKPTD_TIMERS_H

#include "sys.h"

#include <errno.h>

#ifndef PR_TIMER_CREATE_RESTORE_IDS
#define PR_TIMER_CREATE_RESTORE_IDS 77
#endif
#define CK_TIMER_IDS_OFF 0
#define CK_TIMER_IDS_ON 1
#define CK_TIMER_IDS_GET 2
#define CK_SI_TIMER (-2)
#define CK_SIGEV_THREAD_ID 4
#define CK_TIMER_ABSTIME 1

/* the kernel's struct sigevent (64 bytes) */
struct ck_sigevent {
    uint64_t value;
    int32_t signo;
    int32_t notify;
    int32_t tid;
    int32_t pad[11];
};

/* the _timer member of a siginfo: si_tid (the timer id), si_overrun */
#define CK_SIGINFO_TIMERID(info) (*(int32_t *)((uint8_t *)(info) + 16))
#define CK_SIGINFO_OVERRUN(info) (*(int32_t *)((uint8_t *)(info) + 20))
#define CK_SIGINFO_CODE(info) (*(int32_t *)((uint8_t *)(info) + 8))

CK_ALWAYS_INLINE long ck_timer_create(int clock, struct ck_sigevent *ev, int32_t *id)
{
    return ck_sc3(SYS_timer_create, clock, ev, id);
}
CK_ALWAYS_INLINE long ck_timer_settime(int id, int flags, const struct itimerspec *v)
{
    return ck_sc4(SYS_timer_settime, id, flags, v, 0);
}
CK_ALWAYS_INLINE long ck_timer_gettime(int id, struct itimerspec *v) { return ck_sc2(SYS_timer_gettime, id, v); }
CK_ALWAYS_INLINE long ck_timer_getoverrun(int id) { return ck_sc1(SYS_timer_getoverrun, id); }
CK_ALWAYS_INLINE long ck_timer_delete(int id) { return ck_sc1(SYS_timer_delete, id); }

CK_ALWAYS_INLINE int64_t ck_ts_ns(const struct timespec *t) { return (int64_t)t->tv_sec * 1000000000LL + t->tv_nsec; }
CK_ALWAYS_INLINE struct timespec ck_ns_ts(int64_t ns)
{
    struct timespec t = {ns / 1000000000LL, ns % 1000000000LL};
    return t;
}

/* 1: PR_TIMER_CREATE_RESTORE_IDS is on, 0: off, <0: not in this kernel */
CK_ALWAYS_INLINE long ck_timer_restore_ids(void) { return ck_sc5(SYS_prctl, PR_TIMER_CREATE_RESTORE_IDS, CK_TIMER_IDS_GET, 0, 0, 0); }
CK_ALWAYS_INLINE long ck_timer_set_restore_ids(int on)
{
    return ck_sc5(SYS_prctl, PR_TIMER_CREATE_RESTORE_IDS, on ? CK_TIMER_IDS_ON : CK_TIMER_IDS_OFF, 0, 0, 0);
}

/* A disarmed SIGEV_NONE timer with exactly this id (restore-ids mode on),
 * deleted again: the process's next id becomes id + 1. */
static inline long ck_timer_bump_next(int32_t id)
{
    struct ck_sigevent ev;
    for (unsigned i = 0; i < sizeof(ev); i++)
        ((uint8_t *)&ev)[i] = 0;
    ev.notify = 1; /* SIGEV_NONE */
    int32_t got = id;
    long rc = ck_timer_create(CLOCK_MONOTONIC, &ev, &got);
    if (rc < 0)
        return rc;
    ck_timer_delete(got);
    return 0;
}

/*
 * Make the next timer_create return `next` (restore-ids mode on), given the
 * ids in use (sorted ascending): the kernel hands out the first free id from
 * its counter on, so the counter is set just past the highest free id below
 * `next`; with none free, past INT_MAX (it wraps to 0).
 */
static inline long ck_timer_set_next(int32_t next, const int32_t *used, uint32_t nused)
{
    int32_t q = next - 1;
    for (;;) {
        int busy = 0;
        for (uint32_t i = 0; i < nused; i++)
            busy |= used[i] == q;
        if (!busy || q < 0)
            break;
        q--;
    }
    return ck_timer_bump_next(q >= 0 ? q : 0x7fffffff);
}

/*
 * Arm timer id (on clock, with interval_ns) so that it fires now with its
 * expiry at `at` (an absolute time on its clock, in the past), and wait
 * until it has: its signal is then queued as the kernel's own, and taking
 * it forwards the timer from `at`.  Returns 0, or -ETIMEDOUT if it did not
 * fire within a second (its signal is ignored, say).
 */
static inline long ck_timer_fire_at(int32_t id, int64_t at, int64_t interval_ns)
{
    if (at < 1)
        at = 1;
    struct itimerspec v;
    v.it_value = ck_ns_ts(at);
    v.it_interval = ck_ns_ts(interval_ns);
    long rc = ck_timer_settime(id, CK_TIMER_ABSTIME, &v);
    if (rc < 0)
        return rc;
    int64_t deadline = ck_now_ns(CLOCK_MONOTONIC) + 1000000000LL;
    for (;;) {
        /* not yet fired: armed with its expiry past, timer_gettime says 1 ns;
         * fired: a one-shot is disarmed (0), a periodic one awaits its
         * signal's taking and says the time to its next interval */
        rc = ck_timer_gettime(id, &v);
        if (rc < 0)
            return rc;
        if (v.it_value.tv_sec != 0 || v.it_value.tv_nsec != 1)
            return 0;
        if (ck_now_ns(CLOCK_MONOTONIC) > deadline)
            return -ETIMEDOUT;
        ck_sched_yield();
    }
}

/* The expiry to fire at for a signal carrying `overrun` with the next expiry
 * at `next` (periodic), or now (one-shot). */
CK_ALWAYS_INLINE int64_t ck_timer_fire_time(int clock, int64_t next, int64_t interval_ns, int64_t overrun)
{
    if (!interval_ns)
        return ck_now_ns(clock);
    return next - (overrun + 1) * interval_ns;
}

#endif
