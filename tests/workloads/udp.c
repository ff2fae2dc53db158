/*
 * UDP, ICMP ping and raw sockets, checked from inside across a restart
 * (tests/test_udp.py, issue 19).
 *
 *   udp STEPS dgram         IPv4 and IPv6 UDP sockets: bound with options,
 *                           connected (bound by connect), unbound, shared
 *                           with a child; each pair exchanges datagrams at
 *                           every step
 *   udp STEPS queued FLAG   a datagram left unread until FLAG exists
 *   udp STEPS raw           raw sockets (a protocol of their own, one with
 *                           IP_HDRINCL) exchanging packets, and an IPv6 one
 *                           connected to ::1
 *   udp STEPS ping          an ICMP ping socket pinging itself
 *   udp STEPS group         sockets that joined multicast groups (IPv4, IPv6)
 *   udp STEPS groupfilter   one that joined a group for one source only
 *   udp STEPS addr ADDR     a socket bound to ADDR (a node's address)
 */
#define _GNU_SOURCE
#include "state_check.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <linux/icmp.h>
#include <netinet/in.h>
#include <netinet/ip.h>
#include <signal.h>
#include <sys/random.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#define PROTO 253  /* "for experimentation" (RFC 3692): nobody else sends it */

static const char *mode, *flag;
static int a4, b4, u4, a6, b6, q1, q2, r1, r2, r3, r6, ping, grp;
static pid_t child;

/* what a socket looks like from inside, taken at setup and compared at every step */
struct look {
    int domain, type, protocol, flags;
    struct sockaddr_storage name, peer;
    socklen_t name_len, peer_len;
    int opt[24];
};

static const struct {
    int level, name;
} opts[] = {
    {SOL_SOCKET, SO_BROADCAST}, {SOL_SOCKET, SO_REUSEADDR}, {SOL_SOCKET, SO_REUSEPORT}, {SOL_SOCKET, SO_RCVBUF},
    {SOL_SOCKET, SO_SNDBUF},    {SOL_SOCKET, SO_PRIORITY},  {SOL_IP, IP_TOS},          {SOL_IP, IP_TTL},
    {SOL_IP, IP_MULTICAST_TTL}, {SOL_IP, IP_MULTICAST_LOOP}, {SOL_IP, IP_MULTICAST_IF}, {SOL_IP, IP_RECVERR},
    {SOL_IP, IP_PKTINFO},       {SOL_IP, IP_HDRINCL},       {SOL_IPV6, IPV6_V6ONLY},   {SOL_IPV6, IPV6_UNICAST_HOPS},
    {SOL_IPV6, IPV6_TCLASS},    {SOL_IPV6, IPV6_MULTICAST_HOPS}, {SOL_IPV6, IPV6_MULTICAST_LOOP},
    {SOL_IPV6, IPV6_RECVPKTINFO}, {SOL_RAW, ICMP_FILTER},
};
#define NOPTS (sizeof(opts) / sizeof(opts[0]))

static struct look looks[16];
static int watched[16], nwatched;

static void take(int fd, struct look *l)
{
    memset(l, 0, sizeof(*l));
    socklen_t len = sizeof(int);
    getsockopt(fd, SOL_SOCKET, SO_DOMAIN, &l->domain, &len);
    len = sizeof(int);
    getsockopt(fd, SOL_SOCKET, SO_TYPE, &l->type, &len);
    len = sizeof(int);
    getsockopt(fd, SOL_SOCKET, SO_PROTOCOL, &l->protocol, &len);
    l->flags = fcntl(fd, F_GETFL) | fcntl(fd, F_GETFD) << 24;
    l->name_len = sizeof(l->name);
    getsockname(fd, (struct sockaddr *)&l->name, &l->name_len);
    l->peer_len = sizeof(l->peer);
    if (getpeername(fd, (struct sockaddr *)&l->peer, &l->peer_len) < 0)
        l->peer_len = 0;
    for (size_t i = 0; i < NOPTS; i++) {
        len = sizeof(int);
        if (getsockopt(fd, opts[i].level, opts[i].name, &l->opt[i], &len) < 0)
            l->opt[i] = -12345;
    }
}

