/*
 * Interposed libc entry points.
 *
 *  - The open() family: remember files opened for writing (files.c).
 *  - sigaction/signal/sigprocmask/pthread_sigmask: the quiesce signal
 *    belongs to ckptd.  Programs may neither replace its handler nor block
 *    it, or a checkpoint could never park their threads.
 *  - syscall(): io_uring_setup answers ENOSYS (see below); futex waits
 *    with a timeout are resumed after a checkpoint (eintr.c).
 *  - sigaction also puts a counter in front of the program's handlers, and
 *    the calls a checkpoint interrupts are resumed: eintr.c.
 *  - sigaction(SIGTERM): a SIG_DFL is held for the agent: sigterm.c.
 *  - madvise and posix_madvise of advice that changes VmFlags, and the
 *    mlock family: counted, so that a memory map read before them is not
 *    used for the dump (dump_mem.c).
 *
 * The real functions are found with dlsym(RTLD_NEXT) once, in the
 * constructor, before the program runs; open() goes straight to the
 * system call so it works even before that.
 */
#include "shim.h"
#include "../common/sys.h"
#include "../common/util.h"

#include <dlfcn.h>
#include <errno.h>
#include <stdarg.h>
#include <stdio.h>
#include <sys/mman.h>

#define CK_EXPORT __attribute__((visibility("default")))

typedef int (*sigaction_fn)(int, const struct sigaction *, struct sigaction *);
typedef int (*sigmask_fn)(int, const sigset_t *, sigset_t *);
typedef FILE *(*fopen_fn)(const char *, const char *);
typedef FILE *(*freopen_fn)(const char *, const char *, FILE *);

static sigaction_fn real_sigaction;
static sigmask_fn real_sigprocmask;
static sigmask_fn real_pthread_sigmask;
static fopen_fn real_fopen;
static fopen_fn real_fopen64;
static freopen_fn real_freopen;

void ck_interpose_init(void)
{
    real_sigaction = (sigaction_fn)dlsym(RTLD_NEXT, "sigaction");
    real_sigprocmask = (sigmask_fn)dlsym(RTLD_NEXT, "sigprocmask");
    real_pthread_sigmask = (sigmask_fn)dlsym(RTLD_NEXT, "pthread_sigmask");
    real_fopen = (fopen_fn)dlsym(RTLD_NEXT, "fopen");
    real_fopen64 = (fopen_fn)dlsym(RTLD_NEXT, "fopen64");
    real_freopen = (freopen_fn)dlsym(RTLD_NEXT, "freopen");
    ck_eintr_init();
}

static int owned_signal(int sig) { return ck_shim.active && sig == ck_shim.quiesce_signal; }

/* ---- open family ---- */

static int after_open(long rc, int flags)
{
    if (rc < 0)
        return ck_libc_int(rc);
    if ((flags & O_ACCMODE) != O_RDONLY || (flags & (O_TRUNC | O_CREAT)))
        ck_files_track_fd((int)rc);
    return (int)rc;
}

#define OPEN_MODE(flags, mode)                          \
    do {                                                \
        if ((flags) & (O_CREAT | __O_TMPFILE)) {        \
            va_list ap;                                 \
            va_start(ap, flags);                        \
            mode = va_arg(ap, int);                     \
            va_end(ap);                                 \
        }                                               \
    } while (0)

CK_EXPORT int open(const char *path, int flags, ...)
{
    int mode = 0;
    OPEN_MODE(flags, mode);
    return after_open(ck_openat(AT_FDCWD, path, flags, mode), flags);
}

CK_EXPORT int open64(const char *path, int flags, ...)
{
    int mode = 0;
    OPEN_MODE(flags, mode);
    return after_open(ck_openat(AT_FDCWD, path, flags | O_LARGEFILE, mode), flags);
}

CK_EXPORT int openat(int dirfd, const char *path, int flags, ...)
{
    int mode = 0;
    OPEN_MODE(flags, mode);
    return after_open(ck_openat(dirfd, path, flags, mode), flags);
}

CK_EXPORT int openat64(int dirfd, const char *path, int flags, ...)
{
    int mode = 0;
    OPEN_MODE(flags, mode);
    return after_open(ck_openat(dirfd, path, flags | O_LARGEFILE, mode), flags);
}

