/*
 * Descriptors come back at their numbers with their flags and offsets.
 * Each is first created at a high scratch number, then dup3'd into place,
 * so creating one never lands on a number another still needs.  Order:
 * everything but dups and epoll targets, then dups (which name a lower
 * descriptor), then epoll registrations (which name any descriptor), then
 * POSIX locks (closing any descriptor of a file drops this process's POSIX
 * locks on it, so nothing may be closed after them).  An open file
 * description other processes share (open, then fork) is the plan's object
 * at a slot (a "desc" key), so they move one offset again.  SIGIO owners
 * are set last, once the threads exist (rst_restore_fd_owners): one may be
 * the owner.
 */
#include "restorer.h"
#include "../common/pty.h"

#include <errno.h>

#ifndef F_SETPIPE_SZ
#define F_SETPIPE_SZ 1031
#endif

/* status flags F_SETFL can change */
#define SETFL_MASK (O_APPEND | O_ASYNC | O_DIRECT | O_NOATIME | O_NONBLOCK)

static int scratch_fd(long fd, const char *what, const char *detail)
{
    if (fd < 0)
        rst_fail(what, detail, fd);
    long high = ck_fcntl((int)fd, F_DUPFD_CLOEXEC, rst.maxfd + 16);
    if (high < 0)
        rst_fail("cannot move a descriptor out of the way", 0, high);
    ck_close((int)fd);
    return (int)high;
}

/* the locks saved with f (ck_file_lock records in BLOB), of the given kinds */
static void take_locks(const struct rst_image *im, const struct ck_fd *f, int posix)
{
    for (uint32_t i = 0; i < f->nlocks; i++) {
        struct ck_file_lock l;
        uint64_t off = f->locks_off + (uint64_t)i * sizeof(l);
        if (off + sizeof(l) > im->blob_size)
            rst_fail("corrupt image: a file lock is outside BLOB", 0, 0);
        ck_memcpy(&l, im->blob + off, sizeof(l));
        if ((l.kind == CK_LOCK_POSIX) != posix)
            continue;
        long rc;
        if (l.kind == CK_LOCK_FLOCK) {
            rc = ck_flock(f->fd, (l.type == F_WRLCK ? LOCK_EX : LOCK_SH) | LOCK_NB);
        } else {
            struct flock fl;
            ck_memset(&fl, 0, sizeof(fl));
            fl.l_type = (short)l.type;
            fl.l_whence = SEEK_SET;
            fl.l_start = (off_t)l.start;
            fl.l_len = (off_t)l.len;
            rc = ck_fcntl(f->fd, l.kind == CK_LOCK_OFD ? F_OFD_SETLK : F_SETLK, (long)&fl);
        }
        if (rc < 0)
            rst_fail("cannot take a file lock again (does a process outside the job hold the file locked?)",
                     rst_str(im, f->path), rc);
    }
}

static void place(int tmp, const struct ck_fd *f)
{
    long rc = ck_dup3(tmp, f->fd, (f->fd_flags & FD_CLOEXEC) ? O_CLOEXEC : 0);
    if (rc < 0)
        rst_fail("cannot put a descriptor in place", 0, rc);
    if (f->open_flags & O_PATH)
        return;  /* F_SETFL fails on O_PATH (and it has no status flags to set) */
    rc = ck_fcntl(f->fd, F_SETFL, (long)(f->open_flags & SETFL_MASK));
    if (rc < 0)
        rst_fail("cannot restore a descriptor's status flags", 0, rc);
}

/* the job's stdin/stdout/stderr when what they pointed at is outside the
 * job (a terminal, the old relay): the log through the new relay's pipes */
static int stdio_fd(const struct ck_fd *f)
{
    if (f->fd <= 2 && rst.stdio_fd[f->fd] >= 0)
        return scratch_fd(ck_fcntl(rst.stdio_fd[f->fd], F_DUPFD_CLOEXEC, 0), "stdio", 0);
    return scratch_fd(ck_open("/dev/null", O_RDWR | O_CLOEXEC, 0), "cannot open /dev/null", 0);
}

/* a pipe, FIFO, socket or shared memory object the plan built (plan.c) */
static int from_slot(const struct ck_fd *f, uint32_t kind, const char *path)
{
    int slot = rst_slot_for(kind, f->dev, f->ino);
    if (slot < 0) {
        if (f->fd <= 2 && f->type != CK_FD_SHMEM && f->type != CK_FD_DELETED)
            return stdio_fd(f);
        rst_fail("the restore plan has no object for a descriptor", path, 0);
    }
    if (kind == RST_KEY_FIFO) {
        /* its own open file description, like the original open() */
        int flags = (int)(f->open_flags & O_ACCMODE) | O_NONBLOCK | O_CLOEXEC;
        return scratch_fd(ck_open(path, flags, 0), "cannot reopen a FIFO", path);
    }
    return scratch_fd(ck_fcntl(slot, F_DUPFD_CLOEXEC, 0), "cannot take a shared object", path);
}

/* a memfd, deleted tmpfs file, or deleted file or directory the plan made:
 * its own open file description, like the original memfd_create or open(),
 * reopened through the plan's object (not a dup of it), at its offset */
