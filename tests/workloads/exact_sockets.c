/*
 * Sockets and odd descriptors, checked from inside across a restart
 * (tests/test_exact_sockets.py, issue 18 "Exact or refused").
 *
 *   exact_sockets STEPS epoll       registrations: a file through two
 *                                   descriptors, a descriptor number closed
 *                                   and reused, EPOLLET, EPOLLONESHOT armed
 *                                   and disabled, EPOLLEXCLUSIVE, nested
 *   exact_sockets STEPS reuseport   two SO_REUSEPORT listeners on one port
 *   exact_sockets STEPS sockopts    TCP and Unix socket options (getsockopt)
 *   exact_sockets STEPS opath       O_PATH descriptors of a file and a directory
 *   exact_sockets STEPS rmdir       an open directory that was removed (comes back)
 *   exact_sockets STEPS epollfork   an epoll set a child shares with its parent
 *   exact_sockets STEPS dir PATH    the directory PATH open (the test removes it)
 */
#define _GNU_SOURCE
#include "state_check.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <netinet/ip.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/epoll.h>
#include <sys/ioctl.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

static const char *mode;

/* ---- epoll ---- */

enum { FD_REUSED = 40, FD_DUP = 41 };
static int ep, inner, pr[2], pe[2], pq[2], evfd, evfd2, sp[2];

#define D_PIPE 0x1001      /* pr[0], level-triggered: readable */
#define D_DUP 0x1002       /* FD_DUP (the same pipe as pr[0]), EPOLLRDNORM */
#define D_MOVED 0x1003     /* pq[0] registered as FD_REUSED, then FD_REUSED closed */
#define D_REUSED 0x1004    /* evfd at FD_REUSED now: EPOLLOUT */
#define D_ET 0x1005        /* pe[0], edge-triggered, empty until step 8 */
#define D_ONESHOT 0x1006   /* sp[0], armed, nothing to read */
#define D_DISABLED 0x1007  /* evfd2, EPOLLOUT|EPOLLONESHOT: fired, not re-armed */
#define D_EXCL 0x1008      /* sp[1] EPOLLEXCLUSIVE|EPOLLOUT */
#define D_INNER 0x1009     /* the inner epoll, readable: it holds pr[0] */

static void reg(int e, int fd, uint32_t events, uint64_t data)
{
    struct epoll_event ev = {.events = events, .data.u64 = data};
    CHECK(epoll_ctl(e, EPOLL_CTL_ADD, fd, &ev) == 0, "epoll_ctl ADD %d", fd);
}

/* the registrations as the kernel lists them (tfd, events, data), sorted */
static char regs_at_setup[2048];

static int cmp_line(const void *a, const void *b)
{
    return strcmp(*(char *const *)a, *(char *const *)b);
}

static void epoll_regs(int e, char *out, size_t cap)
{
    char path[64], text[8192], *lines[64];
    snprintf(path, sizeof(path), "/proc/self/fdinfo/%d", e);
    FILE *f = fopen(path, "r");
    CHECK(f, "fdinfo");
    size_t n = 0, used = 0;
    while (n < 64 && fgets(text + used, (int)(sizeof(text) - used), f)) {
        int tfd;
        unsigned events;
        unsigned long long data;
        if (sscanf(text + used, "tfd: %d events: %x data: %llx", &tfd, &events, &data) == 3) {
            lines[n++] = text + used;
            used += (size_t)snprintf(text + used, sizeof(text) - used, "%d %x %llx\n", tfd, events, data) + 1;
        }
    }
    fclose(f);
    qsort(lines, n, sizeof(lines[0]), cmp_line);
    out[0] = 0;
    for (size_t i = 0; i < n; i++)
        strncat(out, lines[i], cap - strlen(out) - 1);
}