/* _FORTIFY_SOURCE variants (no mode argument) */
CK_EXPORT int __open_2(const char *path, int flags) { return after_open(ck_openat(AT_FDCWD, path, flags, 0), flags); }
CK_EXPORT int __open64_2(const char *path, int flags) { return after_open(ck_openat(AT_FDCWD, path, flags | O_LARGEFILE, 0), flags); }
CK_EXPORT int __openat_2(int dirfd, const char *path, int flags) { return after_open(ck_openat(dirfd, path, flags, 0), flags); }
CK_EXPORT int __openat64_2(int dirfd, const char *path, int flags) { return after_open(ck_openat(dirfd, path, flags | O_LARGEFILE, 0), flags); }

CK_EXPORT int creat(const char *path, mode_t mode)
{
    int flags = O_CREAT | O_WRONLY | O_TRUNC;
    return after_open(ck_openat(AT_FDCWD, path, flags, (int)mode), flags);
}

CK_EXPORT int creat64(const char *path, mode_t mode)
{
    int flags = O_CREAT | O_WRONLY | O_TRUNC | O_LARGEFILE;
    return after_open(ck_openat(AT_FDCWD, path, flags, (int)mode), flags);
}

static int mode_writes(const char *mode) { return mode && (__builtin_strpbrk(mode, "wa+") != 0); }

static FILE *track_stream(FILE *f, const char *mode)
{
    if (f && mode_writes(mode))
        ck_files_track_fd(fileno(f));
    return f;
}

CK_EXPORT FILE *fopen(const char *path, const char *mode)
{
    if (!real_fopen)
        real_fopen = (fopen_fn)dlsym(RTLD_NEXT, "fopen");
    return track_stream(real_fopen(path, mode), mode);
}

CK_EXPORT FILE *fopen64(const char *path, const char *mode)
{
    if (!real_fopen64)
        real_fopen64 = (fopen_fn)dlsym(RTLD_NEXT, "fopen64");
    return track_stream(real_fopen64(path, mode), mode);
}

CK_EXPORT FILE *freopen(const char *path, const char *mode, FILE *stream)
{
    if (!real_freopen)
        real_freopen = (freopen_fn)dlsym(RTLD_NEXT, "freopen");
    return track_stream(real_freopen(path, mode, stream), mode);
}

/* ---- signals ---- */

CK_EXPORT int sigaction(int sig, const struct sigaction *act, struct sigaction *old)
{
    if (!real_sigaction)
        real_sigaction = (sigaction_fn)dlsym(RTLD_NEXT, "sigaction");
    if (owned_signal(sig) && act) {
        errno = EINVAL;  /* reserved by ckptd (CKPTD_QUIESCE_SIGNAL picks another) */
        return -1;
    }
    if (sig == SIGTERM)
        return ck_term_sigaction(act, old, real_sigaction);  /* SIG_DFL held for the agent (sigterm.c) */
    return ck_eintr_sigaction(sig, act, old, real_sigaction);  /* counts its handlers (eintr.c) */
}

CK_EXPORT sighandler_t signal(int sig, sighandler_t handler)
{
    struct sigaction act, old;
    __builtin_memset(&act, 0, sizeof(act));
    act.sa_handler = handler;
    act.sa_flags = SA_RESTART;
    sigemptyset(&act.sa_mask);
    if (sigaction(sig, &act, &old) < 0)
        return SIG_ERR;
    return old.sa_handler;
}

static const sigset_t *without_owned(int how, const sigset_t *set, sigset_t *copy)
{
    if (!set || how == SIG_UNBLOCK || !ck_shim.active || !sigismember(set, ck_shim.quiesce_signal))
        return set;
    *copy = *set;
    sigdelset(copy, ck_shim.quiesce_signal);
    return copy;
}

CK_EXPORT int sigprocmask(int how, const sigset_t *set, sigset_t *old)
{
    sigset_t copy;
    if (!real_sigprocmask)
        real_sigprocmask = (sigmask_fn)dlsym(RTLD_NEXT, "sigprocmask");
    return real_sigprocmask(how, without_owned(how, set, &copy), old);
}

