/*
 * Pseudo-terminals (tests/test_pty.py): a pair this program opened, checked
 * from inside at every step across a checkpoint and a restart
 * (state_check.h): the same /dev/pts number (ptsname, and the slave's path
 * leads to the slave it holds), termios, window size, lock, packet mode,
 * and master and slave still talking to each other.
 *   pty STEPS pair     a child echoes through the slave what the master
 *                      writes, upper-cased; its answer waits in the
 *                      master's buffer from one step to the next (saved
 *                      and put back), in packet mode
 *   pty STEPS ctty     a child in a session of its own has the slave as its
 *                      controlling terminal, a grandchild's group in front
 *   pty STEPS nomaster the master is closed, the slave held: refused
 *   pty STEPS relock   the pair locked again while its slave is open: refused
 *   pty STEPS hostpts  (root) the job's devpts instance unmounted, a pair
 *                      opened on the host's: refused
 */
#define _GNU_SOURCE
#include "state_check.h"

#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <stdint.h>
#include <sys/ioctl.h>
#include <sys/mount.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <termios.h>
#include <unistd.h>

static int master = -1, slave = -1;
static char name[64];
static struct termios want_tio;
static struct winsize want_ws = {33, 101, 640, 480};
static pid_t child;

static void open_pair(int noctty)
{
    master = posix_openpt(O_RDWR | O_NOCTTY);
    CHECK(master >= 0 && grantpt(master) == 0 && unlockpt(master) == 0, "open a pty");
    CHECK(ptsname_r(master, name, sizeof(name)) == 0, "ptsname");
    slave = open(name, O_RDWR | (noctty ? O_NOCTTY : 0));
    CHECK(slave >= 0, "open %s", name);
    CHECK(tcgetattr(slave, &want_tio) == 0, "tcgetattr");
    want_tio.c_lflag &= ~(ECHO | ICANON | ISIG);
    want_tio.c_cc[VMIN] = 1;
    want_tio.c_cc[VTIME] = 0;
    want_tio.c_cc[VINTR] = 7;
    cfsetspeed(&want_tio, B9600);
    CHECK(tcsetattr(slave, TCSANOW, &want_tio) == 0, "tcsetattr");
    CHECK(ioctl(master, TIOCSWINSZ, &want_ws) == 0, "TIOCSWINSZ");
}

/* what every step checks of the pair, from an end this process holds */
static void check_pair(int fd)
{
    char now[64];
    CHECK(ptsname_r(master >= 0 ? master : fd, now, sizeof(now)) == 0 || master < 0, "ptsname");
    if (master >= 0)
        CHECK(!strcmp(now, name), "ptsname %s, was %s", now, name);
    struct stat a, b;
    CHECK(stat(name, &a) == 0, "stat %s", name);
    if (slave >= 0) {
        CHECK(fstat(slave, &b) == 0 && a.st_rdev == b.st_rdev, "%s is not the slave held", name);
    }
    struct termios t;
    CHECK(tcgetattr(fd, &t) == 0, "tcgetattr");
    CHECK(t.c_iflag == want_tio.c_iflag && t.c_oflag == want_tio.c_oflag && t.c_cflag == want_tio.c_cflag &&
              t.c_lflag == want_tio.c_lflag && !memcmp(t.c_cc, want_tio.c_cc, sizeof(t.c_cc)) &&
              cfgetispeed(&t) == B9600 && cfgetospeed(&t) == B9600,
          "termios changed");
    struct winsize ws;
    CHECK(ioctl(fd, TIOCGWINSZ, &ws) == 0 && !memcmp(&ws, &want_ws, sizeof(ws)), "window size %dx%d", ws.ws_row,
          ws.ws_col);
    if (master >= 0) {
        int locked = -1;
        CHECK(ioctl(master, TIOCGPTLCK, &locked) == 0 && locked == 0, "lock %d", locked);
    }
}

/* ---- pair: the child echoes, upper-cased; the answer waits a step ---- */

static int step_pair_last;

static void echo_child(void)
{
    close(master);
    master = -1;
    for (;;) {
        char c;
        if (read(slave, &c, 1) != 1)
            _exit(2);
        if (c == '#')
            _exit(0);
        char out[2] = {(char)(c - 32), '\n'};  /* OPOST|ONLCR: the master reads "X\r\n" */
        if (write(slave, out, 2) != 2)
            _exit(3);
    }
}

