/*
 * UDP, ICMP "ping" and raw inet sockets (CK_FD_UDP, CK_FD_RAW): what the
 * restore plan needs to build each one again.
 *
 * Saved per socket: family, type and protocol (a raw socket's IPPROTO_*,
 * IPPROTO_ICMP(V6) for a ping socket), the local address when it has one
 * (bound, or given a port by connect() or a first send) and the peer when
 * connected, what the bind needs set first (SO_REUSEADDR, SO_REUSEPORT,
 * IPV6_V6ONLY, IP_FREEBIND, IP_TRANSPARENT: ck_fd.sock_opts), the buffer
 * sizes, and the options of native/common/sockopts.h for these kinds
 * (TTLs, TOS, multicast TTL/loop/interface, SO_BROADCAST, IP_HDRINCL...).
 *
 * Refused:
 *   datagrams received and not yet read (or an error queue, or a datagram
 *     still on its way out): their source addresses cannot be put back
 *     exactly, so the round is refused as a passing state and retried
 *     until the program has read them (SO_MEMINFO tells, consuming nothing);
 *   a multicast membership with a source filter (IP_ADD_SOURCE_MEMBERSHIP,
 *     MCAST_MSFILTER...).
 *
 * Multicast memberships of any source are saved: found exactly by asking
 * the socket about every group the node's interfaces joined (/proc/net/igmp,
 * igmp6; MCAST_MSFILTER answers only for the socket's own memberships),
 * each with its interface's name, by which it is joined again (an index
 * does not survive a move to another node).
 *
 * Which process builds each socket is decided from every process's image
 * by the agent (ckptd/image/plan/dgram.py); the restorer builds them in
 * native/restorer/plan_dgram.c, where a socket bound to an address the
 * restoring node does not have fails the restart with that address.
 */
#include "shim.h"
#include "../common/sys.h"
#include "../common/util.h"
#include "../common/maps.h"

#include <errno.h>
#include <linux/sock_diag.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sys/socket.h>

#include "../common/sockopts.h"

static int opt_int(int fd, int level, int name)
{
    int v = 0;
    unsigned len = sizeof(v);
    return ck_getsockopt(fd, level, name, &v, &len) == 0 ? v : 0;
}

/* an address into BLOB; UINT64_MAX if it cannot be read (-ENOTCONN: *rc) */
static uint64_t save_addr(struct ck_image *im, int fd, int peer, uint32_t *len_out, long *rc)
{
    struct sockaddr_in6 sa;
    unsigned len = sizeof(sa);
    ck_memset(&sa, 0, sizeof(sa));
    *rc = ck_sc3(peer ? SYS_getpeername : SYS_getsockname, fd, &sa, &len);
    if (*rc < 0 || len > sizeof(sa))
        return UINT64_MAX;
    *len_out = len;
    return ck_table_bytes_append(&im->blob, &sa, len);
}

static char text[65536];  /* /proc/net text: one socket table, or the groups */

static int hexval(char c)
{
    return c >= '0' && c <= '9' ? c - '0' : c >= 'a' && c <= 'f' ? c - 'a' + 10 : c >= 'A' && c <= 'F' ? c - 'A' + 10 : -1;
}

/* hex digits into bytes, each 4-byte word given as %08X of its value in
 * memory order (what /proc/net prints for addresses): its bytes, last first */
static int parse_words(const char *h, uint8_t *out, int nwords)
{
    for (int k = 0; k < 8 * nwords; k++)
        if (hexval(h[k]) < 0)
            return -1;
    for (int w = 0; w < nwords; w++)
        for (int k = 0; k < 4; k++)
            out[4 * w + 3 - k] = (uint8_t)(hexval(h[8 * w + 2 * k]) << 4 | hexval(h[8 * w + 2 * k + 1]));
    return 0;
}

/* whether the socket is a member of group (raw bytes) on interface
 * ifindex: 1 for any source, 2 with a source filter, 0 not a member */
