/*
 * Descriptor kinds ckptd saves and restores exactly (issue 19;
 * tests/test_fd_kinds.py).  argv: STEPS MODE DIR, where MODE is
 *   deleted    open files whose names were removed (not on tmpfs): one held
 *              by two descriptions and shared with a child (offset, contents,
 *              mode, link count 0, both see one inode), one whose path was
 *              taken again by a new file
 *   dirs       a working directory and an open directory that were removed,
 *              a file held open in a tree removed whole
 *   hardlink   a deleted name of a file that has another link (refused)
 *   timerfd    timerfds on several clocks: armed one-shot, periodic, expired
 *              with an expiration not read, disarmed with an interval; one
 *              shared with a child (one count of expirations)
 *   cancel     a timerfd with TFD_TIMER_CANCEL_ON_SET (refused)
 *   signalfd   signalfds with their masks and flags; a signal pending for one;
 *              one shared with a child (its status flags)
 *   opath      symlinks opened with O_PATH|O_NOFOLLOW, one dangling
 *   inotify    watches with gaps in their numbers (removed ones), events read
 *              at every step, the next watch's number after the highest ever
 *   rawinotify an inotify made by the raw system call (refused)
 *   sharedinotify  an inotify a child shares (refused)
 *   pidfd      pidfds of a live child, of a zombie child and of itself
 *   reaped     a pidfd of a child that exited and was reaped (refused)
 *   sharedpidfd  a pidfd a child shares (refused)
 * Its files go to a new directory under DIR (on the test's file system).
 */
#define _GNU_SOURCE
#include "state_check.h"

#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <stdint.h>
#include <linux/magic.h>
#include <sys/inotify.h>
#include <sys/signalfd.h>
#include <sys/statfs.h>
#include <sys/syscall.h>
#include <sys/pidfd.h>
#include <sys/stat.h>
#include <sys/timerfd.h>
#include <sys/wait.h>
#include <unistd.h>

static char dir[2048];
static char path_buf[2200];

static const char *in_dir(const char *name)
{
    snprintf(path_buf, sizeof(path_buf), "%s/%s", dir, name);
    return path_buf;
}

/* the target of /proc/self/fd/FD (or /proc/self/cwd when fd < 0) */
static const char *link_of(int fd)
{
    static char target[4096];
    char p[64];
    if (fd < 0)
        snprintf(p, sizeof(p), "/proc/self/cwd");
    else
        snprintf(p, sizeof(p), "/proc/self/fd/%d", fd);
    ssize_t n = readlink(p, target, sizeof(target) - 1);
    CHECK(n > 0, "readlink %s", p);
    target[n] = 0;
    return target;
}

/* a "key: value" of /proc/self/fdinfo/FD */
static unsigned long long fdinfo(int fd, const char *key, int base)
{
    char p[64], text[4096];
    snprintf(p, sizeof(p), "/proc/self/fdinfo/%d", fd);
    FILE *f = fopen(p, "r");
    CHECK(f, "open %s", p);
    size_t n = fread(text, 1, sizeof(text) - 1, f);
    fclose(f);
    text[n] = 0;
    char *at = strstr(text, key);
    CHECK(at, "fdinfo %d has no %s", fd, key);
    return strtoull(at + strlen(key), 0, base);
}

static int nsteps;

/* a child of the job that waits (up to its steps and 5 s more) for COND,
 * something the parent does through a descriptor they share at its last
 * step; the parent's last step reaps it (watcher_done) */
static pid_t fork_watcher(int (*cond)(void))
{
    pid_t pid = fork();
    CHECK(pid >= 0, "fork");
    if (pid)
        return pid;
    for (int i = 0; i < nsteps + 50; i++) {
        if (cond())
            _exit(0);
        step_sleep_ms(100);
    }
    _exit(1);
}

static void watcher_done(pid_t pid, const char *what)
{
    int status;
    CHECK(waitpid(pid, &status, 0) == pid, "wait");
    CHECK(WIFEXITED(status) && WEXITSTATUS(status) == 0, "the child did not see %s", what);
}

/* ---- deleted ---- */

#define BIG_HOLE (1 << 20)
static int del_rw, del_ro, del_taken, taken_new;
static pid_t del_child;
static char del_link[4096], taken_prefix[4096];

static void pattern_at(int fd, off_t off, char c, size_t n)
{
    char buf[4096];
    memset(buf, c, n);
    CHECK(pwrite(fd, buf, n, off) == (ssize_t)n, "pwrite %c", c);
}

static void expect_at(int fd, off_t off, char c, size_t n)
{
    char buf[4096];
    CHECK(pread(fd, buf, n, off) == (ssize_t)n, "pread %c", c);
    for (size_t i = 0; i < n; i++)
        CHECK(buf[i] == c, "byte %zu at %lld is %d, not %c", i, (long long)off, buf[i], c);
}