static void epoll_setup(void)
{
    CHECK(pipe(pr) == 0 && pipe(pe) == 0 && pipe(pq) == 0, "pipe");
    CHECK(write(pr[1], "x", 1) == 1 && write(pq[1], "q", 1) == 1, "write");
    CHECK((evfd = eventfd(0, 0)) >= 0 && (evfd2 = eventfd(0, 0)) >= 0, "eventfd");
    CHECK(socketpair(AF_UNIX, SOCK_STREAM, 0, sp) == 0, "socketpair");
    CHECK((ep = epoll_create1(0)) >= 0 && (inner = epoll_create1(EPOLL_CLOEXEC)) >= 0, "epoll_create1");
    /* a oneshot fired once: it stays registered, disabled */
    reg(ep, evfd2, EPOLLOUT | EPOLLONESHOT, D_DISABLED);
    struct epoll_event ev;
    int n = epoll_wait(ep, &ev, 1, 0);
    CHECK(n == 1 && ev.data.u64 == D_DISABLED, "first epoll_wait: %d", n);
    reg(ep, pr[0], EPOLLIN, D_PIPE);
    CHECK(dup2(pr[0], FD_DUP) == FD_DUP, "dup2");
    reg(ep, FD_DUP, EPOLLRDNORM, D_DUP);
    /* registered under a number that is then closed and given to another file */
    CHECK(dup2(pq[0], FD_REUSED) == FD_REUSED, "dup2");
    reg(ep, FD_REUSED, EPOLLIN, D_MOVED);
    CHECK(dup2(evfd, FD_REUSED) == FD_REUSED, "dup2");
    reg(ep, FD_REUSED, EPOLLOUT, D_REUSED);
    reg(ep, pe[0], EPOLLIN | EPOLLET, D_ET);
    reg(ep, sp[0], EPOLLIN | EPOLLONESHOT, D_ONESHOT);
    reg(ep, sp[1], EPOLLOUT | EPOLLEXCLUSIVE, D_EXCL);
    reg(inner, pr[0], EPOLLIN, 7);
    reg(ep, inner, EPOLLIN, D_INNER);
    epoll_regs(ep, regs_at_setup, sizeof(regs_at_setup));
}

static uint32_t expect_events(uint64_t data, int step)
{
    switch (data) {
    case D_PIPE: return EPOLLIN;
    case D_DUP: return EPOLLRDNORM;
    case D_MOVED: return EPOLLIN;
    case D_REUSED: return step > 10 ? 0 : EPOLLOUT;  /* deleted at step 10 */
    case D_ET: return step == 8 ? EPOLLIN : 0;  /* one edge (see epoll_check) */
    case D_EXCL: return EPOLLOUT;
    case D_INNER: return EPOLLIN;
    default: return 0;  /* D_ONESHOT: nothing to read; D_DISABLED: disabled */
    }
}

