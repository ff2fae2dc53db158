/*
 * File descriptors: one ck_fd per open descriptor, classified by what it
 * points at.  Descriptors sharing one open file description (dup, or 2>&1)
 * are recorded as CK_FD_DUP of the lowest so the restore shares offsets and
 * flags again.  Unsupported kinds fail the checkpoint with their name.
 */
#include "shim.h"
#include "../common/sys.h"
#include "../common/util.h"
#include "../common/maps.h"

#include <errno.h>
#include <linux/kcmp.h>
#include <sys/ioctl.h>

#ifndef F_GET_SEALS
#define F_GET_SEALS 1034
#endif

#ifndef F_GETPIPE_SZ
#define F_GETPIPE_SZ 1032
#define F_SETPIPE_SZ 1031
#endif
#ifndef SPLICE_F_NONBLOCK
#define SPLICE_F_NONBLOCK 2
#endif

static const char *const reopenable_devices[] = {
    "/dev/null", "/dev/zero", "/dev/full", "/dev/random", "/dev/urandom",
};

static int is_reopenable_device(const char *path)
{
    for (size_t i = 0; i < sizeof(reopenable_devices) / sizeof(reopenable_devices[0]); i++)
        if (!ck_strcmp(path, reopenable_devices[i]))
            return 1;
    return 0;
}

static void fd_path(char *out, size_t cap, const char *dir, int fd)
{
    struct ck_buf b;
    ck_buf_init(&b, out, cap);
    ck_buf_str(&b, dir);
    ck_buf_u64(&b, (uint64_t)fd);
}

static int describing_flight;  /* dump_one of a descriptor in flight: its number is only our copy's */

int ck_fail_fd(struct ck_image *im, int fd, const char *why, const char *target)
{
    char what[320];
    struct ck_buf b;
    ck_buf_init(&b, what, sizeof(what));
    if (describing_flight) {
        ck_buf_str(&b, "a Unix socket has a file descriptor in flight (SCM_RIGHTS sent, not yet received) that ckptd "
                       "cannot save (");
        ck_buf_str(&b, why);
        ck_buf_str(&b, ")");
        return ck_image_fail(im, what, target, 0);
    }
    ck_buf_str(&b, "unsupported file descriptor ");
    ck_buf_u64(&b, (uint64_t)fd);
    ck_buf_str(&b, " (");
    ck_buf_str(&b, why);
    ck_buf_str(&b, ")");
    return ck_image_fail(im, what, target, 0);
}

/* copy a pipe's buffered bytes into BLOB without consuming them (tee) */
static int save_pipe_data(struct ck_image *im, struct ck_fd *f, int readfd)
{
    int avail = 0;
    f->flags |= CK_FDF_DATA_SAVED;
    f->data_off = im->blob.count;
    f->data_len = 0;
    if (ck_ioctl(readfd, FIONREAD, &avail) < 0 || avail <= 0)
        return 0;
    int tmp[2];
    long rc = ck_pipe2(tmp, O_CLOEXEC | O_NONBLOCK);
    if (rc < 0)
        return ck_image_fail(im, "cannot create a pipe to copy pipe contents", 0, rc);
    /* as many slots as the source, so tee can take every buffer at once */
    ck_fcntl(tmp[1], F_SETPIPE_SZ, (long)f->pipe_size);
    long n = ck_tee(readfd, tmp[1], (size_t)avail, SPLICE_F_NONBLOCK);
    int ok = n == avail;
    f->data_off = im->blob.count;
    f->data_len = 0;
    while (ok && f->data_len < (uint64_t)avail) {
        char chunk[4096];
        long r = ck_read(tmp[0], chunk, sizeof(chunk));
        if (r <= 0) {
            ok = 0;
            break;
        }
        if (ck_table_bytes_append(&im->blob, chunk, (size_t)r) == UINT64_MAX) {
            ok = 0;
            break;
        }
        f->data_len += (uint64_t)r;
    }
    ck_close(tmp[0]);
    ck_close(tmp[1]);
    if (!ok)
        return ck_image_fail(im, "cannot copy the contents of a pipe", 0, n < 0 ? n : 0);
    return 0;
}

