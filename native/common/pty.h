/*
 * Pseudo-terminals through raw ioctls, shared by the shim (native/shim/
 * dump_pty.c: saving a pair, and putting back the bytes it read from the
 * master) and the freestanding restorer (native/restorer/plan_pty.c:
 * making the pair again).
 *
 * A pair's termios and window size are the slave's; the kernel reads and
 * sets them through either end (tty_mode_ioctl uses the master's link).
 * The master's own line discipline is raw (the pty driver's master
 * termios, which no ioctl reaches), so bytes written by the slave with
 * output processing off arrive at the master exactly as they were.
 */
#ifndef CKPTD_PTY_H
#define CKPTD_PTY_H

#include "sys.h"

#include <errno.h>

#define CK_TCGETS2 0x802c542aul
#define CK_TCSETS2 0x402c542bul
#define CK_TIOCGWINSZ 0x5413ul
#define CK_TIOCSWINSZ 0x5414ul
#define CK_TIOCINQ 0x541bul
#define CK_TIOCSCTTY 0x540eul
#define CK_TIOCSPGRP 0x5410ul
#define CK_TIOCPKT 0x5420ul
#define CK_TIOCGPTN 0x80045430ul
#define CK_TIOCSPTLCK 0x40045431ul
#define CK_TIOCGPKT 0x80045438ul
#define CK_TIOCGPTLCK 0x80045439ul
#define CK_TIOCGPTPEER 0x5441ul
#define CK_OPOST 1u

/* the bytes the n_tty line discipline holds: what can be put back whole */
#define CK_PTY_BUF 4096

/* unix98 pty device numbers: slaves 136..143, masters 128..135 (index / 256) */
#define CK_PTY_SLAVE_MAJOR 136u
#define CK_PTY_MASTER_MAJOR 128u

struct ck_termios2 {
    uint32_t c_iflag, c_oflag, c_cflag, c_lflag;
    uint8_t c_line;
    uint8_t c_cc[19];
    uint32_t c_ispeed, c_ospeed;
};

/* the index of a pty whose (kernel-encoded) device number is dev, of
 * major first_major; -1 when it is not one */
static inline long ck_pty_index(uint64_t dev, unsigned first_major)
{
    unsigned major = (unsigned)(((dev >> 8) & 0xfff) | ((dev >> 32) & ~0xfffull));
    unsigned minor = (unsigned)((dev & 0xff) | ((dev >> 12) & ~0xffull));
    if (major < first_major || major >= first_major + 8)
        return -1;
    return (long)(major - first_major) * 256 + minor;
}

/*
 * Put len bytes back in front of the master's reader: the slave (a new
 * description, TIOCGPTPEER) writes them with output processing off, then
 * its termios is set back to saved.  They reach the master's line
 * discipline from a work queue: wait for them (1 s at most) before output
 * processing comes back.  0, or a negative errno.
 */
static inline long ck_pty_put_back(int master, const struct ck_termios2 *saved, const char *buf, size_t len)
{
    int before = 0;
    ck_ioctl(master, CK_TIOCINQ, &before);
    long peer = ck_ioctl(master, CK_TIOCGPTPEER, (void *)(long)(O_RDWR | O_NOCTTY | O_NONBLOCK | O_CLOEXEC));
    if (peer < 0)
        return peer;
    struct ck_termios2 raw = *saved;
    raw.c_oflag &= ~CK_OPOST;
    long rc = ck_ioctl((int)peer, CK_TCSETS2, &raw);
    for (size_t done = 0, tries = 0; rc >= 0 && done < len;) {
        long w = ck_write((int)peer, buf + done, len - done);
        if (w == -EINTR || (w == -EAGAIN && ++tries < 1000)) {
            if (w == -EAGAIN)
                ck_nanosleep_ms(1);
            continue;
        }
        if (w <= 0)
            rc = w < 0 ? w : -EIO;
        else
            done += (size_t)w;
    }
    for (int i = 0; rc >= 0; i++) {
        int now = 0;
        ck_ioctl(master, CK_TIOCINQ, &now);
        if ((size_t)now >= (size_t)before + len)
            break;
        if (i >= 1000)
            rc = -ETIMEDOUT;
        else
            ck_nanosleep_ms(1);
    }
    long back = ck_ioctl((int)peer, CK_TCSETS2, (void *)saved);
    ck_close((int)peer);
    return rc < 0 ? rc : back;
}

#endif
