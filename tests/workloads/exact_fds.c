/*
 * File descriptor state that must come back exactly (issue 18, "Exact or
 * refused"; tests/test_exact_fds.py).  argv: STEPS MODE DIR, where MODE is
 *   flags   one descriptor of every kind the restore makes, each with its
 *           F_GETFL status flags and F_GETFD flags checked at every step
 *   owner   SIGIO owners (F_SETOWN pid, F_SETOWN_EX tid and process group)
 *           and F_SETSIG signals
 *   offset  open file descriptions shared by a parent and its child (open,
 *           then fork): a file's and a memfd's offsets both move, an eventfd
 *           both count on; and a second description of the memfd keeps its own
 *   flock   flock(LOCK_EX) and flock(LOCK_SH): a second description of the
 *           same file gets EWOULDBLOCK
 *   posix   fcntl F_SETLK ranges: a child's F_GETLK reports them, with this
 *           process's pid
 *   ofd     F_OFD_SETLK ranges: a second description's F_OFD_GETLK reports them
 *   lease   F_SETLEASE F_RDLCK on a file (ckptd refuses the checkpoint)
 *   packet  a packet-mode pipe (O_DIRECT) holding two messages (refused)
 * Its files go to a new directory under DIR.
 */
#define _GNU_SOURCE
#include "state_check.h"

#include <fcntl.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <sys/file.h>
#include <sys/ioctl.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <stdint.h>
#include <sys/wait.h>
#include <unistd.h>

#define FLAG_BITS (O_ACCMODE | O_APPEND | O_ASYNC | O_DIRECT | O_NOATIME | O_NONBLOCK)

static const char *dir;
static char path_buf[4096];

static const char *in_dir(const char *name)
{
    snprintf(path_buf, sizeof(path_buf), "%s/%s", dir, name);
    return path_buf;
}

static int make_file(const char *name, int flags)
{
    int fd = open(in_dir(name), O_CREAT | O_RDWR | O_TRUNC, 0644);
    CHECK(fd >= 0, "create %s", name);
    char buf[4096];
    memset(buf, 'x', sizeof(buf));
    CHECK(write(fd, buf, sizeof(buf)) == (ssize_t)sizeof(buf), "fill %s", name);
    close(fd);
    fd = open(in_dir(name), flags);
    CHECK(fd >= 0, "open %s", name);
    return fd;
}

/* ---- flags ---- */

struct watched {
    const char *what;
    int fd;
    int fl, fdfl;
};
static struct watched w[32];
static int nw;

static void watch(const char *what, int fd)
{
    CHECK(fd >= 0, "set up %s", what);
    w[nw].what = what;
    w[nw].fd = fd;
    w[nw].fl = fcntl(fd, F_GETFL) & FLAG_BITS;
    w[nw].fdfl = fcntl(fd, F_GETFD);
    nw++;
}

static int setfl(int fd, int add)
{
    CHECK(fcntl(fd, F_SETFL, fcntl(fd, F_GETFL) | add) == 0, "F_SETFL %#x on fd %d", add, fd);
    return fd;
}