static int reopen_object(const struct ck_fd *f, uint32_t kind, const char *path)
{
    int obj = from_slot(f, kind, path);
    char link[40];
    struct ck_buf b;
    ck_buf_init(&b, link, sizeof(link));
    ck_buf_str(&b, "/proc/self/fd/");
    ck_buf_u64(&b, (uint64_t)obj);
    /* not O_NOFOLLOW (shm_open's): the /proc link is one */
    int flags = (int)(f->open_flags & ~(uint32_t)(O_CREAT | O_TRUNC | O_EXCL | O_NOFOLLOW)) | O_CLOEXEC;
    int tmp = scratch_fd(ck_open(link, flags, 0), "cannot reopen a file that has no name", path);
    ck_close(obj);
    if ((f->mode & S_IFMT) == S_IFDIR)
        return tmp;
    long rc = ck_lseek(tmp, (int64_t)f->pos, SEEK_SET);
    if (rc < 0)
        rst_fail("cannot seek in a file that has no name", path, rc);
    return tmp;
}

void rst_restore_fds(const struct rst_image *im)
{
    for (uint32_t i = 0; i < im->nfds; i++) {
        const struct ck_fd *f = &im->fds[i];
        if (f->flags & CK_FDF_IN_FLIGHT)
            continue;  /* in a socket's queue, not the process's: the plan sent it again (plan_unix.c) */
        const char *path = rst_str(im, f->path);
        int tmp = -1;
        int shared = f->type == CK_FD_DUP ? -1 : rst_slot_for(RST_KEY_DESC, (uint32_t)im->proc->pid, (uint32_t)f->fd);
        if (shared >= 0) {
            /* its offset and flags are other processes' too: made once by the plan */
            tmp = scratch_fd(ck_fcntl(shared, F_DUPFD_CLOEXEC, 0), "cannot take a shared file", path);
            place(tmp, f);
            ck_close(tmp);
            take_locks(im, f, 0);
            continue;
        }
        switch (f->type) {
        case CK_FD_REG: {
            int flags = (int)(f->open_flags & ~(uint32_t)(O_CREAT | O_TRUNC | O_EXCL)) | O_CLOEXEC;
            tmp = scratch_fd(ck_open(path, flags, 0), "cannot reopen a file", path);
            long rc = ck_lseek(tmp, (int64_t)f->pos, SEEK_SET);
            if (rc < 0)
                rst_fail("cannot seek a reopened file", path, rc);
            break;
        }
        case CK_FD_DIR:
            tmp = scratch_fd(ck_open(path, O_RDONLY | O_DIRECTORY | O_CLOEXEC, 0), "cannot reopen a directory", path);
            break;
        case CK_FD_OPATH: {
            int flags = O_PATH | (int)(f->open_flags & (O_NOFOLLOW | O_DIRECTORY)) | O_CLOEXEC;
            tmp = scratch_fd(ck_open(path, flags, 0), "cannot reopen an O_PATH descriptor", path);
            struct stat st;
            long rc = ck_fstat(tmp, &st);
            if (rc < 0 || st.st_ino != f->ino || st.st_dev != f->dev)
                rst_fail("an O_PATH descriptor's path leads to another file now", path, rc);
            break;
        }
        case CK_FD_CHR:
            tmp = scratch_fd(ck_open(path, (int)(f->open_flags & O_ACCMODE) | O_CLOEXEC, 0), "cannot reopen a device", path);
            break;
        case CK_FD_STDIO:
            tmp = stdio_fd(f);
            break;
        case CK_FD_PIPE: {
            uint32_t kind = (f->flags & CK_FDF_FIFO) ? RST_KEY_FIFO
                            : (f->flags & CK_FDF_PIPE_WRITE_END) ? RST_KEY_PIPE_W : RST_KEY_PIPE_R;
            tmp = from_slot(f, kind, path);
            break;
        }
        case CK_FD_UNIX:
            tmp = from_slot(f, RST_KEY_UNIX, path);
            break;
        case CK_FD_TCP:
            tmp = from_slot(f, RST_KEY_TCP, path);
            break;
        case CK_FD_UDP:
        case CK_FD_RAW:
            tmp = from_slot(f, RST_KEY_DGRAM, path);  /* made by plan_dgram.c */
            break;
        case CK_FD_SHMEM:
            tmp = reopen_object(f, RST_KEY_SHM, path);
            rst_shm_mode_and_seals(tmp, f, path);  /* plan_shm.c */
            break;
        case CK_FD_DELETED:
            tmp = reopen_object(f, RST_KEY_DELETED, path);  /* made by plan_deleted.c */
            break;
        case CK_FD_EVENTFD: {
            int flags = (f->flags & CK_FDF_EVENTFD_SEMAPHORE) ? 1 /* EFD_SEMAPHORE */ : 0;
            tmp = scratch_fd(ck_eventfd2(0, flags | O_CLOEXEC), "cannot create an eventfd", 0);
            if (f->evcount) {
                uint64_t v = f->evcount;
                long rc = ck_write(tmp, &v, sizeof(v));
                if (rc != sizeof(v))
                    rst_fail("cannot restore an eventfd counter", 0, rc);
            }
            break;
        }
        case CK_FD_EPOLL:
            tmp = scratch_fd(ck_epoll_create1(O_CLOEXEC), "cannot create an epoll instance", 0);
            break;
        case CK_FD_TIMERFD:
            tmp = scratch_fd(rst_make_timerfd(f->clockid, f->settime_flags, f->it_interval_ns, f->it_value_ns, f->ticks),
                             "cannot create a timerfd", 0);  /* plan_timerfd.c */
            break;
        case CK_FD_PIDFD:
            /* the pid is kept: the same process of the job, made already by the plan */
            tmp = scratch_fd(ck_sc2(SYS_pidfd_open, f->target_pid, f->open_flags & O_EXCL /* PIDFD_THREAD */),
                             "cannot open a pidfd again (pidfd_open)", path);
            break;
        case CK_FD_INOTIFY:
            tmp = scratch_fd(rst_make_inotify(im, f), "cannot create an inotify instance", 0);  /* inotify.c */
            break;
        case CK_FD_SIGNALFD:
            tmp = scratch_fd(rst_make_signalfd(f->sigmask), "cannot create a signalfd", 0);  /* plan_signalfd.c */
            break;
        case CK_FD_PTY_MASTER: {
            /* one open file description per pair: the plan's (plan_pty.c) */
            int slot = rst_slot_for(RST_KEY_PTY, 0, f->pty_index);
            if (slot < 0)
                rst_fail("the restore plan has no pseudo-terminal for a descriptor", path, 0);
            tmp = scratch_fd(ck_fcntl(slot, F_DUPFD_CLOEXEC, 0), "cannot take a pseudo-terminal", path);
            break;
        }
        case CK_FD_PTY_SLAVE:
            /* its own open file description, like the original open(); the
             * controlling terminal is the session's (plan_tree.c), never taken here */
            if (rst_slot_for(RST_KEY_PTY, 0, f->pty_index) < 0)
                rst_fail("the restore plan has no pseudo-terminal for a descriptor", path, 0);
            tmp = scratch_fd(ck_open(path, (int)(f->open_flags & O_ACCMODE) | O_NOCTTY | O_NONBLOCK | O_CLOEXEC, 0),
                             "cannot reopen a pseudo-terminal's slave", path);
            struct stat st;
            if (ck_fstat(tmp, &st) < 0 || ck_pty_index(st.st_rdev, CK_PTY_SLAVE_MAJOR) != (long)f->pty_index)
                rst_fail("a pseudo-terminal slave's path leads to another device now", path, 0);
            break;
        case CK_FD_DUP:
            continue;
        default:
            rst_fail("corrupt image: unknown descriptor type", 0, 0);
        }
        place(tmp, f);
        ck_close(tmp);
        take_locks(im, f, 0);
    }
    for (uint32_t i = 0; i < im->nfds; i++) {
        const struct ck_fd *f = &im->fds[i];
        if (f->type != CK_FD_DUP || (f->flags & CK_FDF_IN_FLIGHT))
            continue;
        long rc = ck_dup3(f->dup_of, f->fd, (f->fd_flags & FD_CLOEXEC) ? O_CLOEXEC : 0);
        if (rc < 0)
            rst_fail("cannot duplicate a descriptor", 0, rc);
    }
    rst_restore_epolls(im);  /* epoll.c */
    for (int i = 0; i < 3; i++)
        if (rst.stdio_fd[i] >= 0)
            ck_close(rst.stdio_fd[i]);
    rst_close_slots();  /* what this process does not hold must not stay open */
    for (uint32_t i = 0; i < im->nfds; i++)
        if (!(im->fds[i].flags & CK_FDF_IN_FLIGHT))
            take_locks(im, &im->fds[i], 1);
}

