/*
 * POSIX timers (timer_create), issue 19: created again with their ids,
 * clocks and sigevents once every thread exists (a SIGEV_THREAD_ID timer
 * needs its target), then, per target thread, the overrun timer_getoverrun
 * reports, then the pending signals (a timer's own signal by making the
 * timer fire with its overrun), then the rest armed with the time that
 * remained at the checkpoint.  The kernel's side: native/common/timers.h;
 * saved by native/shim/dump_timers.c.
 */
#include "restorer.h"
#include "../common/timers.h"

#include <errno.h>

#define RST_MAX_TIMERS 4096

/* set once a timer has its final state (its signal queued, or its overrun
 * set by a signal taken): each byte written by one thread only */
static volatile uint8_t settled[RST_MAX_TIMERS];
static int32_t ids[RST_MAX_TIMERS];
/* each clock read once, as the timers are created: every expiry is counted
 * from there, so the time the restore takes between one timer and the next
 * does not shift one against another */
static int64_t base[16];

static int64_t next_expiry(const struct ck_posix_timer *t) { return base[t->clock & 15] + t->remaining_ns; }

static const struct ck_posix_timer *timers_of(const struct rst_image *im, uint32_t *n)
{
    const struct ck_proc *p = im->proc;
    *n = p->ntimers;
    if (!p->ntimers)
        return 0;
    if (p->ntimers > RST_MAX_TIMERS || p->timers_off > im->blob_size ||
        (uint64_t)p->ntimers * sizeof(struct ck_posix_timer) > im->blob_size - p->timers_off ||
        p->timers_off % 8)
        rst_fail("corrupt image: the POSIX timers lie outside the image", 0, 0);
    return (const struct ck_posix_timer *)(im->blob + p->timers_off);
}

static void timer_fail(const char *what, int32_t id, long rc)
{
    char detail[32];
    struct ck_buf b;
    ck_buf_init(&b, detail, sizeof(detail));
    ck_buf_str(&b, "timer id ");
    ck_buf_i64(&b, id);
    rst_fail(what, detail, rc);
}

/* the target of a timer's signal: a thread id, or 0 for the process */
static int target_of(const struct ck_posix_timer *t) { return (t->notify & CK_TIMER_NOTIFY_TID) ? t->tid : 0; }

/* Every timer, disarmed, with its id: PR_TIMER_CREATE_RESTORE_IDS where the
 * kernel has it (and the next id set as it was), else in order with fillers
 * created and deleted for the gaps (the next id is then the last one's + 1). */
void rst_create_timers(const struct rst_image *im)
{
    uint32_t n;
    const struct ck_posix_timer *ts = timers_of(im, &n);
    long mode = ck_timer_restore_ids();
    if (mode >= 0)
        ck_timer_set_restore_ids(1);
    for (uint32_t i = 0; i < n; i++) {
        const struct ck_posix_timer *t = &ts[i];
        if (i && t->id <= ts[i - 1].id)
            rst_fail("corrupt image: POSIX timers out of order", 0, 0);
        struct ck_sigevent ev;
        ck_memset(&ev, 0, sizeof(ev));
        ev.value = t->value;
        ev.signo = t->signo;
        ev.notify = t->notify;
        ev.tid = t->tid;
        int32_t got = t->id;
        long rc = ck_timer_create(t->clock, &ev, &got);
        while (mode < 0 && rc == 0 && got < t->id) {
            ck_timer_delete(got);  /* a filler for a gap */
            got = -1;
            rc = ck_timer_create(t->clock, &ev, &got);
        }
        if (rc < 0)
            timer_fail("cannot create a POSIX timer again", t->id, rc);
        if (got != t->id)
            timer_fail("cannot create a POSIX timer again with its id (this kernel hands ids out in order, and a lower one is taken)", t->id, 0);
        ids[i] = t->id;
        settled[i] = 0;
    }
    for (uint32_t i = 0; i < n; i++)
        base[ts[i].clock & 15] = ck_now_ns(ts[i].clock);
    if (mode >= 0) {
        if (im->proc->next_timer_id >= 0) {
            long rc = ck_timer_set_next(im->proc->next_timer_id, ids, n);
            if (rc < 0)
                rst_fail("cannot set the next POSIX timer id again", 0, rc);
        }
        ck_timer_set_restore_ids((int)im->proc->timer_restore_ids);
    }
}