/* parse "key: value" lines of /proc/self/fdinfo/N */
static uint64_t fdinfo_value(const char *text, const char *key, int base)
{
    size_t kl = ck_strlen(key);
    for (const char *p = text; *p;) {
        if (ck_strncmp(p, key, kl) == 0)
            return ck_parse_u64(ck_skip_spaces(p + kl), base, 0);
        while (*p && *p != '\n')
            p++;
        if (*p)
            p++;
    }
    return 0;
}

/* a deleted file or memfd on tmpfs: its contents can be saved and recreated */
static int is_shmem(int fd)
{
    struct {
        long f_type;
        char rest[112];
    } sfs;
    return ck_fstatfs(fd, &sfs) == 0 && (sfs.f_type == 0x01021994 /* TMPFS_MAGIC */ ||
                                          sfs.f_type == (long)0x958458f6 /* HUGETLBFS_MAGIC */);
}

/*
 * A timerfd: its clock, its interval and the time left, relative (what was
 * left at the checkpoint is what is left after the restart, as for the
 * process's interval timers), and the expirations not read yet.  One armed
 * with TFD_TIMER_ABSTIME on a wall clock keeps its deadline instead (a
 * timer for 12:00 still fires at 12:00); on the monotonic clocks, which
 * start again on another boot, the time left is kept as for any other, e.g.
 *   clockid: 1  ticks: 0  settime flags: 01  it_value: (0, 49406829) ...
 * A timer that is cancelled when the clock is set (TFD_TIMER_CANCEL_ON_SET)
 * is refused: the restore could not tell whether the clock was set meanwhile.
 */
static int dump_timerfd(struct ck_image *im, struct ck_fd *f, const char *info, const char *target)
{
    struct {
        int64_t interval_sec, interval_nsec, value_sec, value_nsec;
    } its;
    long rc = ck_sc2(SYS_timerfd_gettime, f->fd, &its);
    if (rc < 0)
        return ck_image_fail(im, "cannot read a timerfd (timerfd_gettime)", target, rc);
    if (fdinfo_value(info, "settime flags:", 8) & 2 /* TFD_TIMER_CANCEL_ON_SET */)
        return ck_fail_fd(im, f->fd,
                          "timerfd armed with TFD_TIMER_CANCEL_ON_SET: ckptd cannot tell whether the clock "
                          "was set between the checkpoint and the restart",
                          target);
    f->type = CK_FD_TIMERFD;
    f->clockid = (uint32_t)fdinfo_value(info, "clockid:", 10);
    f->ticks = fdinfo_value(info, "ticks:", 10);
    f->it_interval_ns = (uint64_t)its.interval_sec * 1000000000ull + (uint64_t)its.interval_nsec;
    f->it_value_ns = (uint64_t)its.value_sec * 1000000000ull + (uint64_t)its.value_nsec;
    int wall = f->clockid == 0 /* CLOCK_REALTIME */ || f->clockid == 8 /* CLOCK_REALTIME_ALARM */;
    if ((fdinfo_value(info, "settime flags:", 8) & 1 /* TFD_TIMER_ABSTIME */) && wall && f->it_value_ns) {
        struct timespec now;
        rc = ck_clock_gettime((int)f->clockid, &now);
        if (rc < 0)
            return ck_image_fail(im, "cannot read the clock of a timerfd", target, rc);
        f->it_value_ns += (uint64_t)now.tv_sec * 1000000000ull + (uint64_t)now.tv_nsec;
        f->settime_flags = 1;
    }
    return 0;
}

/*
 * A pidfd: the pid it refers to, as the job's pid namespace (its /proc)
 * sees it ("Pid:" of its fdinfo); the restore keeps pids, so pidfd_open
 * finds the same process again.  0: a process outside the job; -1: one that
 * exited and was reaped.  Neither can be opened again.
 */