static void watch(int fd)
{
    take(fd, &looks[nwatched]);
    watched[nwatched++] = fd;
}

static void check_looks(void)
{
    for (int i = 0; i < nwatched; i++) {
        struct look now;
        take(watched[i], &now);
        const struct look *was = &looks[i];
        CHECK(now.domain == was->domain && now.type == was->type && now.protocol == was->protocol,
              "fd %d: domain/type/protocol %d/%d/%d, not %d/%d/%d", watched[i], now.domain, now.type, now.protocol,
              was->domain, was->type, was->protocol);
        CHECK(now.flags == was->flags, "fd %d: flags %#x, not %#x", watched[i], now.flags, was->flags);
        CHECK(now.name_len == was->name_len && !memcmp(&now.name, &was->name, now.name_len), "fd %d: local address",
              watched[i]);
        CHECK(now.peer_len == was->peer_len && !memcmp(&now.peer, &was->peer, now.peer_len), "fd %d: peer address",
              watched[i]);
        for (size_t k = 0; k < NOPTS; k++)
            CHECK(now.opt[k] == was->opt[k], "fd %d option %d/%d: %d, not %d", watched[i], opts[k].level,
                  opts[k].name, now.opt[k], was->opt[k]);
    }
}

static void set_i(int fd, int level, int name, int v)
{
    CHECK(setsockopt(fd, level, name, &v, sizeof(v)) == 0, "setsockopt %d/%d", level, name);
}

static int udp(int family)
{
    int fd = socket(family, SOCK_DGRAM, 0);
    CHECK(fd >= 0, "socket");
    return fd;
}

static void bind_any(int fd, int family, const char *addr)
{
    struct sockaddr_storage ss;
    memset(&ss, 0, sizeof(ss));
    socklen_t len;
    if (family == AF_INET) {
        struct sockaddr_in *s = (void *)&ss;
        s->sin_family = AF_INET;
        CHECK(inet_pton(AF_INET, addr, &s->sin_addr) == 1, "address %s", addr);
        len = sizeof(*s);
    } else {
        struct sockaddr_in6 *s = (void *)&ss;
        s->sin6_family = AF_INET6;
        CHECK(inet_pton(AF_INET6, addr, &s->sin6_addr) == 1, "address %s", addr);
        len = sizeof(*s);
    }
    CHECK(bind(fd, (struct sockaddr *)&ss, len) == 0, "bind %s", addr);
}

static void connect_to(int fd, int to)
{
    struct sockaddr_storage ss;
    socklen_t len = sizeof(ss);
    CHECK(getsockname(to, (struct sockaddr *)&ss, &len) == 0, "getsockname");
    CHECK(connect(fd, (struct sockaddr *)&ss, len) == 0, "connect");
}

/* one datagram, waited for (the sockets may be non-blocking) */
static ssize_t recv_wait(int fd, char *buf, size_t cap, struct sockaddr_storage *from, socklen_t *flen)
{
    for (int tries = 0; tries < 2000; tries++) {
        ssize_t n = recvfrom(fd, buf, cap, MSG_DONTWAIT, (struct sockaddr *)from, flen);
        if (n >= 0)
            return n;
        CHECK(errno == EAGAIN, "recvfrom");
        step_sleep_ms(1);
    }
    CHECK(0, "no datagram on fd %d", fd);
    return -1;
}