/* the inode both descriptions see: the same one, after a restart too */
static ino_t ino_of(int fd)
{
    struct stat st;
    CHECK(fstat(fd, &st) == 0, "fstat");
    return st.st_ino;
}

static void check_deleted_common(int fd)
{
    struct stat st;
    CHECK(fstat(fd, &st) == 0, "fstat");
    CHECK(st.st_nlink == 0, "link count %lu", (unsigned long)st.st_nlink);
    CHECK((st.st_mode & 07777) == 0640, "mode %o", st.st_mode & 07777);
    expect_at(fd, 0, 'a', 100);
    expect_at(fd, BIG_HOLE, 'z', 10);
}

static void setup_deleted(void)
{
    CHECK(strlen(dir) < 2000, "a shorter DIR");
    strcat(dir, "/sub");
    const char *sub = dir;
    CHECK(mkdir(sub, 0755) == 0, "mkdir");
    struct statfs sfs;
    CHECK(statfs(sub, &sfs) == 0 && sfs.f_type != TMPFS_MAGIC, "%s is on tmpfs (a deleted file there is shared memory)",
          sub);
    del_rw = open(in_dir("data"), O_RDWR | O_CREAT | O_EXCL, 0600);
    CHECK(del_rw >= 0, "create data");
    CHECK(fchmod(del_rw, 0640) == 0, "chmod");
    pattern_at(del_rw, 0, 'a', 100);
    pattern_at(del_rw, BIG_HOLE, 'z', 10);
    del_ro = open(in_dir("data"), O_RDONLY | O_NONBLOCK);
    CHECK(del_ro >= 0, "open data again");
    CHECK(lseek(del_rw, 100, SEEK_SET) == 100, "seek");
    CHECK(lseek(del_ro, 50, SEEK_SET) == 50, "seek");
    snprintf(del_link, sizeof(del_link), "%s (deleted)", in_dir("data"));
    CHECK(unlink(in_dir("data")) == 0, "unlink");

    /* removed, then its path taken by another file */
    del_taken = open(in_dir("taken"), O_RDWR | O_CREAT | O_EXCL | O_APPEND, 0600);
    CHECK(del_taken >= 0, "create taken");
    CHECK(write(del_taken, "old", 3) == 3, "write taken");
    CHECK(unlink(in_dir("taken")) == 0, "unlink taken");
    taken_new = open(in_dir("taken"), O_RDWR | O_CREAT | O_EXCL, 0600);
    CHECK(taken_new >= 0 && write(taken_new, "new", 3) == 3, "the new taken");
    snprintf(taken_prefix, sizeof(taken_prefix), "%s", in_dir("taken"));

    /* a child holding the same description: it reads what the parent writes */
    del_child = fork();
    CHECK(del_child >= 0, "fork");
    if (del_child == 0) {
        for (int i = 0; i < nsteps; i++) {
            struct stat cs;
            if (fstat(del_rw, &cs) < 0 || cs.st_nlink != 0 || cs.st_ino != ino_of(del_ro))
                _exit(2);
            char c;
            if (pread(del_rw, &c, 1, 0) != 1 || c != 'a')
                _exit(3);
            step_sleep_ms(100);
        }
        /* the parent's writes moved the offset they share */
        off_t at = lseek(del_rw, 0, SEEK_CUR);
        _exit(at > 100 ? 0 : 4);
    }
}

static void check_deleted(int step)
{
    check_deleted_common(del_rw);
    check_deleted_common(del_ro);
    CHECK(ino_of(del_rw) == ino_of(del_ro), "two inodes");
    CHECK(!strcmp(link_of(del_rw), del_link), "fd link %s", link_of(del_rw));
    CHECK(lseek(del_ro, 0, SEEK_CUR) == 50, "second description's offset");
    CHECK((fcntl(del_ro, F_GETFL) & (O_ACCMODE | O_NONBLOCK)) == (O_RDONLY | O_NONBLOCK), "flags");
    CHECK((fcntl(del_rw, F_GETFL) & O_ACCMODE) == O_RDWR, "flags");
    /* one write per step through the shared description, read by the other */
    off_t at = lseek(del_rw, 0, SEEK_CUR);
    CHECK(at == 100 + step - 1, "offset %lld at step %d", (long long)at, step);
    char c = (char)('A' + step % 26);
    CHECK(write(del_rw, &c, 1) == 1, "write");
    expect_at(del_ro, at, c, 1);
    /* the removed file whose path is taken: its own contents, no name */
    char buf[8] = {0};
    CHECK(pread(del_taken, buf, 3, 0) == 3 && !memcmp(buf, "old", 3), "taken contents %s", buf);
    CHECK(pread(taken_new, buf, 3, 0) == 3 && !memcmp(buf, "new", 3), "new contents %s", buf);
    const char *l = link_of(del_taken);
    CHECK(!strncmp(l, taken_prefix, strlen(taken_prefix)) && strstr(l, " (deleted)"), "taken link %s", l);
    CHECK(fcntl(del_taken, F_GETFL) & O_APPEND, "O_APPEND");
    struct stat st;
    CHECK(fstat(del_taken, &st) == 0 && st.st_nlink == 0 && st.st_size == 3, "taken stat");
    if (step == nsteps) {
        int status;
        CHECK(waitpid(del_child, &status, 0) == del_child, "wait");
        CHECK(WIFEXITED(status) && WEXITSTATUS(status) == 0, "child status %#x", status);
    }
}