static void check_pair_step(int step)
{
    check_pair(master);
    int pkt = -1;
    CHECK(ioctl(master, TIOCGPKT, &pkt) == 0 && pkt == 1, "packet mode %d", pkt);
    if (step > 1) {
        /* the answer to the last step's letter has waited in the buffer */
        struct pollfd p = {master, POLLIN, 0};
        CHECK(poll(&p, 1, 2000) == 1, "no answer from the slave");
        char buf[16];
        ssize_t n = read(master, buf, sizeof(buf));
        char want[4] = {0, (char)('A' + step_pair_last % 26), '\r', '\n'};
        CHECK(n == 4 && !memcmp(buf, want, 4), "master read %zd bytes: %02x %c", n, buf[0], buf[1]);
    }
    step_pair_last = step;
    char c = (char)('a' + step % 26);
    CHECK(write(master, &c, 1) == 1, "write to the master");
    /* the answer is in the master's buffer before the step ends */
    int inq = 0;
    for (int i = 0; i < 3000 && inq < 3; i++) {
        step_sleep_ms(1);
        ioctl(master, TIOCINQ, &inq);
    }
    CHECK(inq == 3, "the slave's answer did not come (%d bytes)", inq);
}

/* ---- ctty: the slave is a session's controlling terminal ---- */

static pid_t grandchild;

static void check_ctty_child(void)
{
    CHECK(getsid(0) == getpid() && tcgetsid(slave) == getpid(), "not the session of %s", name);
    int tty = open("/dev/tty", O_RDWR | O_NOCTTY);
    unsigned dev = 0;
    struct stat b;
    CHECK(tty >= 0 && ioctl(tty, TIOCGDEV, &dev) == 0 && fstat(slave, &b) == 0 && dev == b.st_rdev,
          "/dev/tty is not %s", name);
    close(tty);
    CHECK(tcgetpgrp(slave) == grandchild, "foreground group %d, not %d", tcgetpgrp(slave), grandchild);
    check_pair(slave);
}

static void ctty_child(int steps)
{
    close(master);
    master = -1;
    close(slave);
    CHECK(setsid() == getpid(), "setsid");
    slave = open(name, O_RDWR); /* without O_NOCTTY: the session's controlling terminal */
    CHECK(slave >= 0, "open %s", name);
    grandchild = fork();
    if (grandchild == 0) {
        setpgid(0, 0);
        for (;;) {
            int tty = open("/dev/tty", O_RDWR | O_NOCTTY);
            if (tty < 0 || getppid() == 1)
                _exit(tty < 0 ? 4 : 0);
            close(tty);
            step_sleep_ms(50);
        }
    }
    setpgid(grandchild, grandchild);
    signal(SIGTTOU, SIG_IGN);
    CHECK(tcsetpgrp(slave, grandchild) == 0, "tcsetpgrp");
    /* twice the parent's steps: it waits for this one at its end */
    for (int i = 0; i < steps * 2 + 20; i++) {
        check_ctty_child();
        step_sleep_ms(50);
    }
    kill(grandchild, SIGKILL);
    _exit(0);
}

static void check_nothing(int step)
{
    (void)step;
}

static void check_ctty_step(int step)
{
    (void)step;
    check_pair(master);
    int st;
    CHECK(waitpid(child, &st, WNOHANG) == 0, "the child ended: status %x", st);
}

int main(int argc, char **argv)
{
    int steps = steps_of(argc, argv);
    const char *mode = argc > 2 ? argv[2] : "pair";
    if (!strcmp(mode, "pair")) {
        /* a pair opened and closed first: this one's number is not the lowest */
        int first = posix_openpt(O_RDWR | O_NOCTTY);
        open_pair(1);
        close(first);
        int on = 1;
        CHECK(ioctl(master, TIOCPKT, &on) == 0, "TIOCPKT");
        child = fork();
        if (child == 0)
            echo_child();
        close(slave);
        slave = -1;
        run_steps(steps, check_pair_step);
        struct pollfd p = {master, POLLIN, 0};
        char buf[16];
        if (poll(&p, 1, 2000) == 1 && read(master, buf, sizeof(buf)) < 0)
            return 1;
        CHECK(write(master, "#", 1) == 1, "write #");
    } else if (!strcmp(mode, "ctty")) {
        open_pair(1);
        child = fork();
        if (child == 0)
            ctty_child(steps);
        close(slave);
        slave = -1;
        run_steps(steps, check_ctty_step);
        kill(child, SIGKILL);
        waitpid(child, 0, 0);
        return 0;
    } else if (!strcmp(mode, "nomaster")) {
        open_pair(1);
        close(master);
        master = -1;
        run_steps(steps, check_nothing);
        return 0;
    } else if (!strcmp(mode, "relock")) {
        open_pair(1);
        int lock = 1;
        CHECK(ioctl(master, TIOCSPTLCK, &lock) == 0, "TIOCSPTLCK");
        run_steps(steps, check_nothing);
        return 0;
    } else if (!strcmp(mode, "hostpts")) {
        CHECK(umount2("/dev/pts", MNT_DETACH) == 0, "umount /dev/pts");
        open_pair(1);
        run_steps(steps, check_nothing);
        return 0;
    } else {
        CHECK(0, "unknown mode %s", mode);
    }
    int st;
    CHECK(waitpid(child, &st, 0) == child && WIFEXITED(st) && WEXITSTATUS(st) == 0, "the child ended: %x", st);
    return 0;
}