/* b sends to a (connected), a answers to where it came from, b reads it */
static void exchange(const char *name, int a, int b, int step)
{
    char msg[64], buf[128];
    snprintf(msg, sizeof(msg), "%s ping %d", name, step);
    CHECK(send(b, msg, strlen(msg), 0) == (ssize_t)strlen(msg), "send");
    struct sockaddr_storage from, bname;
    socklen_t flen = sizeof(from), blen = sizeof(bname);
    ssize_t n = recv_wait(a, buf, sizeof(buf) - 1, &from, &flen);
    buf[n] = 0;
    CHECK(!strcmp(buf, msg), "%s: got '%s'", name, buf);
    CHECK(getsockname(b, (struct sockaddr *)&bname, &blen) == 0 && blen == flen && !memcmp(&bname, &from, flen),
          "%s: the datagram's source is not the sender's address", name);
    snprintf(msg, sizeof(msg), "%s pong %d", name, step);
    CHECK(sendto(a, msg, strlen(msg), 0, (struct sockaddr *)&from, flen) == (ssize_t)strlen(msg), "sendto");
    flen = sizeof(from);
    n = recv_wait(b, buf, sizeof(buf) - 1, &from, &flen);
    buf[n] = 0;
    CHECK(!strcmp(buf, msg), "%s: got '%s'", name, buf);
    printf("%s\n", buf);
}

/* ---- dgram ---- */

static void dgram_setup(void)
{
    a4 = udp(AF_INET);
    set_i(a4, SOL_SOCKET, SO_REUSEADDR, 1);
    set_i(a4, SOL_SOCKET, SO_BROADCAST, 1);
    set_i(a4, SOL_SOCKET, SO_RCVBUF, 123456);
    set_i(a4, SOL_SOCKET, SO_SNDBUF, 65432);
    set_i(a4, SOL_IP, IP_TOS, 0x28);
    set_i(a4, SOL_IP, IP_TTL, 33);
    set_i(a4, SOL_IP, IP_MULTICAST_TTL, 7);
    set_i(a4, SOL_IP, IP_MULTICAST_LOOP, 0);
    struct in_addr lo = {htonl(INADDR_LOOPBACK)};
    CHECK(setsockopt(a4, SOL_IP, IP_MULTICAST_IF, &lo, sizeof(lo)) == 0, "IP_MULTICAST_IF");
    set_i(a4, SOL_IP, IP_RECVERR, 1);
    set_i(a4, SOL_IP, IP_PKTINFO, 1);
    bind_any(a4, AF_INET, "127.0.0.1");
    CHECK(fcntl(a4, F_SETFL, O_NONBLOCK) == 0, "O_NONBLOCK");
    b4 = udp(AF_INET);
    set_i(b4, SOL_SOCKET, SO_PRIORITY, 5);
    connect_to(b4, a4);
    u4 = udp(AF_INET);
    set_i(u4, SOL_IP, IP_TTL, 99);
    CHECK(fcntl(u4, F_SETFD, FD_CLOEXEC) == 0, "FD_CLOEXEC");

    a6 = udp(AF_INET6);
    set_i(a6, SOL_IPV6, IPV6_V6ONLY, 1);
    set_i(a6, SOL_SOCKET, SO_REUSEPORT, 1);
    set_i(a6, SOL_IPV6, IPV6_UNICAST_HOPS, 17);
    set_i(a6, SOL_IPV6, IPV6_TCLASS, 0x40);
    set_i(a6, SOL_IPV6, IPV6_MULTICAST_HOPS, 5);
    set_i(a6, SOL_IPV6, IPV6_MULTICAST_LOOP, 0);
    set_i(a6, SOL_IPV6, IPV6_RECVPKTINFO, 1);
    bind_any(a6, AF_INET6, "::1");
    b6 = udp(AF_INET6);
    set_i(b6, SOL_IPV6, IPV6_V6ONLY, 0);
    connect_to(b6, a6);
    CHECK(fcntl(b6, F_SETFL, O_NONBLOCK) == 0, "O_NONBLOCK");
    int fds[] = {a4, b4, u4, a6, b6};
    for (int i = 0; i < 5; i++)
        watch(fds[i]);
    /* a child shares b4 and a4 (one socket, two processes) and does the
     * IPv4 exchange from its side at every step */
    int go[2], done[2];
    CHECK(pipe(go) == 0 && pipe(done) == 0, "pipe");
    child = fork();
    CHECK(child >= 0, "fork");
    if (!child) {
        close(go[1]);
        close(done[0]);
        char c;
        for (int step = 1; read(go[0], &c, 1) == 1; step++) {
            exchange("child", a4, b4, step);
            CHECK(write(done[1], "d", 1) == 1, "write");
        }
        _exit(0);
    }
    /* the parent's fds 40/41 are the pipes to the child (kept as they are) */
    CHECK(dup2(go[1], 40) == 40 && dup2(done[0], 41) == 41, "dup2");
    close(go[0]);
    close(go[1]);
    close(done[0]);
    close(done[1]);
}