/* ---- dirs ---- */

static int ddir, in_tree;
static char cwd_link[4096], ddir_link[4096], tree_link[4096], tree_top[2200];

static void setup_dirs(void)
{
    CHECK(mkdir(in_dir("cwd"), 0750) == 0, "mkdir cwd");
    CHECK(chmod(in_dir("cwd"), 0751) == 0, "chmod cwd");
    snprintf(cwd_link, sizeof(cwd_link), "%s (deleted)", in_dir("cwd"));
    CHECK(chdir(in_dir("cwd")) == 0, "chdir");
    CHECK(rmdir(in_dir("cwd")) == 0, "rmdir cwd");
    CHECK(mkdir(in_dir("open"), 0700) == 0, "mkdir open");
    CHECK(chmod(in_dir("open"), 0705) == 0, "chmod open");
    ddir = open(in_dir("open"), O_RDONLY | O_DIRECTORY);
    CHECK(ddir >= 0, "open dir");
    snprintf(ddir_link, sizeof(ddir_link), "%s (deleted)", in_dir("open"));
    CHECK(rmdir(in_dir("open")) == 0, "rmdir open");
    /* a file held open in a tree removed whole (rm -rf) */
    CHECK(mkdir(in_dir("tree"), 0755) == 0 && mkdir(in_dir("tree/x"), 0755) == 0, "mkdir tree");
    in_tree = open(in_dir("tree/x/f"), O_RDWR | O_CREAT | O_EXCL, 0600);
    CHECK(in_tree >= 0 && write(in_tree, "hi", 2) == 2, "a file in the tree");
    snprintf(tree_link, sizeof(tree_link), "%s (deleted)", in_dir("tree/x/f"));
    CHECK(unlink(in_dir("tree/x/f")) == 0 && rmdir(in_dir("tree/x")) == 0, "rm -rf");
    snprintf(tree_top, sizeof(tree_top), "%s", in_dir("tree"));
    CHECK(rmdir(tree_top) == 0, "rm -rf");
}

static void check_dirs(int step)
{
    (void)step;
    struct stat st;
    CHECK(!strcmp(link_of(-1), cwd_link), "cwd %s", link_of(-1));
    CHECK(stat(".", &st) == 0 && S_ISDIR(st.st_mode) && st.st_nlink == 0, "cwd stat");
    CHECK((st.st_mode & 07777) == 0751, "cwd mode %o", st.st_mode & 07777);
    errno = 0;
    CHECK(open("x", O_CREAT | O_RDWR, 0600) < 0 && errno == ENOENT, "a file made in a removed cwd");
    CHECK(!strcmp(link_of(ddir), ddir_link), "dir %s", link_of(ddir));
    CHECK(fstat(ddir, &st) == 0 && S_ISDIR(st.st_mode) && st.st_nlink == 0, "dir stat");
    CHECK((st.st_mode & 07777) == 0705, "dir mode %o", st.st_mode & 07777);
    errno = 0;
    CHECK(openat(ddir, "x", O_CREAT | O_RDWR, 0600) < 0 && errno == ENOENT, "a file made in a removed dir");
    char buf[3] = {0};
    CHECK(pread(in_tree, buf, 2, 0) == 2 && !strcmp(buf, "hi"), "the file in the removed tree");
    CHECK(!strcmp(link_of(in_tree), tree_link), "tree file %s", link_of(in_tree));
    errno = 0;
    CHECK(access(tree_top, F_OK) < 0 && errno == ENOENT, "the removed tree is back");
}

/* ---- hardlink ---- */

static int linked;

static void setup_hardlink(void)
{
    linked = open(in_dir("a"), O_RDWR | O_CREAT | O_EXCL, 0600);
    CHECK(linked >= 0, "create a");
    char a[2200];
    snprintf(a, sizeof(a), "%s", in_dir("a"));
    CHECK(link(a, in_dir("b")) == 0, "link");
    CHECK(unlink(in_dir("a")) == 0, "unlink");
}

static void check_hardlink(int step)
{
    (void)step;
    struct stat st;
    CHECK(fstat(linked, &st) == 0 && st.st_nlink == 1, "link count");
}

/* ---- timerfd ---- */