CK_EXPORT int pthread_sigmask(int how, const sigset_t *set, sigset_t *old)
{
    sigset_t copy;
    if (!real_pthread_sigmask)
        real_pthread_sigmask = (sigmask_fn)dlsym(RTLD_NEXT, "pthread_sigmask");
    return real_pthread_sigmask(how, without_owned(how, set, &copy), old);
}

/* ---- io_uring ----
 * A ring's state lives in kernel memory shared with the process, which no
 * checkpoint can save and put back.  So a job is told io_uring is not there
 * (ENOSYS, as Docker's default seccomp profile does) and libraries fall back
 * to epoll and threads: libuv, in torch's TCPStore, does.  With
 * CKPTD_ALLOW_IO_URING=1 the ring is made, and a checkpoint names it.
 * glibc's syscall() is a plain trap with six arguments; so is this one. */
CK_EXPORT long syscall(long n, ...)
{
    va_list ap;
    long a[6];
    va_start(ap, n);
    for (int i = 0; i < 6; i++)
        a[i] = va_arg(ap, long);
    va_end(ap);
    long rc = (n == SYS_io_uring_setup && ck_shim.hide_io_uring) ? -ENOSYS
              : n == SYS_futex ? ck_eintr_futex(a[0], a[1], a[2], a[3], a[4], a[5])  /* eintr.c */
                               : ck_sc6(n, a[0], a[1], a[2], a[3], a[4], a[5]);
    if (n == SYS_rseq && rc == 0)
        ck_rseq_registered(a[0], (uint32_t)a[1], (int)a[2], (uint32_t)a[3]);  /* quiesce.c */
    if (rc < 0 && rc > -4096) {
        errno = (int)-rc;
        return -1;
    }
    return rc;
}

/* ---- advice and locks: the early maps copy cannot see them (dump_mem.c) ---- */

/* the advice that changes a mapping's VmFlags; the rest (DONTNEED, FREE,
 * WILLNEED, COLD, PAGEOUT, POPULATE_*: what allocators give all the time)
 * changes pages, which the dump reads as they are in the pause anyway */
static int flags_advice(int advice)
{
    switch (advice) {
    case MADV_NORMAL: case MADV_RANDOM: case MADV_SEQUENTIAL:
    case MADV_DONTFORK: case MADV_DOFORK: case MADV_DONTDUMP: case MADV_DODUMP:
    case MADV_MERGEABLE: case MADV_UNMERGEABLE: case MADV_HUGEPAGE: case MADV_NOHUGEPAGE:
    case MADV_WIPEONFORK: case MADV_KEEPONFORK:
        return 1;
    default:
        return 0;
    }
}

CK_EXPORT int madvise(void *addr, size_t len, int advice)
{
    if (flags_advice(advice))
        ck_premaps_stale();
    return ck_libc_int(ck_madvise(addr, len, advice));
}

CK_EXPORT int posix_madvise(void *addr, size_t len, int advice)
{
    if (advice == POSIX_MADV_DONTNEED)
        return 0; /* as glibc: it would discard data, which POSIX does not allow */
    if (flags_advice(advice))
        ck_premaps_stale();
    long rc = ck_madvise(addr, len, advice);
    return rc < 0 ? (int)-rc : 0; /* an error number, not -1 and errno */
}

CK_EXPORT int mlock(const void *addr, size_t len)
{
    ck_premaps_stale();
    return ck_libc_int(ck_sc2(SYS_mlock, addr, len));
}

CK_EXPORT int mlock2(const void *addr, size_t len, unsigned int flags)
{
    ck_premaps_stale();
    return ck_libc_int(ck_sc3(SYS_mlock2, addr, len, flags));
}

CK_EXPORT int munlock(const void *addr, size_t len)
{
    ck_premaps_stale();
    return ck_libc_int(ck_sc2(SYS_munlock, addr, len));
}

CK_EXPORT int mlockall(int flags)
{
    ck_premaps_stale();
    return ck_libc_int(ck_sc1(SYS_mlockall, flags));
}

CK_EXPORT int munlockall(void)
{
    ck_premaps_stale();
    return ck_libc_int(ck_sc0(SYS_munlockall));
}