static void dgram_check(int step)
{
    check_looks();
    exchange("v4", a4, b4, step);
    exchange("v6", a6, b6, step);
    char c;
    CHECK(write(40, "g", 1) == 1 && read(41, &c, 1) == 1, "the child");
}

/* ---- queued ---- */

static int queued_read;

static void queued_setup(void)
{
    q1 = udp(AF_INET);
    bind_any(q1, AF_INET, "127.0.0.1");
    q2 = udp(AF_INET);
    connect_to(q2, q1);
    CHECK(send(q2, "queued", 6, 0) == 6, "send");
    watch(q1);
    watch(q2);
    a4 = udp(AF_INET);  /* and a pair that keeps talking meanwhile */
    bind_any(a4, AF_INET, "127.0.0.1");
    b4 = udp(AF_INET);
    connect_to(b4, a4);
}

static void queued_check(int step)
{
    check_looks();
    if (!queued_read && access(flag, F_OK) == 0) {
        char buf[16];
        struct sockaddr_storage from, want;
        socklen_t flen = sizeof(from), wlen = sizeof(want);
        ssize_t n = recv_wait(q1, buf, sizeof(buf), &from, &flen);
        CHECK(n == 6 && !memcmp(buf, "queued", 6), "the queued datagram");
        CHECK(getsockname(q2, (struct sockaddr *)&want, &wlen) == 0 && wlen == flen && !memcmp(&want, &from, flen),
              "the queued datagram's source");
        queued_read = 1;
    }
    exchange("q", a4, b4, step);
}

/* ---- raw ---- */

static struct in_addr own;  /* a loopback address of this run's own: 127.x.y.z */

static void raw_setup(void)
{
    unsigned char rnd[3];
    CHECK(getrandom(rnd, 3, 0) == 3, "getrandom");
    own.s_addr = htonl(0x7f000000u | (uint32_t)(rnd[0] | 1) << 16 | (uint32_t)rnd[1] << 8 | (rnd[2] | 2));
    struct sockaddr_in sa = {.sin_family = AF_INET, .sin_addr = own};
    CHECK((r1 = socket(AF_INET, SOCK_RAW, PROTO)) >= 0, "raw socket (root?)");
    CHECK(bind(r1, (struct sockaddr *)&sa, sizeof(sa)) == 0, "bind raw");
    /* connected: it receives only what comes from own (nothing: packets to
     * own come from 127.0.0.1) */
    CHECK((r2 = socket(AF_INET, SOCK_RAW, PROTO)) >= 0, "raw socket");
    CHECK(connect(r2, (struct sockaddr *)&sa, sizeof(sa)) == 0, "connect raw");
    set_i(r2, SOL_IP, IP_TTL, 21);
    CHECK((r3 = socket(AF_INET, SOCK_RAW, PROTO)) >= 0, "raw socket");
    set_i(r3, SOL_IP, IP_HDRINCL, 1);
    /* bound to another address of its own, so that it receives nothing
     * (unbound, it would get every packet of the protocol, never read) */
    struct sockaddr_in other = {.sin_family = AF_INET, .sin_addr.s_addr = own.s_addr ^ htonl(1)};
    CHECK(bind(r3, (struct sockaddr *)&other, sizeof(other)) == 0, "bind raw");
    CHECK(fcntl(r3, F_SETFL, O_NONBLOCK) == 0, "O_NONBLOCK");
    CHECK((r6 = socket(AF_INET6, SOCK_RAW, PROTO)) >= 0, "raw IPv6 socket");
    set_i(r6, SOL_IPV6, IPV6_UNICAST_HOPS, 9);
    struct sockaddr_in6 lo6 = {.sin6_family = AF_INET6, .sin6_addr = IN6ADDR_LOOPBACK_INIT};
    CHECK(connect(r6, (struct sockaddr *)&lo6, sizeof(lo6)) == 0, "connect raw IPv6");
    int fds[] = {r1, r2, r3, r6};
    for (int i = 0; i < 4; i++)
        watch(fds[i]);
}

