/*
 * POSIX timers (timer_create), issue 19: saved here, created again with the
 * same ids by native/restorer/timers.c (the kernel side: native/common/timers.h).
 *
 * /proc/self/timers names every timer of the process with its id, signal,
 * sigev_value, notification (signal, none, or a thread) and clock;
 * timer_gettime and timer_getoverrun add the interval, the time to the next
 * expiry and the overrun of the last signal taken.  A timer whose signal is
 * pending has it taken with the other pending signals (quiesce.c) and put
 * back at once as the kernel's own (ck_timer_requeue_taken): its overrun
 * so far is then in the siginfo recorded, brought up to the dump's instant
 * by ck_dump_timers.  The id the next timer_create would return is probed
 * and set back (Linux 6.15+'s PR_TIMER_CREATE_RESTORE_IDS).
 *
 * Refused, while the job runs on: glibc's SIGEV_THREAD timers (their helper
 * thread blocks every signal and cannot be parked; the shim runs those made
 * without thread attributes itself: sigev_thread.c), CPU-time and alarm
 * clocks.  Raw system calls only: parked threads may hold libc's locks.
 */
#include "shim.h"
#include "../common/sys.h"
#include "../common/timers.h"
#include "../common/util.h"
#include "../common/maps.h"

#include <errno.h>

#define CK_MAX_TIMERS 4096

static char tbuf[CK_MAX_TIMERS * 96 + 4096];
static struct ck_posix_timer tlist[CK_MAX_TIMERS];

static const char *line_after(const char *p, const char *key, size_t klen)
{
    if (ck_strncmp(p, key, klen) != 0)
        return 0;
    return ck_skip_spaces(p + klen);
}

/* every timer of the process, by ascending id; -errno, or -E2BIG past CK_MAX_TIMERS */
static long scan_timers(void)
{
    long n = ck_read_file("/proc/self/timers", tbuf, sizeof(tbuf) - 1);
    if (n == -ENOENT)
        return 0;
    if (n < 0)
        return n;
    if (n >= (long)sizeof(tbuf) - 1)
        return -E2BIG;
    tbuf[n] = 0;
    long count = -1;
    for (const char *p = tbuf; *p;) {
        const char *v;
        if ((v = line_after(p, "ID:", 3))) {
            if (++count >= CK_MAX_TIMERS)
                return -E2BIG;
            ck_memset(&tlist[count], 0, sizeof(tlist[count]));
            tlist[count].id = (int32_t)ck_parse_i64(v, 0);
        } else if (count >= 0 && (v = line_after(p, "signal:", 7))) {
            const char *e;
            tlist[count].signo = (int32_t)ck_parse_i64(v, &e);
            if (*e == '/')
                tlist[count].value = ck_parse_u64(e + 1, 16, 0);
        } else if (count >= 0 && (v = line_after(p, "notify:", 7))) {
            /* "signal/pid.N", "none/pid.N", "thread/tid.N" (SIGEV_THREAD) */
            int kind = ck_strncmp(v, "signal", 6) == 0 ? 0 : ck_strncmp(v, "none", 4) == 0 ? 1 : 2;
            while (*v && *v != '/' && *v != '\n')
                v++;
            if (*v == '/' && ck_strncmp(v + 1, "tid.", 4) == 0) {
                kind |= CK_TIMER_NOTIFY_TID;
                tlist[count].tid = (int32_t)ck_parse_i64(v + 5, 0);
            }
            tlist[count].notify = kind;
        } else if (count >= 0 && (v = line_after(p, "ClockID:", 8))) {
            tlist[count].clock = (int32_t)ck_parse_i64(v, 0);
        }
        while (*p && *p != '\n')
            p++;
        if (*p)
            p++;
    }
    count++;
    /* the kernel lists them by hash bucket: sort by id (insertion sort: few) */
    for (long i = 1; i < count; i++) {
        struct ck_posix_timer t = tlist[i];
        long j = i - 1;
        for (; j >= 0 && tlist[j].id > t.id; j--)
            tlist[j + 1] = tlist[j];
        tlist[j + 1] = t;
    }
    return count;
}

static const struct ck_posix_timer *find_timer(long n, int32_t id)
{
    for (long i = 0; i < n; i++)
        if (tlist[i].id == id)
            return &tlist[i];
    return 0;
}

static int clock_supported(int c)
{
    return c == CLOCK_REALTIME || c == CLOCK_MONOTONIC || c == CLOCK_BOOTTIME || c == CLOCK_TAI;
}

/* the reason the process's timers cannot be checkpointed, or NULL; the
 * checkpoint thread asks before it parks anyone (a SIGEV_THREAD helper
 * would only time the quiesce out), and again in the dump, where an
 * unreadable /proc/self/timers (a process not dumpable until then) fails */