#define MS 1000000L
static int t_once, t_periodic, t_expired, t_disarmed, t_cancel, t_shared, t_wall;
static long long t_wall_deadline; /* CLOCK_REALTIME, ns: kept across a restart */
static pid_t t_child;


/* the parent read the shared timerfd's expiration */
static int shared_timer_read(void)
{
    return fdinfo(t_shared, "ticks:", 10) == 0;
}

static int make_timer(int clock, int flags, long value_ns, long interval_ns)
{
    int fd = timerfd_create(clock, flags);
    CHECK(fd >= 0, "timerfd_create %d", clock);
    struct itimerspec its = {{interval_ns / 1000000000L, interval_ns % 1000000000L},
                             {value_ns / 1000000000L, value_ns % 1000000000L}};
    CHECK(timerfd_settime(fd, 0, &its, 0) == 0, "timerfd_settime");
    return fd;
}

static long long ns_of(struct timespec t)
{
    return t.tv_sec * 1000000000LL + t.tv_nsec;
}

static void setup_timerfd(void)
{
    t_once = make_timer(CLOCK_MONOTONIC, TFD_NONBLOCK, 1000000 * MS, 0);
    t_periodic = make_timer(CLOCK_REALTIME, TFD_NONBLOCK | TFD_CLOEXEC, 30 * MS, 30 * MS);
    t_expired = make_timer(CLOCK_BOOTTIME, 0, 1, 0);
    step_sleep_ms(5);
    t_disarmed = make_timer(CLOCK_MONOTONIC, TFD_CLOEXEC, 0, 7 * MS);
    /* shared with a child: one count of expirations for both */
    t_shared = make_timer(CLOCK_MONOTONIC, TFD_NONBLOCK, 1, 0);
    step_sleep_ms(5);
    t_child = fork_watcher(shared_timer_read);
    /* armed for a wall-clock deadline (TFD_TIMER_ABSTIME): the restart keeps
       the deadline, not the time that was left */
    t_wall = timerfd_create(CLOCK_REALTIME, 0);
    CHECK(t_wall >= 0, "timerfd_create");
    struct timespec now;
    clock_gettime(CLOCK_REALTIME, &now);
    t_wall_deadline = (now.tv_sec + 100000) * 1000000000LL;
    struct itimerspec its = {{0, 0}, {now.tv_sec + 100000, 0}};
    CHECK(timerfd_settime(t_wall, TFD_TIMER_ABSTIME, &its, 0) == 0, "settime abstime");
}

static void check_timerfd(int step)
{
    (void)step;
    struct itimerspec its;
    CHECK(timerfd_gettime(t_once, &its) == 0, "gettime");
    CHECK(ns_of(its.it_interval) == 0, "one-shot interval");
    long long left = ns_of(its.it_value);
    CHECK(left > 990000 * MS && left <= 1000000 * MS, "one-shot left %lld", left);
    CHECK(fdinfo(t_once, "clockid:", 10) == CLOCK_MONOTONIC, "clock");
    CHECK((fcntl(t_once, F_GETFL) & O_NONBLOCK) && !(fcntl(t_once, F_GETFD) & FD_CLOEXEC), "flags");

    CHECK(timerfd_gettime(t_periodic, &its) == 0, "gettime");
    CHECK(ns_of(its.it_interval) == 30 * MS, "periodic interval %lld", ns_of(its.it_interval));
    CHECK(ns_of(its.it_value) > 0 && ns_of(its.it_value) <= 30 * MS, "periodic left %lld", ns_of(its.it_value));
    CHECK(fdinfo(t_periodic, "clockid:", 10) == CLOCK_REALTIME, "clock");
    CHECK((fcntl(t_periodic, F_GETFL) & O_NONBLOCK) && (fcntl(t_periodic, F_GETFD) & FD_CLOEXEC), "flags");
    struct pollfd pp = {t_periodic, POLLIN, 0};
    CHECK(poll(&pp, 1, 1000) == 1, "periodic expires");
    uint64_t ticks = 0;
    CHECK(read(t_periodic, &ticks, sizeof(ticks)) == sizeof(ticks) && ticks >= 1, "periodic ticks %llu",
          (unsigned long long)ticks);

    /* expired once, never read: one expiration waiting */
    CHECK(fdinfo(t_expired, "ticks:", 10) == 1, "expired ticks %llu", fdinfo(t_expired, "ticks:", 10));
    CHECK(fdinfo(t_expired, "clockid:", 10) == CLOCK_BOOTTIME, "clock");
    CHECK(timerfd_gettime(t_expired, &its) == 0 && ns_of(its.it_value) == 0, "expired left");
    struct pollfd p = {t_expired, POLLIN, 0};
    CHECK(poll(&p, 1, 0) == 1 && (p.revents & POLLIN), "expired readable");

    CHECK(timerfd_gettime(t_disarmed, &its) == 0, "gettime");
    CHECK(ns_of(its.it_value) == 0 && ns_of(its.it_interval) == 7 * MS, "disarmed %lld %lld", ns_of(its.it_value),
          ns_of(its.it_interval));
    CHECK(fdinfo(t_disarmed, "ticks:", 10) == 0, "disarmed ticks");
    CHECK(!(fcntl(t_disarmed, F_GETFL) & O_NONBLOCK) && (fcntl(t_disarmed, F_GETFD) & FD_CLOEXEC), "flags");

    struct timespec now;
    CHECK(timerfd_gettime(t_wall, &its) == 0 && clock_gettime(CLOCK_REALTIME, &now) == 0, "gettime");
    long long off = ns_of(now) + ns_of(its.it_value) - t_wall_deadline;
    CHECK(off > -50 * MS && off < 50 * MS, "wall-clock deadline moved by %lld ns", off);
    CHECK(fdinfo(t_wall, "settime flags:", 8) == 1, "abstime flag");

    if (step < nsteps) {
        CHECK(fdinfo(t_shared, "ticks:", 10) == 1, "shared ticks");
    } else {
        CHECK(read(t_shared, &ticks, sizeof(ticks)) == sizeof(ticks) && ticks == 1, "shared read");
        watcher_done(t_child, "the shared timerfd read");
    }
}