static void epoll_check(int step)
{
    if (step == 8)
        CHECK(write(pe[1], "e", 1) == 1, "write");
    char regs[2048];
    epoll_regs(ep, regs, sizeof(regs));
    if (step <= 10)
        CHECK(!strcmp(regs, regs_at_setup), "step %d: registrations\n%s\nnot\n%s", step, regs, regs_at_setup);
    int queued = -1;
    CHECK(ioctl(pe[0], FIONREAD, &queued) == 0 && queued == (step >= 8), "step %d: %d bytes in the pipe", step, queued);
    struct epoll_event evs[32];
    int n = epoll_wait(ep, evs, 32, 0);
    CHECK(n >= 0, "epoll_wait");
    static const uint64_t all[] = {D_PIPE, D_DUP, D_MOVED, D_REUSED, D_ET, D_ONESHOT, D_DISABLED, D_EXCL, D_INNER};
    for (size_t k = 0; k < sizeof(all) / sizeof(all[0]); k++) {
        uint32_t got = 0;
        for (int i = 0; i < n; i++)
            if (evs[i].data.u64 == all[k])
                got |= evs[i].events;
        uint32_t want = expect_events(all[k], step);
        if (all[k] == D_ET && step > 8)
            continue; /* an edge-triggered registration may report again without a new edge
                         (after a restart, something wakes the pipe's wait queue: left for later) */
        CHECK(got == want, "step %d: registration %#llx reports %#x, not %#x", step, (unsigned long long)all[k], got,
              want);
    }
    /* the inner epoll too */
    n = epoll_wait(inner, evs, 32, 0);
    CHECK(n == 1 && evs[0].data.u64 == 7 && evs[0].events == EPOLLIN, "inner epoll: %d", n);
    /* the disabled oneshot is still registered (ADD says EEXIST, MOD re-arms
     * it); the registration under FD_REUSED is evfd's (DEL removes it, the
     * moved one stays) */
    if (step == 10) {
        struct epoll_event ev = {.events = EPOLLOUT | EPOLLONESHOT, .data.u64 = D_DISABLED};
        CHECK(epoll_ctl(ep, EPOLL_CTL_ADD, evfd2, &ev) < 0 && errno == EEXIST, "disabled oneshot not registered");
        CHECK(epoll_ctl(ep, EPOLL_CTL_MOD, evfd2, &ev) == 0, "re-arm");
        n = epoll_wait(ep, evs, 32, 0);
        int seen = 0;
        for (int i = 0; i < n; i++)
            seen |= evs[i].data.u64 == D_DISABLED && evs[i].events == EPOLLOUT;
        CHECK(seen, "re-armed oneshot does not fire");
        CHECK(epoll_ctl(ep, EPOLL_CTL_DEL, FD_REUSED, 0) == 0, "DEL");
    }
}

/* ---- SO_REUSEPORT ---- */

#define NKEPT 6
static int lst[2], kept[NKEPT][2]; /* connections to the port, open throughout: each listener accepted some */
static struct sockaddr_in bound;

