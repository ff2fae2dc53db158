/*
 * epoll registrations, once every descriptor is back (native/shim/
 * dump_epoll.c says what was saved).
 *
 * epoll knows a registration by (file, descriptor number).  When the
 * number was closed or reused after the registration, the registered file
 * is put at that number for the EPOLL_CTL_ADD (from the descriptor that
 * holds it now), then the number gets back what it holds.
 *
 * A disabled EPOLLONESHOT registration is added first, armed for every
 * event, and made to fire once with epoll_wait: the kernel then keeps its
 * flag bits only, as it did.  The registrations added after it cannot fire
 * meanwhile.
 */
#include "restorer.h"

#include <errno.h>
#include <sys/epoll.h>

#define PRIVATE_BITS (EPOLLWAKEUP | EPOLLONESHOT | EPOLLET | EPOLLEXCLUSIVE)
#define ALL_EVENTS (EPOLLIN | EPOLLOUT | EPOLLPRI | EPOLLRDNORM | EPOLLRDBAND | EPOLLWRNORM | EPOLLWRBAND | \
                    EPOLLMSG | EPOLLRDHUP | EPOLLERR | EPOLLHUP)

static int disabled(const struct ck_epoll_target *t)
{
    return (t->events & EPOLLONESHOT) && !(t->events & ~(uint32_t)PRIVATE_BITS);
}

static void add(int ep, const struct ck_epoll_target *t, uint32_t events)
{
    int moved = t->holder != t->tfd;
    long was = -EBADF, fdflags = 0;
    if (moved) {
        was = ck_fcntl(t->tfd, F_DUPFD_CLOEXEC, rst.maxfd + 16);  /* what tfd holds now, if anything */
        fdflags = ck_fcntl(t->tfd, F_GETFD, 0);
        long rc = ck_dup3(t->holder, t->tfd, O_CLOEXEC);
        if (rc < 0)
            rst_fail("cannot restore an epoll registration (its file at its old number)", 0, rc);
    }
    struct epoll_event ev;
    ev.events = events;
    ev.data.u64 = t->data;
    long rc = ck_epoll_ctl(ep, EPOLL_CTL_ADD, t->tfd, &ev);
    if (rc < 0)
        rst_fail("cannot restore an epoll registration", 0, rc);
    if (!moved)
        return;
    if (was >= 0) {
        rc = ck_dup3((int)was, t->tfd, (fdflags > 0 && (fdflags & FD_CLOEXEC)) ? O_CLOEXEC : 0);
        if (rc < 0)
            rst_fail("cannot put a descriptor back in place", 0, rc);
        ck_close((int)was);
    } else {
        ck_close(t->tfd);
    }
}

static void restore_one(const struct rst_image *im, const struct ck_fd *f)
{
    const struct ck_epoll_target *t = &im->epoll[f->first_epoll];
    uint32_t ndisabled = 0;
    for (uint32_t k = 0; k < f->nepoll; k++)
        if (disabled(&t[k])) {
            add(f->fd, &t[k], t[k].events | ALL_EVENTS);
            ndisabled++;
        }
    if (ndisabled) {
        struct epoll_event evs[64];
        uint32_t fired = 0;
        for (;;) {
            long n = ck_sc4(SYS_epoll_wait, f->fd, evs, 64, 0);
            if (n == -EINTR)
                continue;
            if (n < 0)
                rst_fail("cannot restore a disabled EPOLLONESHOT registration", 0, n);
            fired += (uint32_t)n;
            if (n < 64)
                break;
        }
        if (fired != ndisabled)
            rst_fail("cannot restore a disabled EPOLLONESHOT registration (its file is not ready)", 0, 0);
    }
    for (uint32_t k = 0; k < f->nepoll; k++)
        if (!disabled(&t[k]))
            add(f->fd, &t[k], t[k].events);
}

void rst_restore_epolls(const struct rst_image *im)
{
    for (uint32_t i = 0; i < im->nfds; i++)
        if (im->fds[i].type == CK_FD_EPOLL)
            restore_one(im, &im->fds[i]);
}