static void raw_recv(const char *want, int ttl)
{
    char buf[256];
    struct sockaddr_storage from;
    socklen_t flen = sizeof(from);
    ssize_t n = recv_wait(r1, buf, sizeof(buf) - 1, &from, &flen);
    struct iphdr *ip = (void *)buf;
    CHECK(n > (ssize_t)sizeof(*ip) && ip->protocol == PROTO && ip->daddr == own.s_addr, "a packet of ours");
    CHECK(ip->ttl == ttl, "ttl %d, not %d", ip->ttl, ttl);
    buf[n] = 0;
    CHECK(!strcmp(buf + ip->ihl * 4, want), "raw: got '%s'", buf + ip->ihl * 4);
    printf("raw got %s\n", want);
}

/* a raw socket's peer, which getpeername() does not tell: its line in
 * /proc/net/raw6 ("sl local remote st ... inode"), remote and state */
static void raw6_peer(int fd, char *out, size_t cap)
{
    struct stat st;
    CHECK(fstat(fd, &st) == 0, "fstat");
    FILE *f = fopen("/proc/self/net/raw6", "r");
    CHECK(f, "/proc/self/net/raw6");
    char line[512], remote[64] = "", state[8] = "";
    unsigned long ino;
    out[0] = 0;
    while (fgets(line, sizeof(line), f))
        if (sscanf(line, "%*s %*s %63s %7s %*s %*s %*s %*s %*s %lu", remote, state, &ino) == 3 &&
            ino == (unsigned long)st.st_ino)
            snprintf(out, cap, "%s %s", remote, state);
    fclose(f);
}

static char r6_peer_at_setup[80];

static void raw_check(int step)
{
    check_looks();
    char peer[80];
    raw6_peer(r6, peer, sizeof(peer));
    if (step == 1)
        memcpy(r6_peer_at_setup, peer, sizeof(peer));
    CHECK(peer[0] && !strcmp(peer, r6_peer_at_setup), "raw IPv6 peer '%s', not '%s'", peer, r6_peer_at_setup);
    CHECK(strstr(peer, "00000000000000000000000001000000:0000 01"), "raw IPv6 socket not connected to ::1: %s", peer);
    char msg[64];
    snprintf(msg, sizeof(msg), "packet %d", step);
    CHECK(send(r2, msg, strlen(msg), 0) == (ssize_t)strlen(msg), "send raw");
    raw_recv(msg, 21);
    /* r3 writes its own IP header */
    char pkt[128];
    struct iphdr *ip = (void *)pkt;
    memset(pkt, 0, sizeof(pkt));
    snprintf(msg, sizeof(msg), "hdrincl %d", step);
    ip->version = 4;
    ip->ihl = 5;
    ip->ttl = 44;
    ip->protocol = PROTO;
    ip->saddr = htonl(INADDR_LOOPBACK);
    ip->daddr = own.s_addr;
    size_t len = sizeof(*ip) + strlen(msg);
    ip->tot_len = htons((uint16_t)len);
    memcpy(pkt + sizeof(*ip), msg, strlen(msg));
    struct sockaddr_in to = {.sin_family = AF_INET, .sin_addr = own};
    CHECK(sendto(r3, pkt, len, 0, (struct sockaddr *)&to, sizeof(to)) == (ssize_t)len, "sendto hdrincl");
    raw_recv(msg, 44);
}

