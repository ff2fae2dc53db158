/*
 * UDP, ICMP ping and raw sockets in the restore plan (plan.c has the
 * format; native/shim/dump_dgram.c says what is saved).  A socket is made
 * at its slot with its family, type and protocol and what its bind needs
 * set first, bound to its old address (a UDP or ping socket's port or ICMP
 * id included), connected again to its old peer; then its buffer sizes
 * (`sockbuf`, plan_tcp.c) and its options (`sockopts`, plan.c).  Each
 * process dups its sockets from the slots (fds.c).
 *   dgram SLOT INO FAMILY TYPE PROTOCOL OPTS   dgrambind SLOT SOCKADDR
 *   dgramconnect SLOT SOCKADDR
 *   mcast SLOT FAMILY IFNAME GROUP   join a multicast group (any source) on
 *                                    the interface of that name, here
 */
#include "plan.h"

#include <errno.h>
#include <net/if.h>
#include <netinet/in.h>
#include <sys/ioctl.h>
#include <sys/socket.h>

static void set_on(int fd, int level, int name, int value, const char *what)
{
    long rc = ck_setsockopt(fd, level, name, &value, sizeof(value));
    if (rc < 0)
        rst_fail("cannot set a datagram socket's option again", what, rc);
}

void op_dgram(const struct line *l)
{
    int family = (int)num(l, 3), type = (int)num(l, 4), proto = (int)num(l, 5);
    uint32_t opts = (uint32_t)num(l, 6);
    long fd = ck_socket(family, type | SOCK_CLOEXEC, proto);
    if (fd < 0)
        rst_fail(type == SOCK_RAW ? "cannot create a raw socket again (it needs CAP_NET_RAW)"
                 : proto == IPPROTO_UDP
                     ? "cannot create a UDP socket again"
                     : "cannot create an ICMP ping socket again (is the job's group in net.ipv4.ping_group_range "
                       "on this node?)",
                 0, fd);
    to_slot(fd, l, 1, "cannot create a datagram socket");
    int s = slot_fd(l, 1);
    if (opts & CK_SOCKOPT_REUSEADDR)
        set_on(s, SOL_SOCKET, SO_REUSEADDR, 1, "SO_REUSEADDR");
    if (opts & CK_SOCKOPT_REUSEPORT)
        set_on(s, SOL_SOCKET, SO_REUSEPORT, 1, "SO_REUSEPORT");
    if (family == AF_INET6 && type != SOCK_RAW)  /* a raw socket's cannot be set (EINVAL): its default */
        set_on(s, IPPROTO_IPV6, IPV6_V6ONLY, !!(opts & CK_SOCKOPT_V6ONLY), "IPV6_V6ONLY");
    if (opts & CK_SOCKOPT_FREEBIND)
        set_on(s, SOL_IP, IP_FREEBIND, 1, "IP_FREEBIND");
    if (opts & CK_SOCKOPT_TRANSPARENT)
        set_on(s, SOL_IP, IP_TRANSPARENT, 1, "IP_TRANSPARENT (needs CAP_NET_ADMIN)");
}

/* "a.b.c.d:port" or "[hex:...]:port", for the one-line error */
static const char *shown(const char *sa, size_t len, char *out, size_t cap)
{
    struct ck_buf b;
    ck_buf_init(&b, out, cap);
    const uint8_t *u = (const uint8_t *)sa;
    uint16_t family = (uint16_t)(u[0] | u[1] << 8);
    uint16_t port = (uint16_t)(u[2] << 8 | u[3]);
    if (family == AF_INET && len >= 8) {
        for (int k = 0; k < 4; k++) {
            if (k)
                ck_buf_char(&b, '.');
            ck_buf_u64(&b, u[4 + k]);
        }
    } else if (len >= 24) {
        ck_buf_char(&b, '[');
        for (int k = 0; k < 16; k += 2) {
            if (k)
                ck_buf_char(&b, ':');
            ck_buf_hex(&b, (uint64_t)(u[8 + k] << 8 | u[9 + k]));
        }
        ck_buf_char(&b, ']');
    }
    ck_buf_char(&b, ':');
    ck_buf_u64(&b, port);
    return ck_buf_cstr(&b);
}

void op_dgrambind(const struct line *l)
{
    char addr[128], text[96];
    size_t n = unhex(l, 2, addr, sizeof(addr));
    long rc = ck_bind(slot_fd(l, 1), addr, (unsigned)n);
    if (rc == -EADDRNOTAVAIL)
        rst_fail("cannot bind a datagram socket to its old address: that address does not exist on this node",
                 shown(addr, n, text, sizeof(text)), rc);
    if (rc < 0)
        rst_fail("cannot bind a datagram socket to its old address (is the port taken on this node?)",
                 shown(addr, n, text, sizeof(text)), rc);
}

void op_dgramconnect(const struct line *l)
{
    char addr[128], text[96];
    size_t n = unhex(l, 2, addr, sizeof(addr));
    long rc;
    do
        rc = ck_connect(slot_fd(l, 1), addr, (unsigned)n);
    while (rc == -EINTR);
    if (rc < 0)
        rst_fail("cannot connect a datagram socket to its old peer again", shown(addr, n, text, sizeof(text)), rc);
}

void op_mcast(const struct line *l)
{
    int fd = slot_fd(l, 1), family = (int)num(l, 2);
    struct ifreq ifr;
    ck_memset(&ifr, 0, sizeof(ifr));
    char group[32];
    unhex(l, 3, ifr.ifr_name, sizeof(ifr.ifr_name));
    size_t n = unhex(l, 4, group, sizeof(group));
    long rc = ck_ioctl(fd, SIOCGIFINDEX, &ifr);
    if (rc < 0)
        rst_fail("cannot join a multicast group again: its interface does not exist on this node", ifr.ifr_name, rc);
    struct group_req req;
    ck_memset(&req, 0, sizeof(req));
    req.gr_interface = (uint32_t)ifr.ifr_ifindex;
    if (family == AF_INET && n == 4) {
        struct sockaddr_in *g = (void *)&req.gr_group;
        g->sin_family = AF_INET;
        ck_memcpy(&g->sin_addr, group, 4);
    } else if (family == AF_INET6 && n == 16) {
        struct sockaddr_in6 *g = (void *)&req.gr_group;
        g->sin6_family = AF_INET6;
        ck_memcpy(&g->sin6_addr, group, 16);
    } else {
        rst_fail("corrupt restore plan: bad multicast group", l->tok[4], 0);
    }
    rc = ck_setsockopt(fd, family == AF_INET ? SOL_IP : SOL_IPV6, MCAST_JOIN_GROUP, &req, sizeof(req));
    if (rc < 0)
        rst_fail("cannot join a multicast group again", ifr.ifr_name, rc);
}