static void setup_cancel(void)
{
    t_cancel = timerfd_create(CLOCK_REALTIME, 0);
    CHECK(t_cancel >= 0, "timerfd_create");
    struct timespec now;
    clock_gettime(CLOCK_REALTIME, &now);
    struct itimerspec its = {{0, 0}, {now.tv_sec + 100000, 0}};
    CHECK(timerfd_settime(t_cancel, TFD_TIMER_ABSTIME | TFD_TIMER_CANCEL_ON_SET, &its, 0) == 0, "settime");
}

static void check_cancel(int step)
{
    (void)step;
    struct itimerspec its;
    CHECK(timerfd_gettime(t_cancel, &its) == 0 && its.it_value.tv_sec > 0, "armed");
}

/* ---- signalfd ---- */

static int s_usr, s_pending;
static pid_t s_child;

/* the parent made the shared signalfd non-blocking */
static int shared_signalfd_nonblocking(void)
{
    return (fcntl(s_pending, F_GETFL) & O_NONBLOCK) != 0;
}
static sigset_t usr_mask, pending_mask;

static void setup_signalfd(void)
{
    sigset_t block;
    sigemptyset(&usr_mask);
    sigaddset(&usr_mask, SIGUSR1);
    sigaddset(&usr_mask, SIGRTMIN + 2);
    sigemptyset(&pending_mask);
    sigaddset(&pending_mask, SIGUSR2);
    sigemptyset(&block);
    sigaddset(&block, SIGUSR1);
    sigaddset(&block, SIGUSR2);
    sigaddset(&block, SIGRTMIN + 2);
    CHECK(sigprocmask(SIG_BLOCK, &block, 0) == 0, "block");
    s_usr = signalfd(-1, &usr_mask, SFD_NONBLOCK | SFD_CLOEXEC);
    s_pending = signalfd(-1, &pending_mask, 0);
    CHECK(s_usr >= 0 && s_pending >= 0, "signalfd");
    CHECK(raise(SIGUSR2) == 0, "raise");
    s_child = fork_watcher(shared_signalfd_nonblocking);
}

static unsigned long long mask_bits(const sigset_t *s)
{
    unsigned long long bits = 0;
    for (int sig = 1; sig <= 64; sig++)
        if (sigismember(s, sig) == 1)
            bits |= 1ull << (sig - 1);
    return bits;
}

static void check_signalfd(int step)
{
    CHECK(fdinfo(s_usr, "sigmask:", 16) == mask_bits(&usr_mask), "mask %llx", fdinfo(s_usr, "sigmask:", 16));
    CHECK(fdinfo(s_pending, "sigmask:", 16) == mask_bits(&pending_mask), "mask");
    CHECK((fcntl(s_usr, F_GETFL) & O_NONBLOCK) && (fcntl(s_usr, F_GETFD) & FD_CLOEXEC), "flags");
    CHECK(!(fcntl(s_pending, F_GETFL) & O_NONBLOCK) && !(fcntl(s_pending, F_GETFD) & FD_CLOEXEC), "flags");
    /* a signal sent now is read from it, then nothing */
    int sig = step % 2 ? SIGUSR1 : SIGRTMIN + 2;
    CHECK(raise(sig) == 0, "raise");
    struct signalfd_siginfo si;
    CHECK(read(s_usr, &si, sizeof(si)) == sizeof(si) && (int)si.ssi_signo == sig, "read %d", (int)si.ssi_signo);
    errno = 0;
    CHECK(read(s_usr, &si, sizeof(si)) < 0 && errno == EAGAIN, "nothing more");
    /* SIGUSR2, pending since the start, is readable from the other */
    struct pollfd p = {s_pending, POLLIN, 0};
    CHECK(poll(&p, 1, 0) == 1 && (p.revents & POLLIN), "pending SIGUSR2");
    if (step == nsteps) {
        /* their status flags are one description's */
        CHECK(fcntl(s_pending, F_SETFL, O_NONBLOCK) == 0, "F_SETFL");
        watcher_done(s_child, "the shared signalfd's O_NONBLOCK");
    }
}

