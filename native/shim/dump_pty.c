/*
 * Pseudo-terminals (CK_FD_PTY_MASTER, CK_FD_PTY_SLAVE) and a controlling
 * terminal that is one of them.  A pair is known by its number, N of
 * /dev/pts/N, which a program may keep (ptsname): the restart gives it the
 * same one, which it can only do in a devpts instance of the job's own
 * (ckptd-init mounts one, source "ckptd-devpts", at the job's /dev/pts:
 * numbers start at 0 there and the restorer takes them in order).  A pty
 * anywhere else is refused.
 *
 * The master saves the pair's state: the slave's termios and window size,
 * its lock and packet mode, whether the slave was closed (its master reads
 * EIO), and the bytes the slave wrote that the master has not read: read,
 * then put back at once through the slave (native/common/pty.h), so the job
 * goes on with them.  Bytes the master wrote that the slave has not read
 * cannot be put back in front of the slave's line discipline exactly: a
 * slave holding some refuses the checkpoint as a passing state.
 */
#include "shim.h"
#include "../common/sys.h"
#include "../common/util.h"
#include "../common/maps.h"
#include "../common/pty.h"

#include <errno.h>
#include <poll.h>

/* the device of the job's own devpts instance (the mount at /dev/pts whose
 * source is ckptd-devpts), as stat's st_dev encodes it; 0 if none */
static uint64_t own_devpts(void)
{
    static char buf[65536];
    long n = ck_read_file("/proc/self/mountinfo", buf, sizeof(buf) - 1);
    if (n <= 0)
        return 0;
    buf[n] = 0;
    uint64_t dev = 0;
    for (const char *p = buf; *p;) {
        /* ID PARENT MAJOR:MINOR ROOT MOUNTPOINT OPTS [TAGS...] - TYPE SOURCE SUPEROPTS */
        const char *line = p;
        while (*p && *p != '\n')
            p++;
        const char *end = p;
        if (*p)
            p++;
        const char *f = line;
        for (int i = 0; i < 2 && f < end; i++) {
            while (f < end && *f != ' ')
                f++;
            f++;
        }
        const char *mm = f, *mp = f;
        for (int i = 0; i < 2 && mp < end; i++) {
            while (mp < end && *mp != ' ')
                mp++;
            mp++;
        }
        if (mp >= end || ck_strncmp(mp, "/dev/pts ", 9))
            continue;
        const char *dash = mp;
        while (dash + 3 <= end && ck_strncmp(dash, " - ", 3))
            dash++;
        /* the last mount at /dev/pts is the one on top */
        dev = 0;
        if (dash + 3 > end || ck_strncmp(dash + 3, "devpts ckptd-devpts ", 20))
            continue;
        const char *colon;
        uint64_t major = ck_parse_u64(mm, 10, &colon), minor = ck_parse_u64(colon + 1, 10, 0);
        dev = (minor & 0xff) | (major << 8) | ((minor & ~0xffull) << 12);
    }
    return dev;
}

static int not_own(struct ck_image *im, struct ck_fd *f, const char *target)
{
    return ck_fail_fd(im, f->fd,
                      "pseudo-terminal outside the job's own devpts instance (ckptd-init mounts one at /dev/pts "
                      "when it can): ckptd could not give it the same /dev/pts number again",
                      target);
}

