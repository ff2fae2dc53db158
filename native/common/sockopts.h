/*
 * The socket options ckptd saves and sets again: one table for the shim
 * (native/shim/dump_sockopts.c reads each with getsockopt) and the restore
 * plan's builder (native/restorer/plan.c sets each back with setsockopt,
 * and sets nothing the table does not name).  Options are set in table
 * order: IP_TOS changes the priority, so SO_PRIORITY comes after it.
 *
 * Not here: what the socket's construction needs (SO_REUSEADDR,
 * SO_REUSEPORT, IPV6_V6ONLY, TCP_NODELAY, SO_KEEPALIVE: ck_fd.sock_opts)
 * and the buffer sizes (ck_fd.rcvbuf/sndbuf, widened for queued bytes).
 */
#ifndef CKPTD_SOCKOPTS_H
#define CKPTD_SOCKOPTS_H

/* the includer brings <sys/socket.h>, <netinet/in.h> and <netinet/tcp.h> */

#ifndef ICMP_FILTER
#define ICMP_FILTER 1   /* <linux/icmp.h>, which clashes with <net/if.h> */
#endif

/* which sockets an option is saved for */
#define CK_SO_UNIX 0x1
#define CK_SO_TCP4 0x2
#define CK_SO_TCP6 0x4
#define CK_SO_TCP (CK_SO_TCP4 | CK_SO_TCP6)
#define CK_SO_DGRAM4 0x8   /* UDP, ping and raw IPv4 sockets (native/shim/dump_dgram.c) */
#define CK_SO_DGRAM6 0x10  /* UDP, ping and raw IPv6 sockets */
#define CK_SO_RAW 0x20     /* raw sockets only, with CK_SO_DGRAM4 or CK_SO_DGRAM6 */
#define CK_SO_DGRAM (CK_SO_DGRAM4 | CK_SO_DGRAM6)
#define CK_SO_INET4 (CK_SO_TCP4 | CK_SO_DGRAM4)
#define CK_SO_INET6 (CK_SO_TCP6 | CK_SO_DGRAM6)
#define CK_SO_ALL (CK_SO_UNIX | CK_SO_TCP | CK_SO_DGRAM)

struct ck_sockopt_def {
    int level;
    int name;
    unsigned size;   /* what getsockopt writes (at most ck_sockopt.val) */
    unsigned kinds;  /* CK_SO_* */
    char what[20];   /* an array, not a pointer: the restorer has no relocations */
};

static const struct ck_sockopt_def ck_sockopt_table[] = {
    {SOL_SOCKET, SO_LINGER, 8 /* struct linger */, CK_SO_ALL, "SO_LINGER"},
    {SOL_IP, IP_TOS, 4, CK_SO_INET4 | CK_SO_DGRAM6, "IP_TOS"},
    {SOL_IPV6, IPV6_TCLASS, 4, CK_SO_INET6, "IPV6_TCLASS"},
    {SOL_SOCKET, SO_PRIORITY, 4, CK_SO_ALL, "SO_PRIORITY"},
    {SOL_SOCKET, SO_RCVLOWAT, 4, CK_SO_ALL, "SO_RCVLOWAT"},
    {SOL_SOCKET, SO_RCVTIMEO, 16 /* struct timeval */, CK_SO_ALL, "SO_RCVTIMEO"},
    {SOL_SOCKET, SO_SNDTIMEO, 16, CK_SO_ALL, "SO_SNDTIMEO"},
    {SOL_TCP, TCP_KEEPIDLE, 4, CK_SO_TCP, "TCP_KEEPIDLE"},
    {SOL_TCP, TCP_KEEPINTVL, 4, CK_SO_TCP, "TCP_KEEPINTVL"},
    {SOL_TCP, TCP_KEEPCNT, 4, CK_SO_TCP, "TCP_KEEPCNT"},
    {SOL_TCP, TCP_USER_TIMEOUT, 4, CK_SO_TCP, "TCP_USER_TIMEOUT"},
    {SOL_TCP, TCP_CONGESTION, 16 /* TCP_CA_NAME_MAX */, CK_SO_TCP, "TCP_CONGESTION"},
    /* datagram and raw sockets (an IPv6 one answers for its IPv4-mapped traffic too) */
    {SOL_SOCKET, SO_BROADCAST, 4, CK_SO_DGRAM, "SO_BROADCAST"},
    {SOL_IP, IP_TTL, 4, CK_SO_DGRAM4, "IP_TTL"},
    {SOL_IP, IP_MULTICAST_TTL, 4, CK_SO_DGRAM, "IP_MULTICAST_TTL"},
    {SOL_IP, IP_MULTICAST_LOOP, 4, CK_SO_DGRAM, "IP_MULTICAST_LOOP"},
    {SOL_IP, IP_MULTICAST_IF, 4 /* struct in_addr */, CK_SO_DGRAM4, "IP_MULTICAST_IF"},
    {SOL_IP, IP_RECVERR, 4, CK_SO_DGRAM4, "IP_RECVERR"},
    {SOL_IP, IP_PKTINFO, 4, CK_SO_DGRAM4, "IP_PKTINFO"},
    {SOL_IP, IP_MTU_DISCOVER, 4, CK_SO_DGRAM4, "IP_MTU_DISCOVER"},
    {SOL_IP, IP_HDRINCL, 4, CK_SO_RAW, "IP_HDRINCL"},
    {SOL_RAW, ICMP_FILTER, 4, CK_SO_RAW, "ICMP_FILTER"},
    {SOL_IPV6, IPV6_UNICAST_HOPS, 4, CK_SO_DGRAM6, "IPV6_UNICAST_HOPS"},
    {SOL_IPV6, IPV6_MULTICAST_HOPS, 4, CK_SO_DGRAM6, "IPV6_MULTICAST_HOPS"},
    {SOL_IPV6, IPV6_MULTICAST_LOOP, 4, CK_SO_DGRAM6, "IPV6_MULTICAST_LOOP"},
    {SOL_IPV6, IPV6_MULTICAST_IF, 4, CK_SO_DGRAM6, "IPV6_MULTICAST_IF"},
    {SOL_IPV6, IPV6_RECVERR, 4, CK_SO_DGRAM6, "IPV6_RECVERR"},
    {SOL_IPV6, IPV6_RECVPKTINFO, 4, CK_SO_DGRAM6, "IPV6_RECVPKTINFO"},
    {SOL_IPV6, IPV6_MTU_DISCOVER, 4, CK_SO_DGRAM6, "IPV6_MTU_DISCOVER"},
    /* last: the multicast interfaces above must agree with the device it binds to */
    {SOL_SOCKET, SO_BINDTODEVICE, 16 /* IFNAMSIZ */, CK_SO_DGRAM, "SO_BINDTODEVICE"},
};

#define CK_NSOCKOPTS (sizeof(ck_sockopt_table) / sizeof(ck_sockopt_table[0]))

static inline const struct ck_sockopt_def *ck_sockopt_find(int level, int name)
{
    for (unsigned i = 0; i < CK_NSOCKOPTS; i++)
        if (ck_sockopt_table[i].level == level && ck_sockopt_table[i].name == name)
            return &ck_sockopt_table[i];
    return 0;
}

#endif
