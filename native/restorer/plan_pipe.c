/*
 * Pipes and FIFOs in the restore plan (plan.c has the format): each is
 * created once at its slots, its bytes in flight put back by `write`
 * (plan.c), and each process dups its ends from the slots (fds.c).
 *   pipe R W INO SIZE     both ends, the pipe's size (F_SETPIPE_SZ)
 *   fifo SLOT INO PATH    the FIFO opened (made again if its file is gone),
 *                         so that its buffer lives while the job reopens it
 *   log SLOT INO STDFD    the job's stdout/stderr pipe: the new relay's
 */
#include "plan.h"

#include <errno.h>

#ifndef F_SETPIPE_SZ
#define F_SETPIPE_SZ 1031
#endif

void op_pipe(const struct line *l)
{
    int p[2];
    long rc = ck_pipe2(p, O_CLOEXEC | O_NONBLOCK);
    if (rc < 0)
        rst_fail("cannot create a pipe", 0, rc);
    if (num(l, 4))
        ck_fcntl(p[1], F_SETPIPE_SZ, (long)num(l, 4));
    to_slot(p[0], l, 1, "pipe");
    to_slot(p[1], l, 2, "pipe");
}

void op_fifo(const struct line *l)
{
    char path[1200];
    unhex(l, 3, path, sizeof(path));
    long fd = ck_open(path, O_RDWR | O_NONBLOCK | O_CLOEXEC, 0);
    if (fd == -ENOENT) {
        long rc = ck_mknod(path, S_IFIFO | 0600, 0);
        if (rc < 0)
            rst_fail("cannot create a FIFO again", path, rc);
        fd = ck_open(path, O_RDWR | O_NONBLOCK | O_CLOEXEC, 0);
    }
    to_slot(fd, l, 1, "cannot open a FIFO");
}

void op_log(const struct line *l)
{
    to_slot(ck_fcntl((int)num(l, 3), F_DUPFD_CLOEXEC, 0), l, 1, "the job's output pipe");
}