static int member(int fd, int family, uint32_t ifindex, const void *group)
{
    struct group_filter gf;
    ck_memset(&gf, 0, sizeof(gf));
    gf.gf_interface = ifindex;
    gf.gf_fmode = MCAST_EXCLUDE;
    if (family == AF_INET) {
        struct sockaddr_in *g = (void *)&gf.gf_group;
        g->sin_family = AF_INET;
        ck_memcpy(&g->sin_addr, group, 4);
    } else {
        struct sockaddr_in6 *g = (void *)&gf.gf_group;
        g->sin6_family = AF_INET6;
        ck_memcpy(&g->sin6_addr, group, 16);
    }
    unsigned len = sizeof(gf);
    if (ck_getsockopt(fd, family == AF_INET ? SOL_IP : SOL_IPV6, MCAST_MSFILTER, &gf, &len) < 0)
        return 0;
    return gf.gf_fmode == MCAST_EXCLUDE && gf.gf_numsrc == 0 ? 1 : 2;
}

static int refuse_filter(struct ck_image *im, int fd, const char *shown, const char *ifname, const char *target)
{
    static char why[200];
    struct ck_buf b;
    ck_buf_init(&b, why, sizeof(why));
    ck_buf_str(&b, "datagram socket that joined the multicast group ");
    ck_buf_str(&b, shown);
    ck_buf_str(&b, " on ");
    ck_buf_str(&b, ifname);
    ck_buf_str(&b, " with a source filter: ckptd restores only memberships of any source");
    return ck_fail_fd(im, fd, why, target);
}

/* one membership into BLOB (the records follow each other: nothing else
 * is appended while the groups are read) */
static int add_group(struct ck_image *im, struct ck_fd *f, int family, uint32_t ifindex, const uint8_t *g,
                     const char *ifname, size_t namelen)
{
    struct ck_mcast_group m;
    ck_memset(&m, 0, sizeof(m));
    m.family = (uint32_t)family;
    m.ifindex = ifindex;
    ck_memcpy(m.group, g, family == AF_INET ? 4 : 16);
    ck_memcpy(m.ifname, ifname, namelen < sizeof(m.ifname) ? namelen : sizeof(m.ifname) - 1);
    if (ck_table_bytes_append(&im->blob, &m, sizeof(m)) == UINT64_MAX)
        return ck_image_fail(im, "too much socket data", 0, 0);
    f->nmcast++;
    return 0;
}

/*
 * The groups the socket joined, found by asking it about every group the
 * node's interfaces joined.  /proc/net/igmp: a line per interface
 * ("1\tlo        :     1      V3"), then one per group it joined
 * ("\t\t\t\t010000E0     1 0:00000000\t\t0", the address as /proc/net
 * prints addresses).  /proc/net/igmp6: one line per group,
 * "1    lo              ff020000000000000000000000000001 ...".
 */
static int save_groups(struct ck_image *im, struct ck_fd *f, int family, const char *target)
{
    int fd = f->fd;
    f->mcast_off = im->blob.count;
    f->nmcast = 0;
    long n = ck_read_file("/proc/net/igmp", text, sizeof(text) - 1);
    uint32_t ifindex = 0;
    char ifname[16];
    size_t namelen = 0;
    for (long i = 0; n > 0 && i < n;) {
        const char *line = text + i;
        long end = i;
        while (end < n && text[end] != '\n')
            end++;
        text[end] = 0;
        i = end + 1;
        if (line[0] >= '0' && line[0] <= '9') {
            const char *p;
            ifindex = (uint32_t)ck_parse_u64(line, 10, &p);
            while (*p == '\t' || *p == ' ')
                p++;
            for (namelen = 0; p[namelen] && p[namelen] != ' ' && p[namelen] != ':' && namelen < 15; namelen++)
                ifname[namelen] = p[namelen];
            ifname[namelen] = 0;
            continue;
        }
        if (line[0] != '\t')
            continue;
        while (*line == '\t')
            line++;
        uint8_t g[4];
        if (parse_words(line, g, 1) < 0)
            continue;
        int m = member(fd, AF_INET, ifindex, g);
        if (m == 2) {
            char shown[16];
            struct ck_buf b;
            ck_buf_init(&b, shown, sizeof(shown));
            for (int k = 0; k < 4; k++) {
                if (k)
                    ck_buf_char(&b, '.');
                ck_buf_u64(&b, g[k]);
            }
            return refuse_filter(im, fd, ck_buf_cstr(&b), ifname, target);
        }
        if (m && add_group(im, f, AF_INET, ifindex, g, ifname, namelen) < 0)
            return -1;
    }
    if (family != AF_INET6)
        return 0;
    n = ck_read_file("/proc/net/igmp6", text, sizeof(text) - 1);
    for (long i = 0; n > 0 && i < n;) {
        char *line = text + i;
        long end = i;
        while (end < n && text[end] != '\n')
            end++;
        text[end] = 0;
        i = end + 1;
        const char *p;
        ifindex = (uint32_t)ck_parse_u64(line, 10, &p);
        while (*p == ' ')
            p++;
        for (namelen = 0; p[namelen] && p[namelen] != ' ' && namelen < 15; namelen++)
            ifname[namelen] = p[namelen];
        ifname[namelen] = 0;
        p += namelen;
        while (*p == ' ')
            p++;
        uint8_t g[16];
        int ok = 1;
        for (int k = 0; k < 32; k++)
            ok &= hexval(p[k]) >= 0;
        if (!ok)
            continue;
        for (int k = 0; k < 16; k++)  /* printed byte by byte (%pi6) */
            g[k] = (uint8_t)(hexval(p[2 * k]) << 4 | hexval(p[2 * k + 1]));
        int m = member(fd, AF_INET6, ifindex, g);
        if (m == 2) {
            char shown[33];
            ck_memcpy(shown, p, 32);
            shown[32] = 0;
            return refuse_filter(im, fd, shown, ifname, target);
        }
        if (m && add_group(im, f, AF_INET6, ifindex, g, ifname, namelen) < 0)
            return -1;
    }
    return 0;
}

