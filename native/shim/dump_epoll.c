/*
 * epoll sets: each registration with its events, data and flags.
 *
 * /proc/self/fdinfo/EPFD lists them ("tfd: N events: X data: Y ...").
 * epoll knows a registration by (file, descriptor number), and the number
 * may have been closed since, or given to another file (which can be
 * registered too: two lines with one tfd).  kcmp(KCMP_EPOLL_TFD) finds a
 * descriptor that holds each registration's file now (its "holder"); the
 * restorer puts the file at tfd for the EPOLL_CTL_ADD (native/restorer/
 * epoll.c).  A registration whose file no descriptor here holds is refused.
 *
 * An epoll set is one per process at restore: one the parent process
 * holds too (inherited through fork) is refused.  Only the parent is
 * checked (pids of other processes in /proc may be the host's): a child
 * that shares its parent's set finds it, and any pair that fork made is
 * a parent and a child, unless the one between them closed it.
 *
 * A disabled EPOLLONESHOT registration (it fired and was not re-armed) has
 * only flag bits left; the restorer gets there the way the kernel does, by
 * letting it fire once, so its file must be ready for something.
 */
#include "shim.h"
#include "../common/sys.h"
#include "../common/util.h"

#include <errno.h>
#include <linux/kcmp.h>
#include <poll.h>
#include <sys/epoll.h>
#include <sys/resource.h>

/* the bits epoll keeps once a oneshot fired (the kernel's EP_PRIVATE_BITS) */
#define PRIVATE_BITS (EPOLLWAKEUP | EPOLLONESHOT | EPOLLET | EPOLLEXCLUSIVE)

int ck_dump_epoll(struct ck_image *im, struct ck_fd *f, const char *info)
{
    f->first_epoll = (uint32_t)im->epoll.count;
    /* lines: "tfd:        5 events:       19 data:                5  pos:..." */
    for (const char *p = info; *p;) {
        if (ck_startswith(p, "tfd:")) {
            const char *q = ck_skip_spaces(p + 4);
            struct ck_epoll_target *t = ck_table_push(&im->epoll);
            if (!t)
                return ck_image_fail(im, "too many epoll registrations", 0, 0);
            t->tfd = (int32_t)ck_parse_u64(q, 10, &q);
            t->holder = -1;
            q = ck_skip_spaces(q);
            if (ck_startswith(q, "events:"))
                t->events = (uint32_t)ck_parse_u64(ck_skip_spaces(q + 7), 16, &q);
            q = ck_skip_spaces(q);
            if (ck_startswith(q, "data:"))
                t->data = ck_parse_u64(ck_skip_spaces(q + 5), 16, &q);
            f->nepoll++;
        }
        while (*p && *p != '\n')
            p++;
        if (*p)
            p++;
    }
    return 0;
}

static int refuse(struct ck_image *im, const struct ck_fd *ep, const struct ck_epoll_target *t, const char *why)
{
    char what[200];
    struct ck_buf b;
    ck_buf_init(&b, what, sizeof(what));
    ck_buf_str(&b, "epoll descriptor ");
    ck_buf_u64(&b, (uint64_t)ep->fd);
    ck_buf_str(&b, " has a registration of descriptor ");
    ck_buf_u64(&b, (uint64_t)t->tfd);
    ck_buf_str(&b, why);
    return ck_image_fail(im, what, 0, 0);
}

/* the parent's descriptor that is the same open epoll as fd, or -1 */
static int in_parent(int pid, int fd)
{
    int ppid = (int)ck_getppid();
    struct rlimit lim;
    if (ppid <= 1 || ck_prlimit(RLIMIT_NOFILE, 0, &lim) < 0)
        return -1;
    uint64_t most = lim.rlim_cur < 65536 ? lim.rlim_cur : 65536;
    for (uint64_t ofd = 0; ofd < most; ofd++) {
        long rc = ck_kcmp(pid, ppid, KCMP_FILE, fd, (long)ofd);
        if (rc == 0)
            return (int)ofd;
        if (rc < 0 && rc != -EBADF)
            return -1;  /* not allowed to look (another user): nothing to say */
    }
    return -1;
}

/* once every descriptor is listed: a holder for each registration */
int ck_dump_epoll_holders(struct ck_image *im)
{
    int pid = (int)ck_getpid();
    for (size_t i = 0; i < im->fds.count; i++) {
        struct ck_fd *ep = ck_table_at(&im->fds, i);
        if (ep->type != CK_FD_EPOLL)
            continue;
        int shared = in_parent(pid, ep->fd);
        if (shared >= 0) {
            char what[200];
            struct ck_buf b;
            ck_buf_init(&b, what, sizeof(what));
            ck_buf_str(&b, "epoll descriptor ");
            ck_buf_u64(&b, (uint64_t)ep->fd);
            ck_buf_str(&b, " is shared with the parent process (its descriptor ");
            ck_buf_u64(&b, (uint64_t)shared);
            ck_buf_str(&b, ", inherited through fork): ckptd cannot restore an epoll set shared by two processes");
            return ck_image_fail(im, what, 0, 0);
        }
        for (uint32_t k = 0; k < ep->nepoll; k++) {
            struct ck_epoll_target *t = ck_table_at(&im->epoll, ep->first_epoll + k);
            /* the kernel names a registration by tfd and its rank among those with that tfd */
            struct kcmp_epoll_slot slot = {.efd = (uint32_t)ep->fd, .tfd = (uint32_t)t->tfd, .toff = 0};
            for (uint32_t j = 0; j < k; j++)
                slot.toff += ((struct ck_epoll_target *)ck_table_at(&im->epoll, ep->first_epoll + j))->tfd == t->tfd;
            if (ck_kcmp(pid, pid, KCMP_EPOLL_TFD, t->tfd, (long)&slot) == 0)
                t->holder = t->tfd;
            for (size_t j = 0; j < im->fds.count && t->holder < 0; j++) {
                struct ck_fd *o = ck_table_at(&im->fds, j);
                int fd = o->fd;
                if (o->flags & CK_FDF_IN_FLIGHT)
                    continue;  /* a copy the dump made, gone at RESUME */
                if (ck_kcmp(pid, pid, KCMP_EPOLL_TFD, fd, (long)&slot) == 0)
                    t->holder = fd;
            }
            if (t->holder < 0)
                return refuse(im, ep, t, " whose file this process no longer holds (closed, open elsewhere): ckptd "
                                         "cannot restore it");
            if ((t->events & EPOLLONESHOT) && !(t->events & ~(uint32_t)PRIVATE_BITS)) {
                struct pollfd pf = {.fd = t->holder, .events = POLLIN | POLLOUT | POLLPRI | POLLRDHUP};
                struct timespec zero = {0, 0};
                if (ck_sc5(SYS_ppoll, &pf, 1, &zero, 0, 8) != 1) {
                    return ck_image_passing(im, refuse(im, ep, t, " that EPOLLONESHOT disabled while its file is "
                                                                  "not ready: ckptd can only restore it while the "
                                                                  "file is ready"));
                }
            }
        }
    }
    return 0;
}