static int dump_pidfd(struct ck_image *im, struct ck_fd *f, const char *info, const char *target)
{
    const char *p = info;
    while (*p && !ck_startswith(p, "Pid:")) {
        while (*p && *p != '\n')
            p++;
        if (*p)
            p++;
    }
    if (!*p)
        return ck_fail_fd(im, f->fd, "pidfd whose process the kernel does not name (no Pid: in its fdinfo)", target);
    p = ck_skip_spaces(p + 4);
    if (*p == '-')
        return ck_fail_fd(im, f->fd,
                          "pidfd of a process that has exited and been reaped: pidfd_open cannot refer to it again",
                          target);
    int64_t pid = (int64_t)ck_parse_u64(p, 10, 0);
    if (pid <= 0)
        return ck_fail_fd(im, f->fd,
                          "pidfd of a process outside the job: ckptd keeps only the job's pids on restore", target);
    f->type = CK_FD_PIDFD;
    f->target_pid = (int32_t)pid;
    return 0;
}

static int classify(struct ck_image *im, struct ck_fd *f, const char *target, const struct stat *st,
                    char *info, size_t infocap)
{
    int fd = f->fd;
    if (f->open_flags & O_PATH) {
        /* a place in the file system, whatever is there: reopened by path */
        if (target[0] != '/' || ck_endswith(target, " (deleted)"))
            return ck_fail_fd(im, fd, "O_PATH descriptor of a removed file", target);
        f->type = CK_FD_OPATH;
        return 0;
    }
    switch (st->st_mode & S_IFMT) {
    case S_IFREG:
        if (ck_endswith(target, " (deleted)")) {
            if (!is_shmem(fd))
                return ck_dump_deleted(im, f, target, st);  /* dump_deleted.c */
            f->type = CK_FD_SHMEM;
            f->pos = (uint64_t)ck_lseek(fd, 0, SEEK_CUR);
            if (ck_startswith(target, "/memfd:")) {
                long seals = ck_fcntl(fd, F_GET_SEALS, 0);
                if (seals < 0)
                    return ck_image_fail(im, "cannot read a memfd's seals (F_GET_SEALS)", target, seals);
                f->flags |= CK_FDF_MEMFD;
                f->seals = (uint32_t)seals;
            }
            return ck_save_shmem_fd(im, f);
        }
        if (target[0] != '/')
            return ck_fail_fd(im, fd, "file without a path", target);
        f->type = CK_FD_REG;
        f->pos = (uint64_t)ck_lseek(fd, 0, SEEK_CUR);
        if ((f->open_flags & O_ACCMODE) != O_RDONLY)
            f->flags |= CK_FDF_WRITTEN;
        return 0;
    case S_IFDIR:
        if (ck_endswith(target, " (deleted)"))
            return ck_dump_deleted(im, f, target, st);  /* dump_deleted.c */
        f->type = CK_FD_DIR;
        return 0;
    case S_IFCHR:
        if (is_reopenable_device(target)) {
            f->type = CK_FD_CHR;
            return 0;
        }
        if (ck_is_pty(fd, st))
            return ck_dump_pty(im, f, target, st);  /* dump_pty.c */
        if (fd <= 2 && (ck_startswith(target, "/dev/pts/") || ck_startswith(target, "/dev/tty"))) {
            f->type = CK_FD_STDIO;  /* the terminal will be gone: use the log */
            return 0;
        }
        /* the agent moves a GPU's memory out, closing these, for the
         * processes that held one at the round's ready step (agent/gpu.py):
         * one opened since is the next round's to move */
        if (ck_startswith(target, "/dev/nvidia"))
            return ck_image_passing(im, ck_fail_fd(im, fd, "an NVIDIA device whose memory this round did not move (opened after the round began: the next one moves it)", target));
        return ck_fail_fd(im, fd, "character device", target);
    case S_IFIFO:
        if (!ck_startswith(target, "pipe:")) {
            if (target[0] != '/' || ck_endswith(target, " (deleted)"))
                return ck_fail_fd(im, fd, "FIFO without a path", target);
            f->flags |= CK_FDF_FIFO;
        }
        f->pipe_size = (uint64_t)ck_fcntl(fd, F_GETPIPE_SZ, 0);
        if ((f->open_flags & O_ACCMODE) == O_WRONLY)
            f->flags |= CK_FDF_PIPE_WRITE_END;
        f->type = CK_FD_PIPE;  /* the restore plan decides: job-internal, or the log */
        return 0;
    case S_IFSOCK:
        return ck_dump_socket(im, f, im->diag_fd, target);
    default:
        break;
    }
    int is_eventfd = ck_strcmp(target, "anon_inode:[eventfd]") == 0;
    int is_epoll = ck_strcmp(target, "anon_inode:[eventpoll]") == 0;
    int is_timerfd = ck_strcmp(target, "anon_inode:[timerfd]") == 0;
    int is_signalfd = ck_strcmp(target, "anon_inode:[signalfd]") == 0;
    int is_pidfd = ck_strcmp(target, "anon_inode:[pidfd]") == 0;
    int is_inotify = ck_strcmp(target, "anon_inode:inotify") == 0;
    if (!is_eventfd && !is_epoll && !is_timerfd && !is_signalfd && !is_pidfd && !is_inotify)
        return ck_fail_fd(im, fd, "kind not supported yet", target);
    char path[64];
    fd_path(path, sizeof(path), "/proc/self/fdinfo/", fd);
    long n = ck_read_file(path, info, infocap - 1);
    if (n < 0)
        return ck_image_fail(im, "cannot read fdinfo", path, n);
    info[n] = 0;
    if (is_eventfd) {
        f->type = CK_FD_EVENTFD;
        f->evcount = fdinfo_value(info, "eventfd-count:", 16);
        if (fdinfo_value(info, "eventfd-semaphore:", 10))
            f->flags |= CK_FDF_EVENTFD_SEMAPHORE;
        return 0;
    }
    if (is_timerfd)
        return dump_timerfd(im, f, info, target);
    if (is_pidfd)
        return dump_pidfd(im, f, info, target);
    if (is_inotify)
        return ck_dump_inotify(im, f, info, target);  /* dump_inotify.c */
    if (is_signalfd) {
        /* what it reads is its mask; the signals pending are the process's */
        f->type = CK_FD_SIGNALFD;
        f->sigmask = fdinfo_value(info, "sigmask:", 16);
        return 0;
    }
    f->type = CK_FD_EPOLL;
    return ck_dump_epoll(im, f, info);
}