const char *ck_timers_refusal(int strict)
{
    long n = scan_timers();
    if (n == -E2BIG)
        return "the process has more than 4096 POSIX timers; ckptd saves at most 4096";
    if (n < 0)
        return strict ? "cannot read /proc/self/timers" : 0;
    for (long i = 0; i < n; i++) {
        const struct ck_posix_timer *t = &tlist[i];
        /* glibc's SIGEV_THREAD: a timer aimed at its helper thread with its
         * internal signal (32, SIGTIMER; 33 for other libcs' helpers); the
         * shim's own helper (sigev_thread.c) parks like any thread */
        int shims = (t->notify & CK_TIMER_NOTIFY_TID) && t->tid == ck_sigev_helper_tid();
        if (!shims && ((t->notify & 3) == 2 || ((t->notify & CK_TIMER_NOTIFY_TID) && t->signo >= 32 && t->signo <= 33)))
            return "the process uses a POSIX timer with SIGEV_THREAD and thread attributes (glibc runs it from a "
                   "helper thread that blocks every signal and cannot be parked); ckptd cannot checkpoint it: "
                   "create it without sigev_notify_attributes, or use SIGEV_SIGNAL or SIGEV_THREAD_ID";
        if (!clock_supported(t->clock))
            return "the process uses a POSIX timer on a CPU-time or alarm clock; ckptd restores timers on "
                   "CLOCK_REALTIME, CLOCK_MONOTONIC, CLOCK_BOOTTIME and CLOCK_TAI only";
    }
    return 0;
}

/*
 * A timer's signal was just taken (siginfo `info`, SI_TIMER): queue it again
 * as the kernel's own, with its overrun, by making the timer fire at the
 * expiry that signal stands for (timers.h).  *at is that expiry, from which
 * ck_dump_timers counts the overrun at the dump's instant.
 */
long ck_timer_requeue_taken(const uint8_t *info, int64_t *at)
{
    int32_t id = CK_SIGINFO_TIMERID(info);
    long n = scan_timers();
    const struct ck_posix_timer *t = n > 0 ? find_timer(n, id) : 0;
    if (!t)
        return -ENOENT;
    struct itimerspec v;
    long rc = ck_timer_gettime(id, &v);
    if (rc < 0)
        return rc;
    int64_t interval = ck_ts_ns(&v.it_interval);
    int64_t next = ck_now_ns(t->clock) + ck_ts_ns(&v.it_value);
    *at = ck_timer_fire_time(t->clock, next, interval, CK_SIGINFO_OVERRUN(info));
    return ck_timer_fire_at(id, *at, interval);
}

/*
 * Save every timer, with the instant's state, into im (last, with the
 * pending signals: capture_timers_and_pending in dump.c).  taken/at: the
 * pending signals taken, and for a timer's, the expiry it was put back at.
 */
int ck_dump_timers(struct ck_image *im, struct ck_pending *taken, const int64_t *at, uint32_t ntaken)
{
    const char *why = ck_timers_refusal(1);
    if (why)
        return ck_image_fail(im, why, 0, 0);
    long n = scan_timers();
    int32_t ids[CK_MAX_TIMERS];
    for (long i = 0; i < n; i++) {
        struct ck_posix_timer *t = &tlist[i];
        struct itimerspec v;
        long rc = ck_timer_gettime(t->id, &v);
        if (rc < 0)
            return ck_image_fail(im, "cannot read a POSIX timer (timer_gettime)", 0, rc);
        t->interval_ns = ck_ts_ns(&v.it_interval);
        t->remaining_ns = ck_ts_ns(&v.it_value);
        rc = ck_timer_getoverrun(t->id);
        t->overrun_last = rc > 0 ? (int32_t)rc : 0;
        ids[i] = t->id;
        /* a signal of this timer taken and put back: its overrun now is the
         * intervals from the expiry it fired at to the next one, less one */
        for (uint32_t k = 0; k < ntaken; k++) {
            uint8_t *info = taken[k].info;
            if (!taken[k].has_info || CK_SIGINFO_CODE(info) != CK_SI_TIMER || CK_SIGINFO_TIMERID(info) != t->id ||
                !t->interval_ns || !t->remaining_ns)
                continue;
            int64_t next = ck_now_ns(t->clock) + t->remaining_ns;
            int64_t o = (next - at[k] + t->interval_ns / 2) / t->interval_ns - 1;
            CK_SIGINFO_OVERRUN(info) = o < 0 ? 0 : o > 0x7fffffff ? 0x7fffffff : (int32_t)o;
        }
    }
    im->proc.ntimers = (uint32_t)n;
    im->proc.next_timer_id = -1;
    long mode = ck_timer_restore_ids();
    im->proc.timer_restore_ids = mode == 1;
    if (n) {
        im->proc.timers_off = ck_table_bytes_append(&im->blob, tlist, (size_t)n * sizeof(tlist[0]));
        if (im->proc.timers_off == UINT64_MAX)
            return ck_image_fail(im, "too much data to checkpoint", 0, 0);
    }
    /* the id the next timer_create returns: create one, delete it, and set
     * the kernel's counter back (only where the kernel lets us set it) */
    if (mode >= 0 && ck_timer_set_restore_ids(1) == 0) {
        ck_timer_set_restore_ids(0);
        struct ck_sigevent ev;
        ck_memset(&ev, 0, sizeof(ev));
        ev.notify = 1; /* SIGEV_NONE */
        int32_t probe = -1;
        long rc = 0;
        /* no probe (RLIMIT_SIGPENDING reached, say): the id stays unknown */
        if (ck_timer_create(CLOCK_MONOTONIC, &ev, &probe) == 0) {
            ck_timer_delete(probe);
            ck_timer_set_restore_ids(1);
            rc = ck_timer_set_next(probe, ids, (uint32_t)n);
            im->proc.next_timer_id = probe;
        }
        ck_timer_set_restore_ids((int)mode);
        if (rc < 0)
            return ck_image_fail(im, "cannot set the next POSIX timer id back after reading it", 0, rc);
    }
    return 0;
}
