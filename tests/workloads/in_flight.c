/*
 * Descriptors in flight in a Unix socket (SCM_RIGHTS sent, not yet
 * received) across a checkpoint and a restart (tests/test_in_flight.py).
 * Usage: in_flight STEPS MODE DIR [FLAG]
 *   stream  a stream socketpair's queue: "B" with a pipe's read end (5
 *           bytes in it) and a file at offset 4, "D" with one end of another
 *           socketpair (4 bytes queued on it), "EEE"
 *   wide    "AAAA" then "B" with the pipe's read end on a stream: refused
 *           (where "B" starts cannot be seen; never received)
 *   dgram   the same descriptors on datagrams: "one", "two" with the pipe's
 *           read end and the file, "" with the socket, "four"
 *   unreceived  a socket in flight that carries a pipe end in flight itself
 *           (refused: never received)
 * With FLAG, the child waits at step RECV_AT until FLAG exists (the test
 * makes it once the job is restarted), so the descriptors are in flight at
 * the checkpoint however slow it is.
 * The parent sends and keeps the file (one open file description with the
 * copy in flight), the child receives at step RECV_AT, reading the bytes
 * in small pieces so that every message boundary shows, and uses what it
 * got; the parent then prints the file's offset, which the child moved.
 */
#define _GNU_SOURCE
#include "state_check.h"

#include <fcntl.h>
#include <sys/ioctl.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#define RECV_AT 8

static int dgram, unreceived, rx, keep, expect_queued;
static const char *flag;

static void send_with(int s, const char *data, size_t len, const int *fds, int nfds)
{
    union {
        struct cmsghdr h;
        char space[CMSG_SPACE(sizeof(int) * 4)];
    } ctl;
    struct iovec iov = {(void *)data, len};
    struct msghdr m = {0};
    m.msg_iov = &iov;
    m.msg_iovlen = 1;
    if (nfds) {
        m.msg_control = &ctl;
        m.msg_controllen = CMSG_SPACE(sizeof(int) * nfds);
        ctl.h.cmsg_level = SOL_SOCKET;
        ctl.h.cmsg_type = SCM_RIGHTS;
        ctl.h.cmsg_len = CMSG_LEN(sizeof(int) * nfds);
        memcpy(CMSG_DATA(&ctl.h), fds, sizeof(int) * nfds);
    }
    CHECK(sendmsg(s, &m, 0) == (ssize_t)len, "sendmsg");
}

/* one recvmsg of at most cap bytes: prints what came and how many descriptors */
static int receive(int s, size_t cap, int *fds)
{
    char buf[64] = {0}, ctlbuf[CMSG_SPACE(sizeof(int) * 4)];
    struct iovec iov = {buf, cap};
    struct msghdr m = {0};
    m.msg_iov = &iov;
    m.msg_iovlen = 1;
    m.msg_control = ctlbuf;
    m.msg_controllen = sizeof(ctlbuf);
    ssize_t n = recvmsg(s, &m, MSG_DONTWAIT);
    CHECK(n >= 0, "recvmsg");
    int k = 0;
    for (struct cmsghdr *c = CMSG_FIRSTHDR(&m); c; c = CMSG_NXTHDR(&m, c))
        if (c->cmsg_level == SOL_SOCKET && c->cmsg_type == SCM_RIGHTS)
            for (size_t i = 0; i < (c->cmsg_len - CMSG_LEN(0)) / sizeof(int); i++)
                fds[k++] = ((int *)CMSG_DATA(c))[i];
    printf("received \"%.*s\" with %d descriptors%s\n", (int)n, buf, k, (m.msg_flags & MSG_CTRUNC) ? " (cut)" : "");
    return k;
}

/* what came in flight still works as it did: the pipe, the file, the socket */
static void use_pipe(int r)
{
    char buf[16] = {0};
    CHECK(read(r, buf, sizeof(buf)) == 5 && !memcmp(buf, "hello", 5), "the pipe in flight lost its bytes");
    printf("pipe: %s\n", buf);
}

static void use_file(int f)
{
    CHECK(lseek(f, 0, SEEK_CUR) == 4, "the file in flight is not at its offset");
    CHECK(lseek(keep, 0, SEEK_CUR) == 4, "the file kept is not at its offset");
    char buf[4] = {0};
    CHECK(read(f, buf, 2) == 2 && !memcmp(buf, "45", 2), "the file in flight reads wrong");
    CHECK(lseek(keep, 0, SEEK_CUR) == 6, "the file in flight and the file kept are not one description");
    printf("file: %s\n", buf);
}

static void use_socket(int s)
{
    char buf[8] = {0};
    CHECK(recv(s, buf, sizeof(buf), MSG_DONTWAIT) == 4 && !memcmp(buf, "ping", 4), "the socket in flight lost its queue");
    printf("socket: %s\n", buf);
}