/*
 * The peer of a connected raw or ping socket: getpeername() says ENOTCONN
 * for them (they have no remote port), but /proc/net/raw, raw6, icmp and
 * icmp6 list each socket by inode with its remote address and state
 * ("  1: 0100007F:00FD 0100007F:0000 01 ... UID TIMEOUT INODE ...").
 * Returns 1 and fills *sa when connected, 0 when not, -1 if not listed.
 */
static int proc_peer(int family, int raw, uint64_t ino, struct sockaddr_in6 *sa, unsigned *len)
{
    const char *path = raw ? (family == AF_INET ? "/proc/net/raw" : "/proc/net/raw6")
                           : (family == AF_INET ? "/proc/net/icmp" : "/proc/net/icmp6");
    long n = ck_read_file(path, text, sizeof(text) - 1);
    int words = family == AF_INET ? 1 : 4;
    for (long i = 0; n > 0 && i < n;) {
        char *line = text + i, *field[10];
        long end = i;
        while (end < n && text[end] != '\n')
            end++;
        text[end] = 0;
        i = end + 1;
        int nf = 0;
        for (char *p = line; *p && nf < 10;) {
            while (*p == ' ')
                p++;
            if (!*p)
                break;
            field[nf++] = p;
            while (*p && *p != ' ')
                p++;
        }
        if (nf < 10 || ck_parse_u64(field[9], 10, 0) != ino)
            continue;
        if (ck_parse_u64(field[3], 16, 0) != 1)  /* TCP_ESTABLISHED: connected */
            return 0;
        ck_memset(sa, 0, sizeof(*sa));
        uint8_t addr[16];
        if (parse_words(field[2], addr, words) < 0 || field[2][8 * words] != ':')
            return -1;
        uint16_t port = (uint16_t)ck_parse_u64(field[2] + 8 * words + 1, 16, 0);
        sa->sin6_family = (uint16_t)family;
        sa->sin6_port = (uint16_t)(port >> 8 | port << 8);
        if (family == AF_INET) {
            ck_memcpy(&((struct sockaddr_in *)sa)->sin_addr, addr, 4);
            *len = sizeof(struct sockaddr_in);
        } else {
            ck_memcpy(&sa->sin6_addr, addr, 16);
            *len = sizeof(struct sockaddr_in6);
        }
        return 1;
    }
    return -1;
}

