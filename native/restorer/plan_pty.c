/*
 * Pseudo-terminals in the restore plan (plan.c has the format; the shim's
 * side is native/shim/dump_pty.c): each pair made once at its slot with
 * its number, in the job's own devpts instance (numbered from 0, fresh:
 * ckptd-init mounts it), by opening /dev/ptmx until the kernel gives that
 * number (the numbers below it, not needed, are fillers closed again).
 * Lines come in increasing number, so a filler never takes a number a
 * later line needs.  Each holder of the master takes the slot (one open
 * file description, as the original); each holder of the slave opens it
 * again by path (fds.c); the session leader takes it back as its
 * controlling terminal (plan_tree.c).
 *   pty SLOT INDEX STATE TERMIOS ROW COL XPIXEL YPIXEL FILE OFF LEN
 * STATE: CK_PTY_*; TERMIOS: struct termios2, hex; FILE OFF LEN ("-" 0 0:
 * none): the bytes the master had not read, put back through the slave.
 */
#include "plan.h"
#include "../common/pty.h"

#include <errno.h>

#define MAX_FILLERS 4096

void op_pty(const struct line *l)
{
    static int fillers[MAX_FILLERS];
    int nfillers = 0;
    uint64_t want = num(l, 2), state = num(l, 3);
    long fd;
    for (;;) {
        fd = ck_open("/dev/ptmx", O_RDWR | O_NOCTTY | O_CLOEXEC, 0);
        if (fd < 0)
            rst_fail("cannot open /dev/ptmx to make a pseudo-terminal again", 0, fd);
        uint32_t got = 0;
        long rc = ck_ioctl((int)fd, CK_TIOCGPTN, &got);
        if (rc < 0)
            rst_fail("cannot read a pseudo-terminal's number (TIOCGPTN)", 0, rc);
        if (got == want)
            break;
        if (got > want || nfillers >= MAX_FILLERS)
            rst_fail("cannot give a pseudo-terminal its number again (it is taken: is the job's devpts instance "
                     "its own?)",
                     l->tok[2], 0);
        fillers[nfillers++] = (int)fd;
    }
    int unlock = 0;
    long rc = ck_ioctl((int)fd, CK_TIOCSPTLCK, &unlock);
    struct ck_termios2 tio;
    char hex[2 * sizeof(tio) + 8];
    if (unhex(l, 4, hex, sizeof(hex)) != sizeof(tio))
        rst_fail("corrupt restore plan: a pseudo-terminal's termios", 0, 0);
    ck_memcpy(&tio, hex, sizeof(tio));
    uint16_t ws[4] = {(uint16_t)num(l, 5), (uint16_t)num(l, 6), (uint16_t)num(l, 7), (uint16_t)num(l, 8)};
    if (rc >= 0)
        rc = ck_ioctl((int)fd, CK_TCSETS2, &tio);  /* the slave's, through the master */
    if (rc >= 0)
        rc = ck_ioctl((int)fd, CK_TIOCSWINSZ, ws);
    if (rc < 0)
        rst_fail("cannot set a pseudo-terminal's termios and window size again", l->tok[2], rc);
    uint64_t len = num(l, 11);
    if (len) {
        if (len > CK_PTY_BUF)
            rst_fail("corrupt restore plan: too many bytes for a pseudo-terminal", 0, 0);
        long in = open_data(l, 9);
        rst_pread_all((int)in, bounce, len, num(l, 10), "a pseudo-terminal's saved bytes are truncated");
        ck_close((int)in);
        rc = ck_pty_put_back((int)fd, &tio, bounce, len);
        if (rc < 0)
            rst_fail("cannot put a pseudo-terminal's bytes back", l->tok[2], rc);
    }
    int packet = (state & CK_PTY_PACKET) ? 1 : 0;
    if (packet && (rc = ck_ioctl((int)fd, CK_TIOCPKT, &packet)) < 0)
        rst_fail("cannot put a pseudo-terminal in packet mode again", l->tok[2], rc);
    if (state & CK_PTY_HUP) {
        /* the slave was open once and is closed now: its master reads EIO */
        long peer = ck_ioctl((int)fd, CK_TIOCGPTPEER, (void *)(long)(O_RDWR | O_NOCTTY | O_CLOEXEC));
        if (peer < 0)
            rst_fail("cannot open a pseudo-terminal's slave", l->tok[2], peer);
        ck_close((int)peer);
    }
    if (state & CK_PTY_LOCKED) {
        int lock = 1;
        ck_ioctl((int)fd, CK_TIOCSPTLCK, &lock);
    }
    to_slot(fd, l, 1, "cannot make a pseudo-terminal again");
    for (int i = 0; i < nfillers; i++)
        ck_close(fillers[i]);
}