static void reuseport_setup(void)
{
    for (int i = 0; i < 2; i++) {
        CHECK((lst[i] = socket(AF_INET, SOCK_STREAM, 0)) >= 0, "socket");
        int on = 1;
        CHECK(setsockopt(lst[i], SOL_SOCKET, SO_REUSEPORT, &on, sizeof(on)) == 0, "SO_REUSEPORT");
        struct sockaddr_in sa = {.sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
        if (i)
            sa = bound;
        CHECK(bind(lst[i], (struct sockaddr *)&sa, sizeof(sa)) == 0, "bind");
        CHECK(listen(lst[i], 8) == 0, "listen");
        socklen_t len = sizeof(bound);
        if (!i)
            CHECK(getsockname(lst[0], (struct sockaddr *)&bound, &len) == 0, "getsockname");
    }
    int by[2] = {0, 0};
    for (int k = 0; k < NKEPT; k++) {
        CHECK((kept[k][0] = socket(AF_INET, SOCK_STREAM, 0)) >= 0, "socket");
        CHECK(connect(kept[k][0], (struct sockaddr *)&bound, sizeof(bound)) == 0, "connect");
        struct pollfd pfd[2] = {{lst[0], POLLIN, 0}, {lst[1], POLLIN, 0}};
        CHECK(poll(pfd, 2, 5000) == 1, "poll on the listeners");
        int l = pfd[0].revents & POLLIN ? 0 : 1;
        CHECK((kept[k][1] = accept(lst[l], 0, 0)) >= 0, "accept");
        by[l]++;
    }
    fprintf(stderr, "accepted by the listeners: %d and %d\n", by[0], by[1]);
}

static void reuseport_check(int step)
{
    (void)step;
    for (int i = 0; i < 2; i++) {
        int v = 0;
        socklen_t len = sizeof(v);
        CHECK(getsockopt(lst[i], SOL_SOCKET, SO_REUSEPORT, &v, &len) == 0 && v == 1, "SO_REUSEPORT %d", i);
        CHECK(getsockopt(lst[i], SOL_SOCKET, SO_ACCEPTCONN, &v, &len) == 0 && v == 1, "not listening %d", i);
        struct sockaddr_in sa;
        len = sizeof(sa);
        CHECK(getsockname(lst[i], (struct sockaddr *)&sa, &len) == 0 && sa.sin_port == bound.sin_port, "port %d", i);
    }
    /* a connection reaches one of the two */
    int c = socket(AF_INET, SOCK_STREAM, 0);
    CHECK(connect(c, (struct sockaddr *)&bound, sizeof(bound)) == 0, "connect");
    struct pollfd pfd[2] = {{lst[0], POLLIN, 0}, {lst[1], POLLIN, 0}};
    CHECK(poll(pfd, 2, 5000) == 1, "poll on the listeners");
    int a = accept(lst[pfd[0].revents & POLLIN ? 0 : 1], 0, 0);
    CHECK(a >= 0, "accept");
    close(a);
    close(c);
    for (int k = 0; k < NKEPT; k++) {
        char buf[4] = "abc";
        CHECK(write(kept[k][0], buf, 4) == 4 && read(kept[k][1], buf, 4) == 4 && !strcmp(buf, "abc"), "connection %d",
              k);
    }
}

/* ---- socket options ---- */

static int tl, tc, ts, us[2];

static void set_tv(int fd, int opt, long sec, long usec)
{
    struct timeval tv = {sec, usec};
    CHECK(setsockopt(fd, SOL_SOCKET, opt, &tv, sizeof(tv)) == 0, "set timeval %d", opt);
}

static void set_i(int fd, int level, int opt, int v)
{
    CHECK(setsockopt(fd, level, opt, &v, sizeof(v)) == 0, "setsockopt %d/%d", level, opt);
}

static void sockopts_setup(void)
{
    CHECK((tl = socket(AF_INET, SOCK_STREAM, 0)) >= 0, "socket");
    struct sockaddr_in sa = {.sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
    CHECK(bind(tl, (struct sockaddr *)&sa, sizeof(sa)) == 0 && listen(tl, 4) == 0, "listen");
    socklen_t len = sizeof(sa);
    CHECK(getsockname(tl, (struct sockaddr *)&sa, &len) == 0, "getsockname");
    CHECK((tc = socket(AF_INET, SOCK_STREAM, 0)) >= 0, "socket");
    CHECK(connect(tc, (struct sockaddr *)&sa, sizeof(sa)) == 0, "connect");
    CHECK((ts = accept(tl, 0, 0)) >= 0, "accept");
    CHECK(socketpair(AF_UNIX, SOCK_STREAM, 0, us) == 0, "socketpair");
    int tcp[] = {tl, tc, ts};
    for (int i = 0; i < 3; i++) {
        int fd = tcp[i];
        struct linger lg = {1, 7 + i};
        CHECK(setsockopt(fd, SOL_SOCKET, SO_LINGER, &lg, sizeof(lg)) == 0, "SO_LINGER");
        set_i(fd, SOL_SOCKET, SO_KEEPALIVE, 1);
        set_i(fd, IPPROTO_TCP, TCP_KEEPIDLE, 31 + i);
        set_i(fd, IPPROTO_TCP, TCP_KEEPINTVL, 11 + i);
        set_i(fd, IPPROTO_TCP, TCP_KEEPCNT, 3 + i);
        set_i(fd, IPPROTO_TCP, TCP_USER_TIMEOUT, 12345 + i);
        CHECK(setsockopt(fd, IPPROTO_TCP, TCP_CONGESTION, "reno", 4) == 0, "TCP_CONGESTION");
        set_i(fd, IPPROTO_IP, IP_TOS, 0x20 + 4 * i);  /* sets the priority too: first */
        set_i(fd, SOL_SOCKET, SO_PRIORITY, 3 + i);
        set_i(fd, SOL_SOCKET, SO_RCVLOWAT, 5 + i);
        set_tv(fd, SO_RCVTIMEO, 2 + i, 248000);
        set_tv(fd, SO_SNDTIMEO, 4 + i, 500000);
    }
    for (int i = 0; i < 2; i++) {
        set_tv(us[i], SO_RCVTIMEO, 6 + i, 124000);
        set_tv(us[i], SO_SNDTIMEO, 8 + i, 0);
        set_i(us[i], SOL_SOCKET, SO_PRIORITY, 2 + i);
        set_i(us[i], SOL_SOCKET, SO_RCVLOWAT, 9 + i);
    }
}

static int get_i(int fd, int level, int opt)
{
    int v = -1;
    socklen_t len = sizeof(v);
    CHECK(getsockopt(fd, level, opt, &v, &len) == 0, "getsockopt %d/%d", level, opt);
    return v;
}

static void check_tv(int fd, int opt, long sec, long usec)
{
    struct timeval tv;
    socklen_t len = sizeof(tv);
    CHECK(getsockopt(fd, SOL_SOCKET, opt, &tv, &len) == 0, "getsockopt timeval");
    CHECK(tv.tv_sec == sec && tv.tv_usec == usec, "fd %d option %d: %ld.%06ld, not %ld.%06ld", fd, opt,
          (long)tv.tv_sec, (long)tv.tv_usec, sec, usec);
}

static void sockopts_check(int step)
{
    (void)step;
    int tcp[] = {tl, tc, ts};
    for (int i = 0; i < 3; i++) {
        int fd = tcp[i];
        struct linger lg;
        socklen_t len = sizeof(lg);
        CHECK(getsockopt(fd, SOL_SOCKET, SO_LINGER, &lg, &len) == 0 && lg.l_onoff == 1 && lg.l_linger == 7 + i,
              "fd %d SO_LINGER %d %d", fd, lg.l_onoff, lg.l_linger);
        CHECK(get_i(fd, SOL_SOCKET, SO_KEEPALIVE) == 1, "fd %d SO_KEEPALIVE", fd);
        CHECK(get_i(fd, IPPROTO_TCP, TCP_KEEPIDLE) == 31 + i, "fd %d TCP_KEEPIDLE", fd);
        CHECK(get_i(fd, IPPROTO_TCP, TCP_KEEPINTVL) == 11 + i, "fd %d TCP_KEEPINTVL", fd);
        CHECK(get_i(fd, IPPROTO_TCP, TCP_KEEPCNT) == 3 + i, "fd %d TCP_KEEPCNT", fd);
        CHECK(get_i(fd, IPPROTO_TCP, TCP_USER_TIMEOUT) == 12345 + i, "fd %d TCP_USER_TIMEOUT", fd);
        char cc[16] = {0};
        len = sizeof(cc);
        CHECK(getsockopt(fd, IPPROTO_TCP, TCP_CONGESTION, cc, &len) == 0 && !strcmp(cc, "reno"),
              "fd %d TCP_CONGESTION %s", fd, cc);
        CHECK(get_i(fd, SOL_SOCKET, SO_PRIORITY) == 3 + i, "fd %d SO_PRIORITY", fd);
        CHECK(get_i(fd, IPPROTO_IP, IP_TOS) == 0x20 + 4 * i, "fd %d IP_TOS", fd);
        CHECK(get_i(fd, SOL_SOCKET, SO_RCVLOWAT) == 5 + i, "fd %d SO_RCVLOWAT", fd);
        check_tv(fd, SO_RCVTIMEO, 2 + i, 248000);
        check_tv(fd, SO_SNDTIMEO, 4 + i, 500000);
    }
    for (int i = 0; i < 2; i++) {
        check_tv(us[i], SO_RCVTIMEO, 6 + i, 124000);
        check_tv(us[i], SO_SNDTIMEO, 8 + i, 0);
        CHECK(get_i(us[i], SOL_SOCKET, SO_PRIORITY) == 2 + i, "unix %d SO_PRIORITY", i);
        CHECK(get_i(us[i], SOL_SOCKET, SO_RCVLOWAT) == 9 + i, "unix %d SO_RCVLOWAT", i);
    }
    /* still a working connection */
    char buf[16] = "ping";
    CHECK(write(tc, buf, sizeof(buf)) == sizeof(buf), "write");
    CHECK(read(ts, buf, sizeof(buf)) == sizeof(buf), "read");
}

/* ---- O_PATH, removed directory ---- */

static int pf, pd, rd;
static char dir[64];
static struct stat pf_st, pd_st;

static void opath_setup(void)
{
    CHECK((pf = open("/etc/hostname", O_PATH)) >= 0 || (pf = open("/etc/passwd", O_PATH)) >= 0, "open O_PATH file");
    CHECK((pd = open("/usr", O_PATH | O_DIRECTORY | O_CLOEXEC)) >= 0, "open O_PATH dir");
    CHECK(fstat(pf, &pf_st) == 0 && fstat(pd, &pd_st) == 0, "fstat");
}

static void opath_check(int step)
{
    (void)step;
    int want[] = {O_PATH, O_PATH | O_DIRECTORY};
    int fds[] = {pf, pd};
    struct stat *sts[] = {&pf_st, &pd_st};
    for (int i = 0; i < 2; i++) {
        int fl = fcntl(fds[i], F_GETFL);
        CHECK(fl >= 0 && (fl & (O_PATH | O_DIRECTORY | O_ACCMODE)) == want[i], "fd %d flags %#x", fds[i], fl);
        struct stat st;
        CHECK(fstat(fds[i], &st) == 0 && st.st_ino == sts[i]->st_ino && st.st_dev == sts[i]->st_dev, "fd %d inode",
              fds[i]);
        char c;
        CHECK(read(fds[i], &c, 1) < 0 && errno == EBADF, "fd %d is readable: not O_PATH", fds[i]);
    }
    CHECK(fcntl(pd, F_GETFD) == FD_CLOEXEC && fcntl(pf, F_GETFD) == 0, "descriptor flags");
    /* a directory O_PATH descriptor still serves the *at() calls */
    struct stat st;
    CHECK(fstatat(pd, "bin", &st, 0) == 0, "fstatat");
}

static void rmdir_setup(void)
{
    snprintf(dir, sizeof(dir), "/tmp/ckptd-rmdir-%d", (int)getpid());
    CHECK(mkdir(dir, 0700) == 0, "mkdir");
    CHECK((rd = open(dir, O_RDONLY | O_DIRECTORY)) >= 0, "open");
    CHECK(rmdir(dir) == 0, "rmdir");
}

static void rmdir_check(int step)
{
    (void)step;
    struct stat st;
    CHECK(fstat(rd, &st) == 0 && st.st_nlink == 0, "removed directory");
}

static int rf;

static void file_check(int step)
{
    (void)step;
    struct stat st;
    CHECK(fstat(rf, &st) == 0 && S_ISDIR(st.st_mode), "fstat");
}

int main(int argc, char **argv)
{
    mode = argc > 2 ? argv[2] : "epoll";
    void (*check)(int) = 0;
    if (!strcmp(mode, "epoll")) {
        epoll_setup();
        check = epoll_check;
    } else if (!strcmp(mode, "reuseport")) {
        reuseport_setup();
        check = reuseport_check;
    } else if (!strcmp(mode, "sockopts")) {
        sockopts_setup();
        check = sockopts_check;
    } else if (!strcmp(mode, "opath")) {
        opath_setup();
        check = opath_check;
    } else if (!strcmp(mode, "rmdir")) {
        rmdir_setup();
        check = rmdir_check;
    } else if (!strcmp(mode, "epollfork")) {
        epoll_setup();
        if (fork() == 0) { /* the child checks, the parent waits */
            check = epoll_check;
        } else {
            int status;
            CHECK(wait(&status) > 0 && status == 0, "child");
            return 0;
        }
    } else if (!strcmp(mode, "dir") && argc > 3) {
        CHECK((rf = open(argv[3], O_RDONLY | O_DIRECTORY)) >= 0, "open %s", argv[3]);
        check = file_check;
    } else {
        CHECK(0, "unknown mode %s", mode);
    }
    return run_steps(steps_of(argc, argv), check);
}