/* ---- opath ---- */

static int o_link, o_dangling;
static char o_target[2200];

static void setup_opath(void)
{
    snprintf(o_target, sizeof(o_target), "%s", in_dir("target"));
    int fd = open(o_target, O_CREAT | O_RDWR, 0600);
    CHECK(fd >= 0, "create target");
    close(fd);
    CHECK(symlink(o_target, in_dir("link")) == 0, "symlink");
    o_link = open(in_dir("link"), O_PATH | O_NOFOLLOW);
    CHECK(o_link >= 0, "open link");
    CHECK(symlink("nowhere", in_dir("dangling")) == 0, "symlink");
    o_dangling = open(in_dir("dangling"), O_PATH | O_NOFOLLOW | O_CLOEXEC);
    CHECK(o_dangling >= 0, "open dangling");
}

static void check_symlink_fd(int fd, const char *to)
{
    struct stat st;
    char buf[4096];
    CHECK(fstatat(fd, "", &st, AT_EMPTY_PATH) == 0 && S_ISLNK(st.st_mode), "a symlink");
    ssize_t n = readlinkat(fd, "", buf, sizeof(buf) - 1);
    CHECK(n > 0, "readlinkat");
    buf[n] = 0;
    CHECK(!strcmp(buf, to), "points to %s", buf);
    CHECK((fcntl(fd, F_GETFL) & (O_PATH | O_NOFOLLOW)) == (O_PATH | O_NOFOLLOW), "flags %o", fcntl(fd, F_GETFL));
}

static void check_opath(int step)
{
    (void)step;
    check_symlink_fd(o_link, o_target);
    check_symlink_fd(o_dangling, "nowhere");
    CHECK(!(fcntl(o_link, F_GETFD) & FD_CLOEXEC) && (fcntl(o_dangling, F_GETFD) & FD_CLOEXEC), "fd flags");
}

/* ---- pidfd ---- */

static int p_live, p_zombie, p_self, p_reaped;
static pid_t live_pid, zombie_pid;

static int pidfd_open_(pid_t pid, unsigned flags)
{
    return (int)syscall(SYS_pidfd_open, pid, flags);
}

static pid_t child_that(int exit_code)
{
    pid_t pid = fork();
    CHECK(pid >= 0, "fork");
    if (pid == 0) {
        if (exit_code >= 0)
            _exit(exit_code);
        for (;;)
            pause();
    }
    return pid;
}

static void setup_pidfd(void)
{
    live_pid = child_that(-1);
    p_live = pidfd_open_(live_pid, PIDFD_NONBLOCK);
    zombie_pid = child_that(7);
    p_zombie = pidfd_open_(zombie_pid, 0);
    p_self = pidfd_open_(getpid(), 0);
    CHECK(p_live >= 0 && p_zombie >= 0 && p_self >= 0, "pidfd_open");
    siginfo_t si;
    memset(&si, 0, sizeof(si));
    CHECK(waitid(P_PIDFD, p_zombie, &si, WEXITED | WNOWAIT) == 0, "the zombie exits");
}

static void check_pidfd(int step)
{
    CHECK((pid_t)fdinfo(p_live, "Pid:", 10) == live_pid, "live pid");
    CHECK((pid_t)fdinfo(p_zombie, "Pid:", 10) == zombie_pid, "zombie pid");
    CHECK((pid_t)fdinfo(p_self, "Pid:", 10) == getpid(), "own pid");
    CHECK(fcntl(p_live, F_GETFL) & O_NONBLOCK, "PIDFD_NONBLOCK");
    CHECK(!(fcntl(p_zombie, F_GETFL) & O_NONBLOCK), "flags");
    CHECK(syscall(SYS_pidfd_send_signal, p_live, 0, NULL, 0) == 0, "signal 0");
    struct pollfd p[2] = {{p_live, POLLIN, 0}, {p_zombie, POLLIN, 0}};
    CHECK(poll(p, 2, 0) == 1 && !p[0].revents && (p[1].revents & POLLIN), "only the zombie has exited");
    siginfo_t si;
    memset(&si, 0, sizeof(si));
    CHECK(waitid(P_PIDFD, p_zombie, &si, WEXITED | WNOWAIT | WNOHANG) == 0 && si.si_pid == zombie_pid &&
              si.si_code == CLD_EXITED && si.si_status == 7,
          "the zombie's status");
    if (step == nsteps) {
        CHECK(syscall(SYS_pidfd_send_signal, p_live, SIGKILL, NULL, 0) == 0, "kill");
        struct pollfd dead = {p_live, POLLIN, 0};
        CHECK(poll(&dead, 1, 5000) == 1, "the child dies");
        memset(&si, 0, sizeof(si));
        CHECK(waitid(P_PIDFD, p_live, &si, WEXITED) == 0 && si.si_pid == live_pid && si.si_code == CLD_KILLED,
              "reaped through its pidfd");
        CHECK(waitid(P_PIDFD, p_zombie, &si, WEXITED) == 0, "the zombie reaped");
    }
}