/* the n-th whitespace-separated word of a line (n from 0), or 0 */
static const char *word(const char *line, int n)
{
    const char *p = ck_skip_spaces(line);
    for (int i = 0; i < n; i++) {
        while (*p && *p != ' ' && *p != '\t' && *p != '\n')
            p++;
        while (*p == ' ' || *p == '\t')
            p++;
        if (!*p || *p == '\n')
            return 0;
    }
    return p;
}

/*
 * The file locks held through descriptor f (the "lock:" lines of its fdinfo:
 * flock and OFD locks of its description, POSIX locks this process took on
 * it), into BLOB; a lease refuses the checkpoint.  A line reads
 *   lock:	1: POSIX  ADVISORY  WRITE 1234 00:2a:5678 10 19
 *   lock:	2: OFDLCK ADVISORY  READ  -1 00:2a:5678 50 EOF
 *   lock:	3: FLOCK  ADVISORY  WRITE 1234 00:2a:5678 0 EOF
 *   lock:	4: LEASE  ACTIVE    READ  1234 00:2a:5678 0 EOF
 */
static int dump_locks(struct ck_image *im, struct ck_fd *f, const char *info, const char *target)
{
    f->locks_off = im->blob.count;
    for (const char *p = info; *p;) {
        if (ck_startswith(p, "lock:")) {
            const char *line = p + 5, *kind = word(line, 1), *type = word(line, 3);
            const char *start = word(line, 6), *end = word(line, 7);
            struct ck_file_lock l = {0, 0, 0, 0};
            if (kind && (ck_startswith(kind, "LEASE") || ck_startswith(kind, "DELEG"))) {
                char what[160];
                struct ck_buf b;
                ck_buf_init(&b, what, sizeof(what));
                ck_buf_str(&b, "holds a file lease (F_SETLEASE) through descriptor ");
                ck_buf_u64(&b, (uint64_t)f->fd);
                ck_buf_str(&b, ": ckptd cannot restore leases; release it (F_SETLEASE F_UNLCK) before a checkpoint");
                return ck_image_fail(im, what, target, 0);
            }
            if (kind && ck_startswith(kind, "FLOCK"))
                l.kind = CK_LOCK_FLOCK;
            else if (kind && ck_startswith(kind, "POSIX"))
                l.kind = CK_LOCK_POSIX;
            else if (kind && ck_startswith(kind, "OFDLCK"))
                l.kind = CK_LOCK_OFD;
            if (!l.kind || !type || !start || !end)
                return ck_fail_fd(im, f->fd, "a kind of file lock ckptd cannot read", target);
            l.type = ck_startswith(type, "WRITE") ? F_WRLCK : F_RDLCK;
            if (l.kind != CK_LOCK_FLOCK) {
                l.start = ck_parse_u64(start, 10, 0);
                l.len = ck_startswith(end, "EOF") ? 0 : ck_parse_u64(end, 10, 0) - l.start + 1;
            }
            if (ck_table_bytes_append(&im->blob, &l, sizeof(l)) == UINT64_MAX)
                return ck_image_fail(im, "too many file locks", 0, 0);
            f->nlocks++;
        }
        while (*p && *p != '\n')
            p++;
        if (*p)
            p++;
    }
    return 0;
}