static int dump_master(struct ck_image *im, struct ck_fd *f, const char *target)
{
    int fd = f->fd;
    uint32_t index = 0;
    int locked = 0, packet = 0;
    long rc = ck_ioctl(fd, CK_TIOCGPTN, &index);
    if (rc < 0)
        return ck_image_fail(im, "cannot read a pseudo-terminal's number (TIOCGPTN)", target, rc);
    char slave[40];
    struct ck_buf b;
    ck_buf_init(&b, slave, sizeof(slave));
    ck_buf_str(&b, "/dev/pts/");
    ck_buf_u64(&b, index);
    struct stat st;
    uint64_t own = own_devpts();
    if (!own || ck_stat(slave, &st) < 0 || st.st_dev != own || ck_pty_index(st.st_rdev, CK_PTY_SLAVE_MAJOR) != index)
        return not_own(im, f, slave);
    f->type = CK_FD_PTY_MASTER;
    f->pty_index = index;
    if (ck_ioctl(fd, CK_TIOCGPTLCK, &locked) < 0 || ck_ioctl(fd, CK_TIOCGPKT, &packet) < 0)
        return ck_image_fail(im, "cannot read a pseudo-terminal's lock and packet mode", slave, 0);
    f->pty_state = (locked ? CK_PTY_LOCKED : 0) | (packet ? CK_PTY_PACKET : 0);
    struct pollfd pfd = {fd, POLLIN | POLLPRI, 0};
    rc = ck_sc3(SYS_poll, &pfd, 1, 0);
    if (rc < 0)
        return ck_image_fail(im, "cannot poll a pseudo-terminal's master", slave, rc);
    if (pfd.revents & POLLHUP)
        f->pty_state |= CK_PTY_HUP;
    if (packet && (pfd.revents & POLLPRI))
        return ck_image_passing(im, ck_fail_fd(im, fd,
                                               "packet-mode pseudo-terminal master with a status byte not read "
                                               "yet; retry the checkpoint",
                                               slave));

    /* two processes holding this master dump at once: one at a time reads
     * and puts back (each saves the same bytes; the plan keeps one) */
    struct flock fl = {F_WRLCK, SEEK_SET, (off_t)(1ll << 62) + (off_t)index, 1, 0};
    int lockable = (f->open_flags & O_ACCMODE) == O_RDWR;
    if (lockable && (rc = ck_fcntl(fd, F_SETLKW, (long)&fl)) < 0)
        return ck_image_fail(im, "cannot lock a pseudo-terminal's master for the checkpoint", slave, rc);
    struct ck_termios2 tio;
    int avail = 0;
    rc = ck_ioctl(fd, CK_TCGETS2, &tio);
    if (rc >= 0)
        rc = ck_ioctl(fd, CK_TIOCGWINSZ, f->winsize);
    if (rc >= 0)
        rc = ck_ioctl(fd, CK_TIOCINQ, &avail);
    ck_memcpy(f->termios, &tio, sizeof(f->termios));
    f->flags |= CK_FDF_DATA_SAVED;
    f->data_off = im->blob.count;
    f->data_len = 0;
    int result = 0;
    if (rc < 0) {
        result = ck_image_fail(im, "cannot read a pseudo-terminal's termios and window size", slave, rc);
    } else if (avail > 0 && (avail >= CK_PTY_BUF - 1 || locked)) {
        result = ck_fail_fd(im, fd,
                            locked ? "locked pseudo-terminal whose master has bytes not read"
                                   : "pseudo-terminal whose master has a full buffer not read: ckptd cannot put "
                                     "back what waits behind it",
                            slave);
    } else if (avail > 0) {
        static char data[CK_PTY_BUF + 1];
        long fl_was = ck_fcntl(fd, F_GETFL, 0);
        ck_fcntl(fd, F_SETFL, fl_was | O_NONBLOCK);
        /* everything, also bytes still on their way from the slave (the
         * kernel hands them to the master's line discipline from a work
         * queue): they are later than the ones there, so they go back
         * after them; done when it reads empty twice, 1 ms apart */
        size_t got = 0;
        for (int quiet = 0; quiet < 2 && got < CK_PTY_BUF;) {
            long r = ck_read(fd, data + got, CK_PTY_BUF - got + (packet ? 1 : 0));
            if (r == -EINTR)
                continue;
            if (r == -EAGAIN) {
                quiet++;
                ck_nanosleep_ms(1);
                continue;
            }
            if (r <= 0)
                break;  /* EIO: the slave is closed, nothing more comes */
            quiet = 0;
            if (packet) {  /* TIOCPKT_DATA (0) first, then the bytes */
                if (data[got] != 0)
                    break;
                for (long i = 1; i < r; i++)
                    data[got + (size_t)i - 1] = data[got + (size_t)i];
                r--;
            }
            got += (size_t)r;
        }
        ck_fcntl(fd, F_SETFL, fl_was);
        rc = got ? ck_pty_put_back(fd, &tio, data, got) : 0;
        if (got < (size_t)avail || rc < 0)
            result = ck_image_fail(im,
                                   "cannot read a pseudo-terminal master's bytes and put them back (some may be "
                                   "lost to the job)",
                                   slave, rc);
        else if (ck_table_bytes_append(&im->blob, data, got) == UINT64_MAX)
            result = ck_image_fail(im, "out of room for a pseudo-terminal's bytes", 0, 0);
        else
            f->data_len = got;
    }
    if (lockable) {
        fl.l_type = F_UNLCK;
        ck_fcntl(fd, F_SETLK, (long)&fl);
    }
    return result;
}

static int dump_slave(struct ck_image *im, struct ck_fd *f, const char *target, long index)
{
    uint64_t own = own_devpts();
    if (!own || f->dev != own)
        return not_own(im, f, target);
    f->type = CK_FD_PTY_SLAVE;
    f->pty_index = (uint32_t)index;
    int unread = 0;
    if (ck_ioctl(f->fd, CK_TIOCINQ, &unread) == 0 && unread > 0)
        return ck_image_passing(im, ck_fail_fd(im, f->fd,
                                               "pseudo-terminal slave with bytes its master wrote not read yet, "
                                               "which ckptd cannot put back exactly; retry the checkpoint",
                                               target));
    return 0;
}

int ck_dump_pty(struct ck_image *im, struct ck_fd *f, const char *target, const struct stat *st)
{
    long slave = ck_pty_index(st->st_rdev, CK_PTY_SLAVE_MAJOR);
    if (slave >= 0)
        return dump_slave(im, f, target, slave);
    return dump_master(im, f, target);
}

/* a pty master or slave; a slave at 0-2 outside the job's own devpts is a
 * terminal the job was started on (CK_FD_STDIO) */
int ck_is_pty(int fd, const struct stat *st)
{
    if (st->st_rdev == ((5 << 8) | 2))  /* /dev/ptmx, /dev/pts/ptmx */
        return 1;
    if (ck_pty_index(st->st_rdev, CK_PTY_SLAVE_MAJOR) < 0)
        return 0;
    return fd > 2 || st->st_dev == own_devpts();
}

/*
 * The controlling terminal (tty_nr and tpgid of /proc/self/stat) when it is
 * one of the job's ptys: the restart gives it back to the session (a
 * process not in it has none).  Another terminal is refused: the job's
 * session starts without one (ckptd-init), so it is one the job opened.
 */
int ck_dump_ctty(struct ck_image *im, struct ck_proc *p, uint64_t tty_nr, int64_t tpgid)
{
    if (!tty_nr)
        return 0;
    long slave = ck_pty_index(tty_nr, CK_PTY_SLAVE_MAJOR), master = ck_pty_index(tty_nr, CK_PTY_MASTER_MAJOR);
    if ((slave < 0 && master < 0) || !own_devpts())
        return ck_image_fail(im,
                             "the process has a controlling terminal that is not one of the job's own "
                             "pseudo-terminals: ckptd cannot give it back",
                             0, 0);
    p->ctty_kind = slave >= 0 ? CK_FD_PTY_SLAVE : CK_FD_PTY_MASTER;
    p->ctty_index = (uint32_t)(slave >= 0 ? slave : master);
    p->ctty_pgrp = (int32_t)tpgid;
    return 0;
}
