/*
 * timerfds (the shim's side is native/shim/dump_fds.c): made again on their
 * clock with the time that was left at the checkpoint (relative; or, with
 * FLAGS TFD_TIMER_ABSTIME, the deadline they had), their interval, then
 * their expirations not read yet; by fds.c for a timerfd one process holds,
 * by the plan for one several processes share (open, then fork), made once
 * at its slot (plan.c has the format):
 *   timerfd SLOT CLOCK INTERVAL_NS VALUE_NS TICKS FLAGS
 */
#include "plan.h"

long rst_make_timerfd(uint32_t clockid, uint32_t flags, uint64_t interval_ns, uint64_t value_ns, uint64_t ticks)
{
    long fd = ck_sc2(SYS_timerfd_create, clockid, O_CLOEXEC);
    if (fd < 0)
        rst_fail("cannot create a timerfd", 0, fd);
    struct {
        int64_t interval_sec, interval_nsec, value_sec, value_nsec;
    } its = {(int64_t)(interval_ns / 1000000000ull), (int64_t)(interval_ns % 1000000000ull),
             (int64_t)(value_ns / 1000000000ull), (int64_t)(value_ns % 1000000000ull)};
    long rc = ck_sc4(SYS_timerfd_settime, fd, flags & 1 /* TFD_TIMER_ABSTIME */, &its, 0);
    if (rc < 0)
        rst_fail("cannot set a timerfd again (timerfd_settime)", 0, rc);
    /* last: timerfd_settime counts expirations from 0 again */
    if (ticks) {
        rc = ck_ioctl((int)fd, 0x40085400 /* TFD_IOC_SET_TICKS */, &ticks);
        if (rc < 0)
            rst_fail("cannot give a timerfd its expirations not read yet (TFD_IOC_SET_TICKS needs a kernel "
                     "built with CONFIG_CHECKPOINT_RESTORE)",
                     0, rc);
    }
    return fd;
}

void op_timerfd(const struct line *l)
{
    to_slot(rst_make_timerfd((uint32_t)num(l, 2), (uint32_t)num(l, 6), num(l, 3), num(l, 4), num(l, 5)), l, 1,
            "cannot create a timerfd");
}
