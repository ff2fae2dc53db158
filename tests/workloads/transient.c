/*
 * States that pass by themselves, and one that does not
 * (tests/test_transient.py, issue 19 "No refusal that waiting can fix").
 *
 *   transient STEPS backlog DIR     a Unix stream listener with two connections
 *                                   not yet accepted (the second shut for
 *                                   writing, its client bound to a name) and a
 *                                   seqpacket listener with one; accepted at
 *                                   step ACCEPT_AT, in the order they were made
 *   transient STEPS tcpbacklog FLAG a TCP listener with a connection not yet
 *                                   accepted until the file FLAG exists
 *   transient STEPS lease FILE      a read lease on FILE, held for good
 */
#define _GNU_SOURCE
#include "state_check.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

enum { ACCEPT_AT = 30 };

static const char *mode, *arg;

/* ---- backlog: Unix listeners with connections not yet accepted ---- */

static int lst, lsq, ca, cb, cq;

static struct sockaddr_un addr_in(const char *name)
{
    struct sockaddr_un sa = {.sun_family = AF_UNIX};
    snprintf(sa.sun_path, sizeof(sa.sun_path), "%s/%s", arg, name);
    return sa;
}

static int listener(int type, const char *name)
{
    struct sockaddr_un sa = addr_in(name);
    int s = socket(AF_UNIX, type, 0);
    CHECK(s >= 0, "socket");
    unlink(sa.sun_path);
    CHECK(bind(s, (struct sockaddr *)&sa, sizeof(sa)) == 0, "bind %s", sa.sun_path);
    CHECK(listen(s, 8) == 0, "listen");
    return s;
}

static int client(int type, const char *to, const char *own)
{
    struct sockaddr_un sa = addr_in(to);
    int s = socket(AF_UNIX, type, 0);
    CHECK(s >= 0, "socket");
    if (own) {
        struct sockaddr_un me = addr_in(own);
        unlink(me.sun_path);
        CHECK(bind(s, (struct sockaddr *)&me, sizeof(me)) == 0, "bind %s", me.sun_path);
    }
    CHECK(connect(s, (struct sockaddr *)&sa, sizeof(sa)) == 0, "connect %s", sa.sun_path);
    return s;
}

static int readable(int fd)
{
    struct pollfd p = {.fd = fd, .events = POLLIN};
    return poll(&p, 1, 0) == 1 && (p.revents & POLLIN);
}

static void backlog_setup(void)
{
    lst = listener(SOCK_STREAM, "stream");
    lsq = listener(SOCK_SEQPACKET, "seqpacket");
    ca = client(SOCK_STREAM, "stream", 0);
    cb = client(SOCK_STREAM, "stream", "client-b");
    CHECK(shutdown(cb, SHUT_WR) == 0, "shutdown");
    cq = client(SOCK_SEQPACKET, "seqpacket", 0);
}

/* an accepted connection is the one whose client says "hello" through it */
static void talk(int server, int cl, int type, const char *tag)
{
    char buf[16];
    CHECK(write(server, tag, strlen(tag)) == (ssize_t)strlen(tag), "write %s", tag);
    ssize_t n = read(cl, buf, sizeof(buf));
    CHECK(n == (ssize_t)strlen(tag) && memcmp(buf, tag, (size_t)n) == 0, "%s: read %zd", tag, n);
    CHECK(write(cl, "back", 4) == 4, "%s: write back", tag);
    n = recv(server, buf, type == SOCK_SEQPACKET ? sizeof(buf) : 4, type == SOCK_SEQPACKET ? 0 : MSG_WAITALL);
    CHECK(n == 4 && memcmp(buf, "back", 4) == 0, "%s: read back %zd", tag, n);
}

