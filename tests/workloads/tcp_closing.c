/*
 * TCP connections in a closing state that can last forever (issue 19;
 * tests/test_tcp_closing.py).  argv: STEPS MODE, MODE:
 *   client   the connecting end shuts its sending side (FIN-WAIT-2), the
 *            accepted end has its FIN (CLOSE-WAIT)
 *   server   the other way round: the accepted end shuts its sending side
 *   peerclosed  the connecting end is closed: the accepted end is in
 *            CLOSE-WAIT, its peer an orphan no process holds, in FIN-WAIT-2
 *            (/proc/net/tcp); at the end a write to it is answered with a
 *            reset
 * Before the shutdown the shutting end sent "hello world", of which its
 * peer read "hello " only.  At every step each end's state (TCP_INFO) and
 * addresses are the same; the end in CLOSE-WAIT still sees "world" and
 * then the end of the stream, unread, and writes a word, which its peer
 * leaves unread too: all it ever got must be queued there, in order; the
 * end in FIN-WAIT-2 may not send (EPIPE).  At the last step both read
 * everything to the end.
 */
#define _GNU_SOURCE
#include "state_check.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <signal.h>
#include <sys/socket.h>
#include <unistd.h>

static int nsteps, listener, shut_end, open_end;
static struct sockaddr_in shut_name, shut_peer;
static char sent[4096];  /* what the open end wrote since the shutdown */

static int state_of(int fd)
{
    struct tcp_info ti;
    socklen_t len = sizeof(ti);
    CHECK(getsockopt(fd, IPPROTO_TCP, TCP_INFO, &ti, &len) == 0, "TCP_INFO");
    return ti.tcpi_state;
}

static void wait_state(int fd, int want)
{
    for (int i = 0; i < 2000 && state_of(fd) != want; i++)
        step_sleep_ms(1);
    CHECK(state_of(fd) == want, "state %d, not %d", state_of(fd), want);
}

/* the bytes queued for reading, peeked: exactly want, then the end of the stream or not */
static void expect_queued(int fd, const char *want, int eof)
{
    char buf[8192];
    ssize_t n = recv(fd, buf, sizeof(buf), MSG_PEEK | MSG_DONTWAIT);
    size_t len = strlen(want);
    if (n < 0 && errno == EAGAIN && !len && !eof)
        n = 0;  /* nothing queued */
    CHECK(n == (ssize_t)len && !memcmp(buf, want, len), "queued %zd bytes, not %zu (%.*s)", n, len,
          n > 0 ? (int)n : 0, buf);
    struct pollfd p = {fd, POLLIN | POLLRDHUP, 0};
    CHECK(poll(&p, 1, 0) == (len || eof) && (!!(p.revents & POLLRDHUP)) == eof, "poll 0x%x", p.revents);
}

static void read_all(int fd, const char *want)
{
    char buf[8192];
    size_t got = 0, len = strlen(want);
    while (got < len) {
        ssize_t n = read(fd, buf + got, len - got);
        CHECK(n > 0, "read %zd at %zu of %zu", n, got, len);
        got += (size_t)n;
    }
    CHECK(got == len && !memcmp(buf, want, len), "read %.*s", (int)got, buf);
}

static void check_names(void)
{
    struct sockaddr_in a;
    socklen_t len = sizeof(a);
    CHECK(getsockname(shut_end, (struct sockaddr *)&a, &len) == 0 && !memcmp(&a, &shut_name, sizeof(a)),
          "the shut end's address changed");
    len = sizeof(a);
    CHECK(getpeername(shut_end, (struct sockaddr *)&a, &len) == 0 && !memcmp(&a, &shut_peer, sizeof(a)),
          "the shut end's peer changed");
    len = sizeof(a);
    CHECK(getpeername(open_end, (struct sockaddr *)&a, &len) == 0 && !memcmp(&a, &shut_name, sizeof(a)),
          "the open end's peer changed");
}

static void check(int step)
{
    CHECK(state_of(shut_end) == TCP_FIN_WAIT2, "the shut end is in state %d", state_of(shut_end));
    CHECK(state_of(open_end) == TCP_CLOSE_WAIT, "the open end is in state %d", state_of(open_end));
    check_names();
    /* the end in CLOSE-WAIT: "world", then the end of the stream, unread */
    expect_queued(open_end, "world", 1);
    /* the end in FIN-WAIT-2 may not send, and still gets all that was sent it */
    CHECK(send(shut_end, "x", 1, MSG_NOSIGNAL | MSG_DONTWAIT) < 0 && errno == EPIPE, "send after shutdown");
    expect_queued(shut_end, sent, 0);
    char word[16];
    snprintf(word, sizeof(word), "s%03d", step);
    CHECK(write(open_end, word, strlen(word)) == (ssize_t)strlen(word), "write in CLOSE-WAIT");
    strcat(sent, word);
    struct pollfd p = {shut_end, POLLIN, 0};
    CHECK(poll(&p, 1, 2000) == 1, "the word did not arrive");
    for (int i = 0; i < 1000; i++) {  /* all of it, not its first segment only */
        char buf[8192];
        if (recv(shut_end, buf, sizeof(buf), MSG_PEEK | MSG_DONTWAIT) == (ssize_t)strlen(sent))
            break;
        step_sleep_ms(1);
    }
    expect_queued(shut_end, sent, 0);
    if (step < nsteps)
        return;
    read_all(open_end, "world");
    char c;
    CHECK(read(open_end, &c, 1) == 0 && read(open_end, &c, 1) == 0, "the end of the stream");
    read_all(shut_end, sent);
    close(open_end);
    CHECK(read(shut_end, &c, 1) == 0, "the end of the stream, on the shut end");
}