int ck_dump_dgram(struct ck_image *im, struct ck_fd *f, int family, int type, const char *target)
{
    int fd = f->fd, raw = type == SOCK_RAW;
    int proto = opt_int(fd, SOL_SOCKET, SO_PROTOCOL);
    const char *what = raw ? "raw socket" : proto == IPPROTO_UDP ? "UDP socket" : "ICMP ping socket";
    if (!raw && proto != IPPROTO_UDP && proto != IPPROTO_ICMP && proto != IPPROTO_ICMPV6)
        return ck_fail_fd(im, fd, "datagram inet socket of a protocol other than UDP and ICMP (UDP-Lite?)", target);
    f->type = raw ? CK_FD_RAW : CK_FD_UDP;
    f->sock_type = (uint32_t)type;
    f->sock_family = (uint32_t)family;
    f->sock_protocol = (uint32_t)proto;
    f->sock_opts = (opt_int(fd, SOL_SOCKET, SO_REUSEADDR) ? CK_SOCKOPT_REUSEADDR : 0) |
                   (opt_int(fd, SOL_SOCKET, SO_REUSEPORT) ? CK_SOCKOPT_REUSEPORT : 0) |
                   (family == AF_INET6 && opt_int(fd, SOL_IPV6, IPV6_V6ONLY) ? CK_SOCKOPT_V6ONLY : 0) |
                   (opt_int(fd, SOL_IP, IP_FREEBIND) ? CK_SOCKOPT_FREEBIND : 0) |
                   (opt_int(fd, SOL_IP, IP_TRANSPARENT) ? CK_SOCKOPT_TRANSPARENT : 0);
    if (ck_dump_sockopts(im, f, fd, (family == AF_INET6 ? CK_SO_DGRAM6 : CK_SO_DGRAM4) | (raw ? CK_SO_RAW : 0)) < 0)
        return -1;
    f->rcvbuf = (uint32_t)opt_int(fd, SOL_SOCKET, SO_RCVBUF);
    f->sndbuf = (uint32_t)opt_int(fd, SOL_SOCKET, SO_SNDBUF);
    long rc;
    f->name_off = save_addr(im, fd, 0, &f->name_len, &rc);
    if (f->name_off == UINT64_MAX)
        return ck_image_fail(im, "cannot read a datagram socket's address", target, rc);
    f->sock_state = CK_SOCK_UNCONNECTED;
    if (proto == IPPROTO_UDP) {
        f->peer_off = save_addr(im, fd, 1, &f->peer_len, &rc);
        if (f->peer_off == UINT64_MAX && rc != -ENOTCONN)
            return ck_image_fail(im, "cannot read a datagram socket's peer address", target, rc);
    } else {
        struct sockaddr_in6 sa;
        unsigned salen = 0;
        int connected = proc_peer(family, raw, f->ino, &sa, &salen);
        if (connected < 0)
            return ck_image_fail(im, raw ? "cannot find a raw socket in /proc/net/raw"
                                         : "cannot find a ping socket in /proc/net/icmp",
                                 target, 0);
        f->peer_off = connected ? ck_table_bytes_append(&im->blob, &sa, salen) : UINT64_MAX;
        f->peer_len = salen;
        if (connected && f->peer_off == UINT64_MAX)
            return ck_image_fail(im, "too much socket data", 0, 0);
    }
    if (f->peer_off == UINT64_MAX) {
        f->peer_off = 0;
        f->peer_len = 0;
    } else {
        f->sock_state = CK_SOCK_CONNECTED;
    }
    if (save_groups(im, f, family, target) < 0)
        return -1;

    /* bytes charged to the socket: a datagram (or an error) queued to be
     * read, or one still on its way out; SO_MEMINFO reads, consumes nothing */
    uint32_t mem[SK_MEMINFO_VARS];
    unsigned len = sizeof(mem);
    ck_memset(mem, 0, sizeof(mem));
    rc = ck_getsockopt(fd, SOL_SOCKET, SO_MEMINFO, mem, &len);
    if (rc < 0)
        return ck_image_fail(im, "cannot read a datagram socket's queues (SO_MEMINFO)", target, rc);
    static char why[200];
    struct ck_buf b;
    ck_buf_init(&b, why, sizeof(why));
    ck_buf_str(&b, what);
    if (mem[SK_MEMINFO_RMEM_ALLOC]) {
        ck_buf_str(&b, " with datagrams received and not yet read (ckptd does not save them: the "
                       "checkpoint waits until the program has read them)");
        return ck_image_passing(im, ck_fail_fd(im, fd, why, target));
    }
    if (mem[SK_MEMINFO_WMEM_ALLOC]) {
        ck_buf_str(&b, " with a datagram not yet sent (UDP_CORK or MSG_MORE: ckptd does not save it)");
        return ck_image_passing(im, ck_fail_fd(im, fd, why, target));
    }
    return 0;
}
