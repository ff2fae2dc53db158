/*
 * An eventfd several processes share (open, then fork) in the restore plan
 * (plan.c has the format): made once at its slot with its counter; each
 * process takes it through its "desc" key (fds.c, which also makes an
 * eventfd only one process holds).
 *   eventfd SLOT COUNT SEMAPHORE
 */
#include "plan.h"

void op_eventfd(const struct line *l)
{
    long fd = ck_eventfd2(0, (num(l, 3) ? 1 /* EFD_SEMAPHORE */ : 0) | O_CLOEXEC);
    uint64_t v = num(l, 2);
    if (fd >= 0 && v && ck_write((int)fd, &v, sizeof(v)) != sizeof(v))
        rst_fail("cannot restore an eventfd counter", 0, 0);
    to_slot(fd, l, 1, "cannot create an eventfd");
}
