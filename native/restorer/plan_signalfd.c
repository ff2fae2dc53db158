/*
 * signalfds (the shim's side is native/shim/dump_fds.c): made again with
 * their mask (the signals pending are the process's, restored with it); by
 * fds.c for a signalfd one process holds, by the plan for one several
 * processes share (open, then fork), made once at its slot (plan.c has the
 * format):
 *   signalfd SLOT MASK
 */
#include "plan.h"

long rst_make_signalfd(uint64_t mask)
{
    long fd = ck_sc4(SYS_signalfd4, -1, &mask, sizeof(mask), O_CLOEXEC);
    if (fd < 0)
        rst_fail("cannot create a signalfd", 0, fd);
    return fd;
}

void op_signalfd(const struct line *l)
{
    to_slot(rst_make_signalfd(num(l, 2)), l, 1, "cannot create a signalfd");
}