static int never_(void)
{
    return 0;
}

static void setup_shared_pidfd(void)
{
    p_self = pidfd_open_(getpid(), 0);
    CHECK(p_self >= 0, "pidfd_open");
    fork_watcher(never_);
}

static void check_shared_pidfd(int step)
{
    (void)step;
    CHECK((pid_t)fdinfo(p_self, "Pid:", 10) == getpid(), "own pid");
}

static void setup_reaped(void)
{
    pid_t pid = child_that(0);
    p_reaped = pidfd_open_(pid, 0);
    CHECK(p_reaped >= 0, "pidfd_open");
    CHECK(waitpid(pid, 0, 0) == pid, "reap");
}

static void check_reaped(int step)
{
    (void)step;
    CHECK((int)fdinfo(p_reaped, "Pid:", 10) == -1, "reaped");
}

/* ---- inotify ---- */

static int in_fd, in_plain, in_raw;
static char in_b[2200];

static void drain_events(int fd)
{
    char buf[4096];
    while (read(fd, buf, sizeof(buf)) > 0)
        ;
}

static int add_watch(const char *name, uint32_t mask)
{
    int wd = inotify_add_watch(in_fd, name ? in_dir(name) : dir, mask);
    CHECK(wd > 0, "inotify_add_watch %s", name ? name : dir);
    return wd;
}

static void touch(const char *name)
{
    int fd = open(in_dir(name), O_CREAT | O_RDWR, 0600);
    CHECK(fd >= 0, "create %s", name);
    close(fd);
}

static void setup_inotify(void)
{
    CHECK(strlen(dir) < 2000, "a shorter DIR");
    strcat(dir, "/w");
    CHECK(mkdir(dir, 0700) == 0, "mkdir");
    touch("a");
    touch("b");
    touch("c");
    snprintf(in_b, sizeof(in_b), "%s", in_dir("b"));
    in_fd = inotify_init1(IN_NONBLOCK);
    CHECK(in_fd >= 0, "inotify_init1");
    CHECK(add_watch(0, IN_CREATE | IN_DELETE) == 1, "wd 1");
    int w2 = add_watch("a", IN_MODIFY);
    CHECK(add_watch("b", IN_ATTRIB) == 3, "wd 3");
    CHECK(inotify_rm_watch(in_fd, w2) == 0, "rm 2");
    CHECK(add_watch("c", IN_MODIFY | IN_ONESHOT) == 4, "wd 4");
    int w5 = add_watch("a", IN_OPEN);
    CHECK(inotify_rm_watch(in_fd, w5) == 0, "rm 5");
    drain_events(in_fd);
    in_plain = inotify_init();
    CHECK(in_plain >= 0, "inotify_init");
}

/* "wd:mask" of every watch its fdinfo shows, sorted */
static void watches_of(int fd, char *out, size_t cap)
{
    char p[64], text[8192];
    unsigned wds[16], masks[16];
    int n = 0;
    snprintf(p, sizeof(p), "/proc/self/fdinfo/%d", fd);
    FILE *f = fopen(p, "r");
    CHECK(f, "open %s", p);
    size_t len = fread(text, 1, sizeof(text) - 1, f);
    fclose(f);
    text[len] = 0;
    for (char *at = strstr(text, "inotify wd:"); at && n < 16; at = strstr(at + 1, "inotify wd:")) {
        CHECK(sscanf(at, "inotify wd:%x", &wds[n]) == 1, "wd");
        char *m = strstr(at, " mask:");
        CHECK(m && sscanf(m, " mask:%x", &masks[n]) == 1, "mask");
        n++;
    }
    for (int i = 1; i < n; i++)
        for (int j = i; j > 0 && wds[j - 1] > wds[j]; j--) {
            unsigned t = wds[j];
            wds[j] = wds[j - 1];
            wds[j - 1] = t;
            t = masks[j];
            masks[j] = masks[j - 1];
            masks[j - 1] = t;
        }
    out[0] = 0;
    for (int i = 0; i < n; i++)
        snprintf(out + strlen(out), cap - strlen(out), "%u:%x ", wds[i], masks[i]);
}