static void check(int step)
{
    int queued = -1;
    if (step < RECV_AT) {
        CHECK(ioctl(rx, FIONREAD, &queued) == 0 && queued == expect_queued, "the queue holds %d bytes", queued);
        return;
    }
    if (step != RECV_AT || unreceived)
        return;
    while (flag && access(flag, F_OK) != 0)
        step_sleep_ms(10);
    int fds[8];
    if (!dgram) {
        CHECK(receive(rx, 60, fds) == 2, "not the pipe and the file");      /* "B": stops where they came */
        use_pipe(fds[0]);
        use_file(fds[1]);
        CHECK(receive(rx, 60, fds) == 1, "not the socket");                 /* "D" */
        use_socket(fds[0]);
        CHECK(receive(rx, 60, fds) == 0, "descriptors at the end");          /* "EEE" */
    } else {
        CHECK(receive(rx, 60, fds) == 0, "descriptors on the first");        /* "one" */
        CHECK(receive(rx, 60, fds) == 2, "not the pipe and the file");      /* "two" */
        use_pipe(fds[0]);
        use_file(fds[1]);
        CHECK(receive(rx, 60, fds) == 1, "not the socket");                 /* "" */
        use_socket(fds[0]);
        CHECK(receive(rx, 60, fds) == 0, "descriptors on the last");         /* "four" */
    }
    CHECK(ioctl(rx, FIONREAD, &queued) == 0 && queued == 0, "left in the queue: %d", queued);
}

int main(int argc, char **argv)
{
    int steps = steps_of(argc, argv);
    const char *mode = argc > 2 ? argv[2] : "stream";
    dgram = !strcmp(mode, "dgram");
    flag = argc > 4 ? argv[4] : 0;
    unreceived = !strcmp(mode, "nested") || !strcmp(mode, "wide");
    char path[4096];
    /* a name of its own: the reference run and the job run at once */
    snprintf(path, sizeof(path), "%s/in_flight.%d", argc > 3 ? argv[3] : ".", (int)getpid());
    keep = open(path, O_RDWR | O_CREAT | O_TRUNC, 0644);
    CHECK(keep >= 0 && write(keep, "0123456789", 10) == 10 && lseek(keep, 4, SEEK_SET) == 4, "file");
    int p[2], sp[2], pair[2];
    CHECK(pipe(p) == 0 && write(p[1], "hello", 5) == 5, "pipe");
    CHECK(socketpair(AF_UNIX, SOCK_STREAM, 0, sp) == 0, "socketpair");
    /* (not in "wide", where sp[1] is closed: unread bytes would reset sp[0]) */
    CHECK(!strcmp(mode, "wide") || send(sp[0], "ping", 4, 0) == 4, "send");
    CHECK(socketpair(AF_UNIX, dgram ? SOCK_DGRAM : SOCK_STREAM, 0, pair) == 0, "socketpair");
    int two[2] = {p[0], keep};
    if (!strcmp(mode, "wide")) {
        send_with(pair[0], "AAAA", 4, 0, 0);
        send_with(pair[0], "B", 1, &p[0], 1);
        expect_queued = 5;
    } else if (unreceived) {
        send_with(sp[0], "x", 1, &p[0], 1);  /* in flight on the socket that goes in flight */
        send_with(pair[0], "n", 1, &sp[1], 1);
        expect_queued = 1;
    } else if (!dgram) {
        send_with(pair[0], "B", 1, two, 2);
        send_with(pair[0], "D", 1, &sp[1], 1);
        send_with(pair[0], "EEE", 3, 0, 0);
        expect_queued = 5;
    } else {
        send_with(pair[0], "one", 3, 0, 0);
        send_with(pair[0], "two", 3, two, 2);
        send_with(pair[0], "", 0, &sp[1], 1);
        send_with(pair[0], "four", 4, 0, 0);
        expect_queued = 3;  /* FIONREAD on a datagram socket: the first one's size */
    }
    close(p[0]);
    close(sp[1]);
    rx = pair[1];
    setvbuf(stdout, 0, _IOLBF, 0);
    pid_t child = fork();
    CHECK(child >= 0, "fork");
    if (child == 0) {
        close(pair[0]);
        return run_steps(steps, check);
    }
    close(pair[1]);
    int status;
    CHECK(waitpid(child, &status, 0) == child, "waitpid");
    CHECK(WIFEXITED(status) && WEXITSTATUS(status) == 0, "the child failed");
    if (!unreceived) {
        /* the child's read through the copy in flight moved this one's offset */
        CHECK(lseek(keep, 0, SEEK_CUR) == 6, "the parent's file is not where the child left it");
        printf("parent: file at 6\n");
    }
    return 0;
}