/* the SIGIO owner and signal of f's description, and its file locks */
static int dump_owner_and_locks(struct ck_image *im, struct ck_fd *f, const char *target, char *info, size_t infocap)
{
    struct f_owner_ex owner = {0, 0};
    if (ck_fcntl(f->fd, F_GETOWN_EX, (long)&owner) == 0 && owner.pid) {
        f->owner_type = (uint32_t)owner.type;
        f->owner_pid = owner.pid;
    }
    long sig = ck_fcntl(f->fd, F_GETSIG, 0);
    f->sigio_signal = sig > 0 ? (uint32_t)sig : 0;
    char path[64];
    fd_path(path, sizeof(path), "/proc/self/fdinfo/", f->fd);
    long n = ck_read_file(path, info, infocap - 1);
    if (n < 0)
        return ck_image_fail(im, "cannot read fdinfo", path, n);
    info[n] = 0;
    return dump_locks(im, f, info, target);
}

/* lowest earlier descriptor sharing this open file description, or -1 */
static int find_dup(struct ck_image *im, struct ck_fd *f, int pid)
{
    for (size_t i = 0; i + 1 < im->fds.count; i++) {
        struct ck_fd *o = ck_table_at(&im->fds, i);
        if (o->type == CK_FD_DUP || o->ino != f->ino || o->dev != f->dev)
            continue;
        if (ck_kcmp(pid, pid, KCMP_FILE, o->fd, f->fd) == 0)
            return o->fd;
    }
    return -1;
}

/* describe descriptor fd into a new record; 1: closed meanwhile (no record) */
static int dump_one(struct ck_image *im, int fd, int pid, int in_flight)
{
    static char target[4096];
    static char info[65536];
    char path[64];
    fd_path(path, sizeof(path), "/proc/self/fd/", fd);
    long tl = ck_readlink(path, target, sizeof(target) - 1);
    if (tl < 0)
        return 1;  /* closed meanwhile */
    target[tl] = 0;
    struct stat st;
    if (ck_fstat(fd, &st) < 0)
        return 1;
    struct ck_fd *f = ck_table_push(&im->fds);
    if (!f)
        return ck_image_fail(im, "too many file descriptors", 0, 0);
    f->fd = fd;
    f->open_flags = (uint32_t)ck_fcntl(fd, F_GETFL, 0);
    f->fd_flags = (uint32_t)ck_fcntl(fd, F_GETFD, 0);
    f->mode = st.st_mode;
    f->dev = st.st_dev;
    f->ino = st.st_ino;
    f->size = (uint64_t)st.st_size;
    f->mtime_ns = (int64_t)st.st_mtim.tv_sec * 1000000000LL + st.st_mtim.tv_nsec;
    f->dup_of = find_dup(im, f, pid);
    f->path = ck_image_string(im, target);
    if (in_flight)
        f->flags |= CK_FDF_IN_FLIGHT;
    if (f->dup_of >= 0) {
        f->type = CK_FD_DUP;
        return 0;
    }
    if (!in_flight)
        return classify(im, f, target, &st, info, sizeof(info)) < 0 ||
                       dump_owner_and_locks(im, f, target, info, sizeof(info)) < 0
                   ? -1
                   : 0;
    /* in flight: only the kinds the plan can make at a slot and send again
     * (its locks and SIGIO owner are the receiver's to set, once received) */
    ck_flight_describing(1);
    describing_flight = 1;
    int rc = classify(im, f, target, &st, info, sizeof(info));
    describing_flight = 0;
    ck_flight_describing(0);
    if (rc < 0)
        return ck_image_passing(im, rc);  /* the receiver may take it meanwhile */
    if (f->type == CK_FD_REG || f->type == CK_FD_DIR || f->type == CK_FD_CHR || f->type == CK_FD_PIPE ||
        f->type == CK_FD_UNIX)
        return 0;
    char what[256];
    struct ck_buf b;
    ck_buf_init(&b, what, sizeof(what));
    const char *kind = f->type == CK_FD_TCP   ? "a TCP socket"
                       : f->type == CK_FD_UDP ? "a UDP or ping socket"
                       : f->type == CK_FD_RAW ? "a raw socket"
                                              : "of a kind";
    ck_buf_str(&b, "a Unix socket has a file descriptor in flight (SCM_RIGHTS sent, not yet received), ");
    ck_buf_str(&b, kind);
    ck_buf_str(&b, " ckptd cannot send again: ");
    ck_buf_str(&b, target);
    return ck_image_passing(im, ck_image_fail(im, what, 0, 0));
}