/* ---- ping ---- */

static void ping_setup(void)
{
    ping = socket(AF_INET, SOCK_DGRAM, IPPROTO_ICMP);
    CHECK(ping >= 0, "ping socket (net.ipv4.ping_group_range?)");
    struct sockaddr_in sa = {.sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
    CHECK(bind(ping, (struct sockaddr *)&sa, sizeof(sa)) == 0, "bind ping");
    set_i(ping, SOL_IP, IP_TTL, 12);
    watch(ping);
}

static void ping_check(int step)
{
    check_looks();
    struct icmphdr req = {.type = ICMP_ECHO}, *rep;
    req.un.echo.sequence = htons((uint16_t)step);
    struct sockaddr_in to = {.sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
    CHECK(sendto(ping, &req, sizeof(req), 0, (struct sockaddr *)&to, sizeof(to)) == sizeof(req), "sendto ping");
    char buf[128];
    struct sockaddr_storage from;
    socklen_t flen = sizeof(from);
    ssize_t n = recv_wait(ping, buf, sizeof(buf), &from, &flen);
    rep = (void *)buf;
    CHECK(n >= (ssize_t)sizeof(*rep) && rep->type == ICMP_ECHOREPLY && ntohs(rep->un.echo.sequence) == step,
          "echo reply");
    printf("pong %d\n", step);
}

/* ---- group, addr ---- */

/* multicast: a v4 and a v6 socket joined groups on lo; the v4 one gets a
 * datagram sent to its group at every step */
static int grp6, msend;
static struct sockaddr_in gaddr;

static int joined(int fd, int family, const char *group)
{
    struct group_filter gf;
    memset(&gf, 0, sizeof(gf));
    gf.gf_interface = 1;
    if (family == AF_INET) {
        struct sockaddr_in *g = (void *)&gf.gf_group;
        g->sin_family = AF_INET;
        inet_pton(AF_INET, group, &g->sin_addr);
    } else {
        struct sockaddr_in6 *g = (void *)&gf.gf_group;
        g->sin6_family = AF_INET6;
        inet_pton(AF_INET6, group, &g->sin6_addr);
    }
    socklen_t len = sizeof(gf);
    if (getsockopt(fd, family == AF_INET ? SOL_IP : SOL_IPV6, MCAST_MSFILTER, &gf, &len) < 0)
        return 0;
    return gf.gf_fmode == MCAST_EXCLUDE && gf.gf_numsrc == 0;
}

static void group_setup(int filter)
{
    grp = udp(AF_INET);
    struct sockaddr_in any = {.sin_family = AF_INET};
    CHECK(bind(grp, (struct sockaddr *)&any, sizeof(any)) == 0, "bind");
    socklen_t len = sizeof(gaddr);
    CHECK(getsockname(grp, (struct sockaddr *)&gaddr, &len) == 0, "getsockname");
    inet_pton(AF_INET, "239.1.2.3", &gaddr.sin_addr);
    if (filter) {
        struct ip_mreq_source m = {.imr_interface.s_addr = htonl(INADDR_LOOPBACK)};
        inet_pton(AF_INET, "239.1.2.3", &m.imr_multiaddr);
        inet_pton(AF_INET, "127.0.0.1", &m.imr_sourceaddr);
        CHECK(setsockopt(grp, SOL_IP, IP_ADD_SOURCE_MEMBERSHIP, &m, sizeof(m)) == 0, "IP_ADD_SOURCE_MEMBERSHIP");
    } else {
        struct ip_mreqn m = {.imr_ifindex = 1};
        m.imr_multiaddr = gaddr.sin_addr;
        CHECK(setsockopt(grp, SOL_IP, IP_ADD_MEMBERSHIP, &m, sizeof(m)) == 0, "IP_ADD_MEMBERSHIP");
    }
    grp6 = udp(AF_INET6);
    struct ipv6_mreq m6 = {.ipv6mr_interface = 1};
    inet_pton(AF_INET6, "ff15::1234", &m6.ipv6mr_multiaddr);
    CHECK(setsockopt(grp6, SOL_IPV6, IPV6_JOIN_GROUP, &m6, sizeof(m6)) == 0, "IPV6_JOIN_GROUP");
    msend = udp(AF_INET);
    struct in_addr lo = {htonl(INADDR_LOOPBACK)};
    CHECK(setsockopt(msend, SOL_IP, IP_MULTICAST_IF, &lo, sizeof(lo)) == 0, "IP_MULTICAST_IF");
    bind_any(msend, AF_INET, "127.0.0.1");
    watch(grp);
    watch(grp6);
    watch(msend);
}

static void group_check(int step)
{
    check_looks();
    CHECK(joined(grp, AF_INET, "239.1.2.3"), "not in 239.1.2.3");
    CHECK(!joined(grp, AF_INET, "239.1.2.4"), "in 239.1.2.4");
    CHECK(joined(grp6, AF_INET6, "ff15::1234"), "not in ff15::1234");
    char msg[32], buf[64];
    snprintf(msg, sizeof(msg), "multicast %d", step);
    CHECK(sendto(msend, msg, strlen(msg), 0, (struct sockaddr *)&gaddr, sizeof(gaddr)) == (ssize_t)strlen(msg),
          "sendto group");
    struct sockaddr_storage from;
    socklen_t flen = sizeof(from);
    ssize_t n = recv_wait(grp, buf, sizeof(buf) - 1, &from, &flen);
    buf[n] = 0;
    CHECK(!strcmp(buf, msg), "group: got '%s'", buf);
    printf("%s\n", buf);
}

static void addr_setup(const char *addr)
{
    a4 = udp(AF_INET);
    bind_any(a4, AF_INET, addr);
    b4 = udp(AF_INET);
    bind_any(b4, AF_INET, addr);
    connect_to(b4, a4);
    watch(a4);
    watch(b4);
}

static void simple_check(int step)
{
    check_looks();
    if (!strcmp(mode, "addr"))
        exchange("addr", a4, b4, step);
}

int main(int argc, char **argv)
{
    setvbuf(stdout, 0, _IOLBF, 0);  /* before the child is forked: its lines in order */
    mode = argc > 2 ? argv[2] : "dgram";
    flag = argc > 3 ? argv[3] : "";
    void (*check)(int) = simple_check;
    if (!strcmp(mode, "dgram")) {
        dgram_setup();
        check = dgram_check;
    } else if (!strcmp(mode, "queued")) {
        queued_setup();
        check = queued_check;
    } else if (!strcmp(mode, "raw")) {
        raw_setup();
        check = raw_check;
    } else if (!strcmp(mode, "ping")) {
        ping_setup();
        check = ping_check;
    } else if (!strcmp(mode, "group") || !strcmp(mode, "groupfilter")) {
        group_setup(!strcmp(mode, "groupfilter"));
        check = strcmp(mode, "groupfilter") ? group_check : simple_check;
    } else if (!strcmp(mode, "addr")) {
        addr_setup(flag);
    } else {
        fprintf(stderr, "unknown mode %s\n", mode);
        return 2;
    }
    int rc = run_steps(steps_of(argc, argv), check);
    if (child) {
        close(40);
        waitpid(child, 0, 0);
    }
    return rc;
}