/*
 * For the timers aimed at tid (0: the process; the caller is that thread, or
 * the main thread), with nothing else queued for it yet: make each whose
 * timer_getoverrun() said L > 0 fire at (next expiry - (L + 1) intervals)
 * and take that signal, which sets L again and leaves the timer armed for
 * its next expiry.  A timer whose own signal is pending is skipped: the
 * kernel resets L when it is set, and that signal's delivery sets it anew.
 */
void rst_timer_overruns(const struct rst_image *im, int tid)
{
    uint32_t n;
    const struct ck_posix_timer *ts = timers_of(im, &n);
    for (uint32_t i = 0; i < n; i++) {
        const struct ck_posix_timer *t = &ts[i];
        if (target_of(t) != tid || t->overrun_last <= 0 || !t->interval_ns || !t->remaining_ns ||
            (t->notify & 3) != 0 /* SIGEV_SIGNAL */)
            continue;
        int pending = 0;
        for (uint32_t k = 0; k < im->npending; k++)
            pending |= im->pending[k].has_info && CK_SIGINFO_CODE(im->pending[k].info) == CK_SI_TIMER &&
                       CK_SIGINFO_TIMERID(im->pending[k].info) == t->id;
        if (pending)
            continue;
        int64_t next = next_expiry(t);
        long rc = ck_timer_fire_at(t->id, ck_timer_fire_time(t->clock, next, t->interval_ns, t->overrun_last),
                                   t->interval_ns);
        if (rc < 0)
            timer_fail("cannot set a POSIX timer's overrun again", t->id, rc);
        uint64_t set = 1ull << (t->signo - 1);
        uint8_t info[128];
        struct timespec zero = {0, 0};
        rc = ck_rt_sigtimedwait(&set, info, &zero);
        if (rc != t->signo || CK_SIGINFO_CODE(info) != CK_SI_TIMER || CK_SIGINFO_TIMERID(info) != t->id)
            timer_fail("cannot set a POSIX timer's overrun again (its signal did not come)", t->id, rc < 0 ? rc : 0);
        settled[i] = 1;
    }
}

/* A pending signal's siginfo: if it is a timer's own signal, queue it by
 * making the timer fire with its overrun (1), else leave it (0). */
int rst_timer_pending(const struct rst_image *im, const uint8_t *info)
{
    if (CK_SIGINFO_CODE(info) != CK_SI_TIMER)
        return 0;
    uint32_t n;
    const struct ck_posix_timer *ts = timers_of(im, &n);
    for (uint32_t i = 0; i < n; i++) {
        const struct ck_posix_timer *t = &ts[i];
        if (t->id != CK_SIGINFO_TIMERID(info))
            continue;
        int64_t next = next_expiry(t);
        long rc = ck_timer_fire_at(t->id, ck_timer_fire_time(t->clock, next, t->interval_ns, CK_SIGINFO_OVERRUN(info)),
                                   t->interval_ns);
        if (rc < 0)
            timer_fail("cannot queue a POSIX timer's signal again", t->id, rc);
        settled[i] = 1;
        return 1;
    }
    return 0;
}

/* Last: every timer not yet settled gets the time that remained (the time
 * the job was down does not count), relative, less what the restore took
 * since the timers were created, and its interval. */
void rst_arm_posix_timers(const struct rst_image *im)
{
    uint32_t n;
    const struct ck_posix_timer *ts = timers_of(im, &n);
    for (uint32_t i = 0; i < n; i++) {
        const struct ck_posix_timer *t = &ts[i];
        if (settled[i] || !t->remaining_ns)
            continue;
        struct itimerspec v;
        int64_t left = next_expiry(t) - ck_now_ns(t->clock);
        v.it_value = ck_ns_ts(left > 0 ? left : 1);
        v.it_interval = ck_ns_ts(t->interval_ns);
        long rc = ck_timer_settime(t->id, 0, &v);
        if (rc < 0)
            timer_fail("cannot re-arm a POSIX timer", t->id, rc);
    }
}