int ck_dump_fds(struct ck_image *im)
{
    static char dents[16384];
    int pid = (int)ck_getpid();
    ck_flight_close();  /* an earlier round's, if its ABORT never came */
    /* opened before listing, so it is never mistaken for one of the job's */
    im->diag_fd = ck_sock_diag_open();
    long dfd = ck_open("/proc/self/fd", O_RDONLY | O_DIRECTORY | O_CLOEXEC, 0);
    if (dfd < 0) {
        if (im->diag_fd >= 0)
            ck_close(im->diag_fd);
        return ck_image_fail(im, "cannot open /proc/self/fd", 0, dfd);
    }

    int rc = 0;
    for (;;) {
        long n = ck_getdents64((int)dfd, dents, sizeof(dents));
        if (n < 0) {
            rc = ck_image_fail(im, "cannot list /proc/self/fd", 0, n);
            break;
        }
        if (n == 0)
            break;
        for (long off = 0; off < n && rc == 0;) {
            struct ck_linux_dirent64 *d = (void *)(dents + off);
            off += d->d_reclen;
            if (d->d_name[0] < '0' || d->d_name[0] > '9')
                continue;
            int fd = (int)ck_parse_u64(d->d_name, 10, 0);
            /* a copy of a descriptor in flight that a socket's peek installed: below */
            if (fd == dfd || fd == im->diag_fd || ck_image_is_own_fd(im, fd) || ck_flight_has(fd))
                continue;
            if (dump_one(im, fd, pid, 0) < 0)
                rc = -1;
        }
        if (rc)
            break;
    }
    /* the descriptors in flight, after every descriptor of the process (so
     * one the process holds too is their CK_FD_DUP, not the other way) */
    for (uint32_t i = 0; rc == 0 && i < ck_flight_count(); i++) {
        if (dump_one(im, ck_flight_fd(i), pid, 1) < 0)
            rc = -1;
    }
    ck_close((int)dfd);
    if (im->diag_fd >= 0)
        ck_close(im->diag_fd);
    im->diag_fd = -1;
    if (rc || (rc = ck_dump_epoll_holders(im)) < 0)
        return rc;

    /* a pipe's buffered bytes, once per pipe, from its first read end here;
     * every process holding a read end saves them and the plan keeps one */
    for (size_t i = 0; i < im->fds.count; i++) {
        struct ck_fd *f = ck_table_at(&im->fds, i);
        if (f->type != CK_FD_PIPE || (f->flags & CK_FDF_PIPE_WRITE_END))
            continue;
        int first = 1;
        for (size_t j = 0; j < i && first; j++) {
            struct ck_fd *o = ck_table_at(&im->fds, j);
            if (o->type == CK_FD_PIPE && o->ino == f->ino && (o->flags & CK_FDF_DATA_SAVED))
                first = 0;
        }
        if (first && save_pipe_data(im, f, f->fd) < 0)
            return -1;
    }
    return 0;
}