/* the state /proc/net/tcp shows for the connection from local to remote;
 * -1: none.  Read again when it lists the connection twice with two states
 * or not at all: a listing read while other sockets come and go may repeat
 * or skip lines */
static int proc_state(const struct sockaddr_in *local, const struct sockaddr_in *remote)
{
    int found = -1;
    for (int tries = 0; tries < 50; tries++, step_sleep_ms(2)) {
        FILE *f = fopen("/proc/net/tcp", "r");
        CHECK(f != NULL, "open /proc/net/tcp");
        char line[512];
        int consistent = 1;
        found = -1;
        while (fgets(line, sizeof(line), f)) {
            unsigned la, lp, ra, rp, st;
            if (sscanf(line, " %*d: %x:%x %x:%x %x", &la, &lp, &ra, &rp, &st) != 5)
                continue;
            if (la == local->sin_addr.s_addr && lp == ntohs(local->sin_port) && ra == remote->sin_addr.s_addr &&
                rp == ntohs(remote->sin_port)) {
                consistent &= found < 0 || found == (int)st;
                found = (int)st;
            }
        }
        fclose(f);
        if (consistent && found >= 0)
            break;
    }
    return found;
}

static void peer_closed_check(int step)
{
    CHECK(state_of(open_end) == TCP_CLOSE_WAIT, "the open end is in state %d", state_of(open_end));
    struct sockaddr_in open_name;
    socklen_t len = sizeof(open_name);
    CHECK(getsockname(open_end, (struct sockaddr *)&open_name, &len) == 0, "getsockname");
    CHECK(proc_state(&open_name, &shut_name) == TCP_CLOSE_WAIT, "/proc/net/tcp: the open end");
    /* the closed end, an orphan no process holds, in FIN-WAIT-2 */
    CHECK(proc_state(&shut_name, &open_name) == TCP_FIN_WAIT2, "/proc/net/tcp: the closed end is in state %d",
          proc_state(&shut_name, &open_name));
    len = sizeof(open_name);
    struct sockaddr_in a;
    CHECK(getpeername(open_end, (struct sockaddr *)&a, &len) == 0 && !memcmp(&a, &shut_name, sizeof(a)),
          "the open end's peer changed");
    expect_queued(open_end, "world", 1);
    if (step < nsteps)
        return;
    read_all(open_end, "world");
    char c;
    CHECK(read(open_end, &c, 1) == 0, "the end of the stream");
    /* writing to a closed end: it answers with a reset */
    CHECK(write(open_end, "x", 1) == 1, "the first write");
    for (int i = 0; i < 2000 && state_of(open_end) != TCP_CLOSE; i++)
        step_sleep_ms(1);
    CHECK(state_of(open_end) == TCP_CLOSE, "no reset: state %d", state_of(open_end));
    CHECK(write(open_end, "x", 1) < 0 && errno == EPIPE, "the write after the reset");
}

int main(int argc, char **argv)
{
    nsteps = steps_of(argc, argv);
    CHECK(argc > 2, "usage: tcp_closing STEPS client|server|peerclosed");
    const char *mode = argv[2];
    signal(SIGPIPE, SIG_IGN);
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
    listener = socket(AF_INET, SOCK_STREAM, 0);
    socklen_t len = sizeof(a);
    CHECK(listener >= 0 && bind(listener, (struct sockaddr *)&a, sizeof(a)) == 0 && listen(listener, 4) == 0 &&
              getsockname(listener, (struct sockaddr *)&a, &len) == 0,
          "listen");
    int client = socket(AF_INET, SOCK_STREAM, 0);
    CHECK(client >= 0 && connect(client, (struct sockaddr *)&a, sizeof(a)) == 0, "connect");
    int server = accept(listener, NULL, NULL);
    CHECK(server >= 0, "accept");
    int server_shuts = !strcmp(mode, "server");
    CHECK(server_shuts || !strcmp(mode, "client") || !strcmp(mode, "peerclosed"), "mode %s", mode);
    shut_end = server_shuts ? server : client;
    open_end = server_shuts ? client : server;
    len = sizeof(shut_name);
    CHECK(getsockname(shut_end, (struct sockaddr *)&shut_name, &len) == 0, "getsockname");
    len = sizeof(shut_peer);
    CHECK(getpeername(shut_end, (struct sockaddr *)&shut_peer, &len) == 0, "getpeername");
    CHECK(write(shut_end, "hello world", 11) == 11, "write");
    struct pollfd p = {open_end, POLLIN, 0};
    CHECK(poll(&p, 1, 2000) == 1, "poll");
    for (int i = 0; i < 1000; i++) {  /* both segments, if it came in two */
        char peek[16];
        if (recv(open_end, peek, sizeof(peek), MSG_PEEK | MSG_DONTWAIT) == 11)
            break;
        step_sleep_ms(1);
    }
    read_all(open_end, "hello ");
    if (!strcmp(mode, "peerclosed")) {
        close(shut_end);
        wait_state(open_end, TCP_CLOSE_WAIT);
        struct sockaddr_in open_name;
        len = sizeof(open_name);
        CHECK(getsockname(open_end, (struct sockaddr *)&open_name, &len) == 0, "getsockname");
        /* the open end acknowledges the FIN late (a delayed ACK) */
        for (int i = 0; i < 2000 && proc_state(&shut_name, &open_name) != TCP_FIN_WAIT2; i++)
            step_sleep_ms(1);
        return run_steps(nsteps, peer_closed_check);
    }
    CHECK(shutdown(shut_end, SHUT_WR) == 0, "shutdown");
    wait_state(shut_end, TCP_FIN_WAIT2);
    wait_state(open_end, TCP_CLOSE_WAIT);
    return run_steps(nsteps, check);
}