static void expect_event(const char *buf, ssize_t len, ssize_t *off, int wd, uint32_t mask, const char *name)
{
    CHECK(*off < len, "no event for wd %d mask %x", wd, mask);
    const struct inotify_event *e = (const void *)(buf + *off);
    CHECK(e->wd == wd && (e->mask & ~IN_ISDIR) == mask, "event wd %d mask %x, not wd %d mask %x", e->wd, e->mask,
          wd, mask);
    CHECK(name ? (e->len && !strcmp(e->name, name)) : !e->len, "event name %s", e->len ? e->name : "(none)");
    *off += (ssize_t)(sizeof(*e) + e->len);
}

static void check_inotify(int step)
{
    char have[512], want[512];
    watches_of(in_fd, have, sizeof(have));
    snprintf(want, sizeof(want), "1:%x 3:%x 4:%x ", IN_CREATE | IN_DELETE, IN_ATTRIB, IN_MODIFY | IN_ONESHOT);
    CHECK(!strcmp(have, want), "watches %s, not %s", have, want);
    watches_of(in_plain, have, sizeof(have));
    CHECK(!have[0], "watches %s", have);
    CHECK(fcntl(in_fd, F_GETFL) & O_NONBLOCK, "IN_NONBLOCK");
    CHECK(!(fcntl(in_plain, F_GETFL) & O_NONBLOCK), "flags");
    /* the watches report again: nothing queued from before */
    char name[32];
    snprintf(name, sizeof(name), "new-%d", step);
    touch(name);
    CHECK(unlink(in_dir(name)) == 0, "unlink");
    CHECK(chmod(in_b, step % 2 ? 0600 : 0640) == 0, "chmod");
    char buf[4096] __attribute__((aligned(8)));
    ssize_t len = read(in_fd, buf, sizeof(buf)), off = 0;
    CHECK(len > 0, "events");
    expect_event(buf, len, &off, 1, IN_CREATE, name);
    expect_event(buf, len, &off, 1, IN_DELETE, name);
    expect_event(buf, len, &off, 3, IN_ATTRIB, 0);
    CHECK(off == len, "more events");
    if (step == nsteps)
        CHECK(add_watch("c", IN_CLOSE_WRITE) == 4 && add_watch("a", IN_MODIFY) == 6, "the next watch's number");
}

static pid_t in_child;

static int never(void)
{
    return 0;
}

static void setup_shared_inotify(void)
{
    in_fd = inotify_init1(0);
    CHECK(in_fd >= 0, "inotify_init1");
    add_watch(0, IN_CREATE);
    in_child = fork_watcher(never);
}

static void setup_raw_inotify(void)
{
    in_raw = (int)syscall(SYS_inotify_init1, 0);
    CHECK(in_raw >= 0, "inotify_init1");
}

static void check_raw_inotify(int step)
{
    (void)step;
    CHECK(fcntl(in_raw ? in_raw : in_fd, F_GETFD) >= 0, "open");
}

int main(int argc, char **argv)
{
    nsteps = steps_of(argc, argv);
    CHECK(argc > 3, "usage: fd_kinds STEPS MODE DIR");
    const char *mode = argv[2];
    /* a directory of its own: the reference run runs alongside */
    snprintf(dir, sizeof(dir), "%s/fd_kinds-XXXXXX", argv[3]);
    CHECK(mkdtemp(dir), "mkdtemp in %s", argv[3]);
    void (*check)(int) = 0;
    if (!strcmp(mode, "deleted")) {
        setup_deleted();
        check = check_deleted;
    } else if (!strcmp(mode, "dirs")) {
        setup_dirs();
        check = check_dirs;
    } else if (!strcmp(mode, "hardlink")) {
        setup_hardlink();
        check = check_hardlink;
    } else if (!strcmp(mode, "timerfd")) {
        setup_timerfd();
        check = check_timerfd;
    } else if (!strcmp(mode, "cancel")) {
        setup_cancel();
        check = check_cancel;
    } else if (!strcmp(mode, "opath")) {
        setup_opath();
        check = check_opath;
    } else if (!strcmp(mode, "pidfd")) {
        setup_pidfd();
        check = check_pidfd;
    } else if (!strcmp(mode, "sharedpidfd")) {
        setup_shared_pidfd();
        check = check_shared_pidfd;
    } else if (!strcmp(mode, "reaped")) {
        setup_reaped();
        check = check_reaped;
    } else if (!strcmp(mode, "inotify")) {
        setup_inotify();
        check = check_inotify;
    } else if (!strcmp(mode, "sharedinotify")) {
        setup_shared_inotify();
        check = check_raw_inotify;
    } else if (!strcmp(mode, "rawinotify")) {
        setup_raw_inotify();
        check = check_raw_inotify;
    } else if (!strcmp(mode, "signalfd")) {
        setup_signalfd();
        check = check_signalfd;
    }
    CHECK(check, "unknown mode %s", mode);
    return run_steps(nsteps, check);
}