static void backlog_check(int step)
{
    if (step < ACCEPT_AT) {
        /* the connections wait: listeners readable, clients connected, nothing to read */
        CHECK(readable(lst) && readable(lsq), "listeners not readable at step %d", step);
        CHECK(!readable(ca) && !readable(cq), "a client has something to read");
        struct sockaddr_un peer;
        socklen_t len = sizeof(peer);
        CHECK(getpeername(ca, (struct sockaddr *)&peer, &len) == 0, "getpeername");
        struct sockaddr_un want = addr_in("stream");
        CHECK(strcmp(peer.sun_path, want.sun_path) == 0, "peer %s", peer.sun_path);
        return;
    }
    if (step != ACCEPT_AT)
        return;
    int a = accept(lst, 0, 0);
    CHECK(a >= 0, "accept a");
    struct sockaddr_un from;
    socklen_t len = sizeof(from);
    int b = accept(lst, (struct sockaddr *)&from, &len);
    CHECK(b >= 0, "accept b");
    struct sockaddr_un want = addr_in("client-b");
    CHECK(len > sizeof(sa_family_t) && strcmp(from.sun_path, want.sun_path) == 0, "b from %s", from.sun_path);
    CHECK(!readable(lst), "a third connection");
    talk(a, ca, SOCK_STREAM, "first");
    char c;
    CHECK(read(b, &c, 1) == 0, "b not at its end (shut for writing)");
    CHECK(write(b, "x", 1) == 1 && read(cb, &c, 1) == 1 && c == 'x', "b's other way");
    int q = accept(lsq, 0, 0);
    CHECK(q >= 0, "accept seqpacket");
    talk(q, cq, SOCK_SEQPACKET, "packet");
    close(a);
    close(b);
    close(q);
}

/* ---- tcpbacklog: a TCP connection accepted once FLAG exists ---- */

static int tl, tc, ta = -1;

static void tcp_setup(void)
{
    struct sockaddr_in sa = {.sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
    tl = socket(AF_INET, SOCK_STREAM, 0);
    CHECK(tl >= 0 && bind(tl, (struct sockaddr *)&sa, sizeof(sa)) == 0 && listen(tl, 4) == 0, "listen");
    socklen_t len = sizeof(sa);
    CHECK(getsockname(tl, (struct sockaddr *)&sa, &len) == 0, "getsockname");
    tc = socket(AF_INET, SOCK_STREAM, 0);
    CHECK(tc >= 0 && connect(tc, (struct sockaddr *)&sa, sizeof(sa)) == 0, "connect");
    printf("listening\n");
}

static void tcp_check(int step)
{
    if (ta < 0 && access(arg, F_OK) == 0) {
        ta = accept(tl, 0, 0);
        CHECK(ta >= 0, "accept");
    }
    if (ta >= 0) {
        char c = (char)step, d = 0;
        CHECK(write(tc, &c, 1) == 1 && read(ta, &d, 1) == 1 && d == c, "step %d through the connection", step);
    }
}

/* ---- lease ---- */

static void lease_setup(void)
{
    int fd = open(arg, O_RDONLY);
    CHECK(fd >= 0, "open %s", arg);
    CHECK(fcntl(fd, F_SETLEASE, F_RDLCK) == 0, "F_SETLEASE");
}

static void nothing(int step) { (void)step; }

int main(int argc, char **argv)
{
    CHECK(argc > 3, "usage: transient STEPS backlog|tcpbacklog|lease ARG");
    mode = argv[2];
    arg = argv[3];
    setvbuf(stdout, 0, _IOLBF, 0);
    if (!strcmp(mode, "backlog")) {
        backlog_setup();
        return run_steps(steps_of(argc, argv), backlog_check);
    }
    if (!strcmp(mode, "tcpbacklog")) {
        tcp_setup();
        return run_steps(steps_of(argc, argv), tcp_check);
    }
    if (!strcmp(mode, "lease")) {
        lease_setup();
        return run_steps(steps_of(argc, argv), nothing);
    }
    CHECK(0, "unknown mode %s", mode);
}
