/*
 * Open file descriptions several processes share (open, then fork; the
 * agent found them with kcmp) in the restore plan (plan.c has the format):
 * opened once at a slot, so that they move one offset again; each process
 * takes its descriptor through the "desc" key and sets its status flags
 * (fds.c).  Pipes, sockets and eventfds have their own kinds.
 *   file SLOT FLAGS POS PATH     a file, directory, device or FIFO opened again
 *   fileshm SLOT SHM FLAGS POS   a memfd or deleted tmpfs file opened again
 *                                from the shm object at slot SHM
 *   desc SLOT PID FD             process PID's descriptor FD is that object
 */
#include "plan.h"

#include <errno.h>

/* an open file description several processes share, at its offset; its
 * status flags are set by each process that holds it (fds.c) */
static void reopen(const struct line *l, int from_shm)
{
    char path[1200];
    int flags = (int)num(l, from_shm ? 3 : 2) & ~(O_CREAT | O_TRUNC | O_EXCL | (from_shm ? O_NOFOLLOW : 0));
    long fd;
    if (from_shm) {
        /* a memfd or deleted file has no path: its object's /proc link does */
        struct ck_buf b;
        ck_buf_init(&b, path, sizeof(path));
        ck_buf_str(&b, "/proc/self/fd/");
        ck_buf_u64(&b, (uint64_t)slot_fd(l, 2));
    } else {
        unhex(l, 4, path, sizeof(path));
    }
    /* O_NONBLOCK: a FIFO's or device's open must not wait */
    fd = ck_open(path, flags | O_NONBLOCK | O_CLOEXEC, 0);
    if (fd < 0)
        rst_fail("cannot reopen a file several processes share", path, fd);
    long rc = ck_lseek((int)fd, (int64_t)num(l, from_shm ? 4 : 3), SEEK_SET);
    if (rc < 0 && rc != -ESPIPE)
        rst_fail("cannot seek a file several processes share", path, rc);
    to_slot(fd, l, 1, "cannot reopen a file several processes share");
}

void op_file(const struct line *l)
{
    reopen(l, 0);
}

void op_fileshm(const struct line *l)
{
    reopen(l, 1);
}