static void setup_flags(void)
{
    int p[2];
    CHECK(pipe2(p, O_NONBLOCK) == 0, "pipe2");
    watch("pipe read end, O_NONBLOCK", p[0]);
    watch("pipe write end, O_NONBLOCK", p[1]);
    CHECK(pipe2(p, O_CLOEXEC) == 0, "pipe2");
    watch("pipe read end, O_NONBLOCK by F_SETFL", setfl(p[0], O_NONBLOCK));
    watch("pipe write end, blocking", p[1]);
    CHECK(pipe2(p, O_DIRECT) == 0, "pipe2(O_DIRECT)");
    watch("packet-mode pipe read end", p[0]);
    watch("packet-mode pipe write end", p[1]);
    CHECK(mkfifo(in_dir("fifo"), 0600) == 0, "mkfifo");
    watch("FIFO, O_RDWR|O_NONBLOCK", open(in_dir("fifo"), O_RDWR | O_NONBLOCK));
    CHECK(mkfifo(in_dir("fifo2"), 0600) == 0, "mkfifo");
    watch("FIFO, O_RDONLY|O_NONBLOCK", open(in_dir("fifo2"), O_RDONLY | O_NONBLOCK));
    watch("FIFO, O_WRONLY|O_NONBLOCK|O_APPEND", open(in_dir("fifo2"), O_WRONLY | O_NONBLOCK | O_APPEND));
    CHECK(pipe(p) == 0, "pipe");
    watch("pipe read end, O_ASYNC", setfl(p[0], O_ASYNC));
    watch("stdin, O_NONBLOCK by F_SETFL", setfl(0, O_NONBLOCK));
    watch("stderr, O_NONBLOCK by F_SETFL", setfl(2, O_NONBLOCK));
    watch("file, O_APPEND", make_file("append", O_WRONLY | O_APPEND | O_CLOEXEC));
    watch("file, O_NOATIME", make_file("noatime", O_RDONLY | O_NOATIME));
    watch("file, O_DIRECT", make_file("direct", O_RDONLY | O_DIRECT));
    watch("file, O_NONBLOCK", make_file("nonblock", O_RDWR | O_NONBLOCK));
    watch("directory, O_NOATIME", open(dir, O_RDONLY | O_DIRECTORY | O_NOATIME));
    watch("/dev/null, O_APPEND|O_NONBLOCK", open("/dev/null", O_WRONLY | O_APPEND | O_NONBLOCK));
    watch("eventfd, EFD_NONBLOCK", eventfd(3, EFD_NONBLOCK));
    watch("epoll, O_NONBLOCK by F_SETFL", setfl(epoll_create1(EPOLL_CLOEXEC), O_NONBLOCK));
    int sv[2];
    CHECK(socketpair(AF_UNIX, SOCK_STREAM | SOCK_NONBLOCK, 0, sv) == 0, "socketpair");
    watch("Unix socket, SOCK_NONBLOCK", sv[0]);
    watch("Unix socket, O_ASYNC by F_SETFL", setfl(sv[1], O_ASYNC));
    int t = socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
    struct sockaddr_in sa = {.sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
    CHECK(bind(t, (struct sockaddr *)&sa, sizeof(sa)) == 0 && listen(t, 4) == 0, "TCP listener");
    watch("TCP listener, SOCK_NONBLOCK|O_ASYNC", setfl(t, O_ASYNC));
    int m = memfd_create("exact-fds", 0);
    CHECK(ftruncate(m, 4096) == 0, "ftruncate memfd");
    watch("memfd, O_APPEND|O_NONBLOCK by F_SETFL", setfl(m, O_APPEND | O_NONBLOCK));
}

static void check_flags(int step)
{
    (void)step;
    for (int i = 0; i < nw; i++) {
        int fl = fcntl(w[i].fd, F_GETFL) & FLAG_BITS, fdfl = fcntl(w[i].fd, F_GETFD);
        CHECK(fl == w[i].fl, "%s (fd %d): F_GETFL %#o, was %#o", w[i].what, w[i].fd, fl, w[i].fl);
        CHECK(fdfl == w[i].fdfl, "%s (fd %d): F_GETFD %d, was %d", w[i].what, w[i].fd, fdfl, w[i].fdfl);
    }
}

/* ---- owner ---- */

static int own_pid, own_tid, own_pgrp;

static void setup_owner(void)
{
    int p[2];
    CHECK(pipe(p) == 0, "pipe");
    own_pid = p[0];
    CHECK(fcntl(own_pid, F_SETOWN, getpid()) == 0, "F_SETOWN");
    CHECK(fcntl(own_pid, F_SETSIG, SIGRTMIN + 2) == 0, "F_SETSIG");
    setfl(own_pid, O_ASYNC);
    int sv[2];
    CHECK(socketpair(AF_UNIX, SOCK_STREAM, 0, sv) == 0, "socketpair");
    own_tid = sv[0];
    struct f_owner_ex ex = {F_OWNER_TID, (pid_t)syscall(SYS_gettid)};
    CHECK(fcntl(own_tid, F_SETOWN_EX, &ex) == 0, "F_SETOWN_EX tid");
    CHECK(fcntl(own_tid, F_SETSIG, SIGUSR2) == 0, "F_SETSIG");
    own_pgrp = make_file("owned", O_RDONLY);
    CHECK(fcntl(own_pgrp, F_SETOWN, -getpgrp()) == 0, "F_SETOWN -pgrp");
}

static void check_owner_of(int fd, int type, pid_t pid, int sig)
{
    struct f_owner_ex ex;
    CHECK(fcntl(fd, F_GETOWN_EX, &ex) == 0, "F_GETOWN_EX");
    CHECK((int)ex.type == type && ex.pid == pid, "fd %d: owner type %d pid %d, was type %d pid %d", fd, ex.type,
          ex.pid, type, pid);
    int s = fcntl(fd, F_GETSIG);
    CHECK(s == sig, "fd %d: F_GETSIG %d, was %d", fd, s, sig);
}

static void check_owner(int step)
{
    (void)step;
    check_owner_of(own_pid, F_OWNER_PID, getpid(), SIGRTMIN + 2);
    check_owner_of(own_tid, F_OWNER_TID, (pid_t)syscall(SYS_gettid), SIGUSR2);
    check_owner_of(own_pgrp, F_OWNER_PGRP, getpgrp(), 0);
}

/* ---- offset ---- */

static int shared_fd, shared_memfd, own_memfd, shared_efd, ping[2], pong[2];
static pid_t child;

static void child_bad(const char *what, long long got, long long want)
{
    printf("BAD child: %s %lld, want %lld\n", what, got, want);
    fflush(stdout);
    _exit(1);
}

static void child_loop(void)
{
    char s;
    /* one turn per byte: the parent moved the offsets to 2*step and
     * counted 1 on the eventfd; this side checks and moves them on by one */
    while (read(ping[0], &s, 1) == 1) {
        off_t at = lseek(shared_fd, 0, SEEK_CUR), mat = lseek(shared_memfd, 0, SEEK_CUR);
        if (at != 2 * (off_t)s)
            child_bad("shared file offset", at, 2 * s);
        if (mat != 2 * (off_t)s)
            child_bad("shared memfd offset", mat, 2 * s);
        uint64_t v = 0;
        if (read(shared_efd, &v, sizeof(v)) != sizeof(v) || v != 1)
            child_bad("shared eventfd count", (long long)v, 1);
        lseek(shared_fd, 2 * s + 1, SEEK_SET);
        lseek(shared_memfd, 2 * s + 1, SEEK_SET);
        if (write(pong[1], &s, 1) != 1)
            _exit(1);
    }
    _exit(0);
}

static void setup_offset(void)
{
    shared_fd = make_file("shared", O_RDWR);
    shared_memfd = memfd_create("shared", 0);
    CHECK(ftruncate(shared_memfd, 4096) == 0, "ftruncate");
    /* a description of its own of the same memfd: its offset is its own */
    char link[64];
    snprintf(link, sizeof(link), "/proc/self/fd/%d", shared_memfd);
    own_memfd = open(link, O_RDWR);
    CHECK(own_memfd >= 0 && lseek(own_memfd, 1000, SEEK_SET) == 1000, "reopen the memfd");
    shared_efd = eventfd(0, EFD_NONBLOCK);
    CHECK(shared_efd >= 0 && pipe(ping) == 0 && pipe(pong) == 0, "eventfd and pipes");
    child = fork();
    CHECK(child >= 0, "fork");
    if (child == 0) {
        close(ping[1]);
        close(pong[0]);
        close(own_memfd);
        child_loop();
    }
    close(ping[0]);
    close(pong[1]);
}

static void check_offset(int step)
{
    char s = (char)step;
    lseek(shared_fd, 2 * step, SEEK_SET);
    lseek(shared_memfd, 2 * step, SEEK_SET);
    uint64_t one = 1;
    CHECK(write(shared_efd, &one, sizeof(one)) == sizeof(one), "count on the eventfd");
    CHECK(write(ping[1], &s, 1) == 1, "ping the child");
    CHECK(read(pong[0], &s, 1) == 1, "the child's answer");
    off_t at = lseek(shared_fd, 0, SEEK_CUR), mat = lseek(shared_memfd, 0, SEEK_CUR);
    CHECK(at == 2 * step + 1, "shared file offset %lld, the child left %d", (long long)at, 2 * step + 1);
    CHECK(mat == 2 * step + 1, "shared memfd offset %lld, the child left %d", (long long)mat, 2 * step + 1);
    off_t own = lseek(own_memfd, 0, SEEK_CUR);
    CHECK(own == 1000, "the memfd's other description is at %lld, not 1000", (long long)own);
}

static void finish_offset(void)
{
    close(ping[1]);
    int st;
    CHECK(waitpid(child, &st, 0) == child && WIFEXITED(st) && WEXITSTATUS(st) == 0, "the child failed");
}

/* ---- locks ---- */

static int lk_ex, lk_sh, lk_posix, lk_ofd;

static void setup_flock(void)
{
    lk_ex = make_file("flock-ex", O_RDONLY);
    CHECK(flock(lk_ex, LOCK_EX) == 0, "flock LOCK_EX");
    lk_sh = make_file("flock-sh", O_RDONLY);
    CHECK(flock(lk_sh, LOCK_SH) == 0, "flock LOCK_SH");
}

static void check_flock(int step)
{
    (void)step;
    int other = open(in_dir("flock-ex"), O_RDONLY);
    CHECK(flock(other, LOCK_SH | LOCK_NB) < 0 && errno == EWOULDBLOCK, "the exclusive flock is not held");
    close(other);
    other = open(in_dir("flock-sh"), O_RDONLY);
    CHECK(flock(other, LOCK_EX | LOCK_NB) < 0 && errno == EWOULDBLOCK, "the shared flock is not held");
    CHECK(flock(other, LOCK_SH | LOCK_NB) == 0, "a second shared flock is refused");
    close(other);
}

static struct flock range(int type, off_t start, off_t len)
{
    struct flock l = {.l_type = (short)type, .l_whence = SEEK_SET, .l_start = start, .l_len = len};
    return l;
}

static void setup_posix(void)
{
    lk_posix = make_file("posix", O_RDWR);
    struct flock a = range(F_WRLCK, 10, 10), b = range(F_RDLCK, 100, 0);
    CHECK(fcntl(lk_posix, F_SETLK, &a) == 0 && fcntl(lk_posix, F_SETLK, &b) == 0, "F_SETLK");
}

/* what another process sees of the lock on [start, start+len) */
static void check_posix_range(int type, off_t start, off_t len)
{
    pid_t me = getpid(), c = fork();
    CHECK(c >= 0, "fork");
    if (c == 0) {
        struct flock l = range(F_WRLCK, start, len);
        if (fcntl(lk_posix, F_GETLK, &l) < 0 || l.l_type != type || l.l_pid != me || l.l_start != start ||
            l.l_len != len) {
            printf("BAD posix lock at %lld: type %d pid %d start %lld len %lld\n", (long long)start, l.l_type,
                   l.l_pid, (long long)l.l_start, (long long)l.l_len);
            fflush(stdout);
            _exit(1);
        }
        _exit(0);
    }
    int st;
    CHECK(waitpid(c, &st, 0) == c && WIFEXITED(st) && WEXITSTATUS(st) == 0, "the lock checker failed");
}

static void check_posix(int step)
{
    (void)step;
    check_posix_range(F_WRLCK, 10, 10);
    check_posix_range(F_RDLCK, 100, 0);
}

static void setup_ofd(void)
{
    lk_ofd = make_file("ofd", O_RDWR);
    struct flock a = range(F_WRLCK, 0, 5), b = range(F_RDLCK, 50, 50);
    CHECK(fcntl(lk_ofd, F_OFD_SETLK, &a) == 0 && fcntl(lk_ofd, F_OFD_SETLK, &b) == 0, "F_OFD_SETLK");
}

static void check_ofd_range(int other, int type, off_t start, off_t len)
{
    struct flock l = range(F_WRLCK, start, len);
    CHECK(fcntl(other, F_OFD_GETLK, &l) == 0, "F_OFD_GETLK");
    CHECK(l.l_type == type && l.l_pid == -1 && l.l_start == start && l.l_len == len,
          "OFD lock at %lld: type %d pid %d start %lld len %lld", (long long)start, l.l_type, l.l_pid,
          (long long)l.l_start, (long long)l.l_len);
}

static void check_ofd(int step)
{
    (void)step;
    int other = open(in_dir("ofd"), O_RDWR);
    CHECK(other >= 0, "open ofd");
    check_ofd_range(other, F_WRLCK, 0, 5);
    check_ofd_range(other, F_RDLCK, 50, 50);
    close(other);
}

/* ---- lease ---- */

static int leased;

static void setup_lease(void)
{
    leased = make_file("leased", O_RDONLY);
    CHECK(fcntl(leased, F_SETLEASE, F_RDLCK) == 0, "F_SETLEASE");
}

static void check_lease(int step)
{
    (void)step;
    CHECK(fcntl(leased, F_GETLEASE) == F_RDLCK, "the lease is gone");
}

/* ---- packet ---- */

static int packets[2];

static void setup_packet(void)
{
    CHECK(pipe2(packets, O_DIRECT) == 0, "pipe2(O_DIRECT)");
    CHECK(write(packets[1], "one", 3) == 3 && write(packets[1], "two", 3) == 3, "write two messages");
}

static void check_packet(int step)
{
    (void)step;
    int n = 0;
    CHECK(ioctl(packets[0], FIONREAD, &n) == 0 && n == 6, "%d bytes in the packet-mode pipe, not 6", n);
}

int main(int argc, char **argv)
{
    CHECK(argc == 4, "usage: exact_fds STEPS MODE DIR");
    const char *mode = argv[2];
    /* a directory of its own: the reference run runs alongside */
    static char own[4096];
    snprintf(own, sizeof(own), "%s/exact-XXXXXX", argv[3]);
    dir = mkdtemp(own);
    CHECK(dir, "mkdtemp in %s", argv[3]);
    void (*check)(int) = 0;
    if (!strcmp(mode, "flags")) {
        setup_flags();
        check = check_flags;
    } else if (!strcmp(mode, "owner")) {
        setup_owner();
        check = check_owner;
    } else if (!strcmp(mode, "offset")) {
        setup_offset();
        check = check_offset;
    } else if (!strcmp(mode, "flock")) {
        setup_flock();
        check = check_flock;
    } else if (!strcmp(mode, "posix")) {
        setup_posix();
        check = check_posix;
    } else if (!strcmp(mode, "ofd")) {
        setup_ofd();
        check = check_ofd;
    } else if (!strcmp(mode, "packet")) {
        setup_packet();
        check = check_packet;
    } else if (!strcmp(mode, "lease")) {
        setup_lease();
        check = check_lease;
    }
    CHECK(check, "unknown mode %s", mode);
    int rc = run_steps(steps_of(argc, argv), check);
    if (check == check_offset)
        finish_offset();
    return rc;
}