/* F_SETOWN_EX and F_SETSIG; an owner in another process of the job may be
 * restored a moment later than this one (ESRCH): wait up to 5 s for it */
void rst_restore_fd_owners(const struct rst_image *im)
{
    for (uint32_t i = 0; i < im->nfds; i++) {
        const struct ck_fd *f = &im->fds[i];
        if (f->type == CK_FD_DUP || (f->flags & CK_FDF_IN_FLIGHT))
            continue;
        if (f->sigio_signal) {
            long rc = ck_fcntl(f->fd, F_SETSIG, (long)f->sigio_signal);
            if (rc < 0)
                rst_fail("cannot restore a descriptor's SIGIO signal (F_SETSIG)", rst_str(im, f->path), rc);
        }
        if (!f->owner_pid)
            continue;
        struct f_owner_ex owner = {(enum __pid_type)f->owner_type, f->owner_pid};
        long rc;
        for (int tries = 0; (rc = ck_fcntl(f->fd, F_SETOWN_EX, (long)&owner)) == -ESRCH && tries < 500; tries++) {
            ck_nanosleep_ms(10);
        }
        if (rc < 0)
            rst_fail("cannot restore a descriptor's SIGIO owner (F_SETOWN_EX)", rst_str(im, f->path), rc);
    }
}
