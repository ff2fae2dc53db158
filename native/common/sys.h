/*
 * Raw x86-64 system calls, shared by the shim and the freestanding restorer.
 *
 * Every wrapper returns the kernel's result: >= 0 on success, -errno on
 * failure.  Nothing here touches errno, takes a lock or allocates, so the
 * shim can use it while the other threads of the process are parked inside
 * a signal handler (possibly holding libc locks), and the restorer can use
 * it with no libc at all.  Only constants and types come from the system
 * headers.
 */
#ifndef CKPTD_SYS_H
#define CKPTD_SYS_H

#include <stddef.h>
#include <stdint.h>
#include <sys/syscall.h>
#include <sys/types.h>
#include <sys/stat.h>
#include <signal.h>
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/time.h>
#include <sys/resource.h>
#include <time.h>
#include <linux/futex.h>
#include <poll.h>
#include <linux/sched.h>

#define CK_ALWAYS_INLINE static inline __attribute__((always_inline))

#ifndef SA_RESTORER
#define SA_RESTORER 0x04000000
#endif

CK_ALWAYS_INLINE long ck_sc6(long n, long a1, long a2, long a3, long a4, long a5, long a6)
{
    long ret;
    register long r10 __asm__("r10") = a4;
    register long r8 __asm__("r8") = a5;
    register long r9 __asm__("r9") = a6;
    __asm__ volatile("syscall"
                     : "=a"(ret)
                     : "a"(n), "D"(a1), "S"(a2), "d"(a3), "r"(r10), "r"(r8), "r"(r9)
                     : "rcx", "r11", "memory");
    return ret;
}
#define ck_sc0(n) ck_sc6((n), 0, 0, 0, 0, 0, 0)
#define ck_sc1(n, a) ck_sc6((n), (long)(a), 0, 0, 0, 0, 0)
#define ck_sc2(n, a, b) ck_sc6((n), (long)(a), (long)(b), 0, 0, 0, 0)
#define ck_sc3(n, a, b, c) ck_sc6((n), (long)(a), (long)(b), (long)(c), 0, 0, 0)
#define ck_sc4(n, a, b, c, d) ck_sc6((n), (long)(a), (long)(b), (long)(c), (long)(d), 0, 0)
#define ck_sc5(n, a, b, c, d, e) ck_sc6((n), (long)(a), (long)(b), (long)(c), (long)(d), (long)(e), 0)

/* kernel ABI structs not (reliably) in the libc headers */
struct ck_kernel_sigaction {
    uint64_t handler;
    uint64_t flags;
    uint64_t restorer;
    uint64_t mask;
};

struct ck_linux_dirent64 {
    uint64_t d_ino;
    int64_t d_off;
    unsigned short d_reclen;
    unsigned char d_type;
    char d_name[];
};

struct ck_cap_header {
    uint32_t version;
    int pid;
};
struct ck_cap_data {
    uint32_t effective;
    uint32_t permitted;
    uint32_t inheritable;
};
#define CK_CAP_VERSION_3 0x20080522

#ifndef ARCH_SET_GS
#define ARCH_SET_GS 0x1001
#define ARCH_SET_FS 0x1002
#define ARCH_GET_FS 0x1003
#define ARCH_GET_GS 0x1004
#endif

/* files and descriptors */
CK_ALWAYS_INLINE long ck_read(int fd, void *buf, size_t n) { return ck_sc3(SYS_read, fd, buf, n); }
CK_ALWAYS_INLINE long ck_write(int fd, const void *buf, size_t n) { return ck_sc3(SYS_write, fd, buf, n); }
CK_ALWAYS_INLINE long ck_writev(int fd, const void *iov, int n) { return ck_sc3(SYS_writev, fd, iov, n); }
CK_ALWAYS_INLINE long ck_pread(int fd, void *buf, size_t n, uint64_t off) { return ck_sc4(SYS_pread64, fd, buf, n, off); }
CK_ALWAYS_INLINE long ck_openat(int dirfd, const char *path, int flags, int mode) { return ck_sc4(SYS_openat, dirfd, path, flags, mode); }
CK_ALWAYS_INLINE long ck_open(const char *path, int flags, int mode) { return ck_openat(AT_FDCWD, path, flags, mode); }
CK_ALWAYS_INLINE long ck_close(int fd) { return ck_sc1(SYS_close, fd); }
CK_ALWAYS_INLINE long ck_lseek(int fd, int64_t off, int whence) { return ck_sc3(SYS_lseek, fd, off, whence); }
CK_ALWAYS_INLINE long ck_fcntl(int fd, int cmd, long arg) { return ck_sc3(SYS_fcntl, fd, cmd, arg); }
CK_ALWAYS_INLINE long ck_dup3(int oldfd, int newfd, int flags) { return ck_sc3(SYS_dup3, oldfd, newfd, flags); }
CK_ALWAYS_INLINE long ck_pipe2(int fds[2], int flags) { return ck_sc2(SYS_pipe2, fds, flags); }
CK_ALWAYS_INLINE long ck_fstat(int fd, struct stat *st) { return ck_sc2(SYS_fstat, fd, st); }
CK_ALWAYS_INLINE long ck_stat(const char *path, struct stat *st) { return ck_sc4(SYS_newfstatat, AT_FDCWD, path, st, 0); }
CK_ALWAYS_INLINE long ck_readlink(const char *path, char *buf, size_t n) { return ck_sc4(SYS_readlinkat, AT_FDCWD, path, buf, n); }
CK_ALWAYS_INLINE long ck_getdents64(int fd, void *buf, size_t n) { return ck_sc3(SYS_getdents64, fd, buf, n); }
CK_ALWAYS_INLINE long ck_ioctl(int fd, unsigned long req, void *arg) { return ck_sc3(SYS_ioctl, fd, req, arg); }
CK_ALWAYS_INLINE long ck_ftruncate(int fd, int64_t len) { return ck_sc2(SYS_ftruncate, fd, len); }
CK_ALWAYS_INLINE long ck_pwrite(int fd, const void *buf, size_t n, int64_t off) { return ck_sc4(SYS_pwrite64, fd, buf, n, off); }
CK_ALWAYS_INLINE long ck_memfd_create(const char *name, unsigned flags) { return ck_sc2(SYS_memfd_create, name, flags); }
CK_ALWAYS_INLINE long ck_unlink(const char *path) { return ck_sc3(SYS_unlinkat, AT_FDCWD, path, 0); }
CK_ALWAYS_INLINE long ck_mknod(const char *path, int mode, unsigned dev) { return ck_sc4(SYS_mknodat, AT_FDCWD, path, mode, dev); }
CK_ALWAYS_INLINE long ck_fstatfs(int fd, void *buf) { return ck_sc2(SYS_fstatfs, fd, buf); }
CK_ALWAYS_INLINE long ck_mincore(void *addr, size_t len, unsigned char *vec) { return ck_sc3(SYS_mincore, addr, len, vec); }
CK_ALWAYS_INLINE long ck_fsync(int fd) { return ck_sc1(SYS_fsync, fd); }
CK_ALWAYS_INLINE long ck_mkdir(const char *path, int mode) { return ck_sc3(SYS_mkdirat, AT_FDCWD, path, mode); }
CK_ALWAYS_INLINE long ck_chdir(const char *path) { return ck_sc1(SYS_chdir, path); }
CK_ALWAYS_INLINE long ck_umask(int mask) { return ck_sc1(SYS_umask, mask); }
CK_ALWAYS_INLINE long ck_copy_file_range(int in, int out, size_t n)
{
    return ck_sc6(SYS_copy_file_range, in, 0, out, 0, (long)n, 0);
}
CK_ALWAYS_INLINE long ck_sendfile(int out, int in, size_t n) { return ck_sc4(SYS_sendfile, out, in, 0, n); }
CK_ALWAYS_INLINE long ck_tee(int in, int out, size_t n, unsigned flags) { return ck_sc4(SYS_tee, in, out, n, flags); }
CK_ALWAYS_INLINE long ck_eventfd2(unsigned count, int flags) { return ck_sc2(SYS_eventfd2, count, flags); }
CK_ALWAYS_INLINE long ck_epoll_create1(int flags) { return ck_sc1(SYS_epoll_create1, flags); }
CK_ALWAYS_INLINE long ck_epoll_ctl(int epfd, int op, int fd, void *ev) { return ck_sc4(SYS_epoll_ctl, epfd, op, fd, ev); }
CK_ALWAYS_INLINE long ck_kcmp(int pid1, int pid2, int type, long a, long b) { return ck_sc5(SYS_kcmp, pid1, pid2, type, a, b); }

/* memory */
CK_ALWAYS_INLINE void *ck_mmap(void *addr, size_t len, int prot, int flags, int fd, int64_t off)
{
    return (void *)ck_sc6(SYS_mmap, (long)addr, (long)len, prot, flags, fd, (long)off);
}
CK_ALWAYS_INLINE int ck_mmap_failed(void *p) { return (unsigned long)p >= (unsigned long)-4095; }
CK_ALWAYS_INLINE long ck_munmap(void *addr, size_t len) { return ck_sc2(SYS_munmap, addr, len); }
CK_ALWAYS_INLINE long ck_mprotect(void *addr, size_t len, int prot) { return ck_sc3(SYS_mprotect, addr, len, prot); }
CK_ALWAYS_INLINE long ck_madvise(void *addr, size_t len, int advice) { return ck_sc3(SYS_madvise, addr, len, advice); }
CK_ALWAYS_INLINE void *ck_mremap(void *old, size_t oldlen, size_t newlen, int flags, void *newaddr)
{
    return (void *)ck_sc5(SYS_mremap, old, oldlen, newlen, flags, newaddr);
}
CK_ALWAYS_INLINE long ck_brk(unsigned long addr) { return ck_sc1(SYS_brk, addr); }

/* processes, threads, signals */
CK_ALWAYS_INLINE long ck_getpid(void) { return ck_sc0(SYS_getpid); }
CK_ALWAYS_INLINE long ck_gettid(void) { return ck_sc0(SYS_gettid); }
CK_ALWAYS_INLINE long ck_getppid(void) { return ck_sc0(SYS_getppid); }
CK_ALWAYS_INLINE long ck_getpgid(int pid) { return ck_sc1(SYS_getpgid, pid); }
CK_ALWAYS_INLINE long ck_getsid(int pid) { return ck_sc1(SYS_getsid, pid); }
CK_ALWAYS_INLINE long ck_tgkill(int tgid, int tid, int sig) { return ck_sc3(SYS_tgkill, tgid, tid, sig); }
CK_ALWAYS_INLINE long ck_rt_sigaction(int sig, const struct ck_kernel_sigaction *act, struct ck_kernel_sigaction *old)
{
    return ck_sc4(SYS_rt_sigaction, sig, act, old, 8);
}
CK_ALWAYS_INLINE long ck_sigprocmask(int how, const uint64_t *set, uint64_t *old)
{
    return ck_sc4(SYS_rt_sigprocmask, how, set, old, 8);
}
CK_ALWAYS_INLINE long ck_rt_tgsigqueueinfo(int tgid, int tid, int sig, void *info)
{
    return ck_sc4(SYS_rt_tgsigqueueinfo, tgid, tid, sig, info);
}
CK_ALWAYS_INLINE long ck_prctl(int opt, unsigned long a2, unsigned long a3, unsigned long a4, unsigned long a5)
{
    return ck_sc5(SYS_prctl, opt, a2, a3, a4, a5);
}
CK_ALWAYS_INLINE long ck_arch_prctl(int code, unsigned long addr) { return ck_sc2(SYS_arch_prctl, code, addr); }
CK_ALWAYS_INLINE long ck_futex(volatile uint32_t *uaddr, int op, uint32_t val, const struct timespec *ts)
{
    return ck_sc6(SYS_futex, (long)uaddr, op, val, (long)ts, 0, 0);
}
CK_ALWAYS_INLINE long ck_set_tid_address(void *p) { return ck_sc1(SYS_set_tid_address, p); }
CK_ALWAYS_INLINE long ck_set_robust_list(void *head, size_t len) { return ck_sc2(SYS_set_robust_list, head, len); }
CK_ALWAYS_INLINE long ck_get_robust_list(int tid, void **head, size_t *len) { return ck_sc3(SYS_get_robust_list, tid, head, len); }
CK_ALWAYS_INLINE long ck_rseq(void *area, uint32_t len, int flags, uint32_t sig) { return ck_sc4(SYS_rseq, area, len, flags, sig); }
CK_ALWAYS_INLINE long ck_capget(struct ck_cap_header *h, struct ck_cap_data *d) { return ck_sc2(SYS_capget, h, d); }
CK_ALWAYS_INLINE long ck_capset(struct ck_cap_header *h, const struct ck_cap_data *d) { return ck_sc2(SYS_capset, h, d); }
/* credentials: raw calls change the calling thread only (glibc's wrappers change every thread) */
CK_ALWAYS_INLINE long ck_getresuid(uint32_t *r, uint32_t *e, uint32_t *s) { return ck_sc3(SYS_getresuid, r, e, s); }
CK_ALWAYS_INLINE long ck_getresgid(uint32_t *r, uint32_t *e, uint32_t *s) { return ck_sc3(SYS_getresgid, r, e, s); }
CK_ALWAYS_INLINE long ck_setresuid(uint32_t r, uint32_t e, uint32_t s) { return ck_sc3(SYS_setresuid, r, e, s); }
CK_ALWAYS_INLINE long ck_setresgid(uint32_t r, uint32_t e, uint32_t s) { return ck_sc3(SYS_setresgid, r, e, s); }
CK_ALWAYS_INLINE long ck_setfsuid(uint32_t id) { return ck_sc1(SYS_setfsuid, id); }  /* returns the old fsuid */
CK_ALWAYS_INLINE long ck_setfsgid(uint32_t id) { return ck_sc1(SYS_setfsgid, id); }
CK_ALWAYS_INLINE long ck_getgroups(int n, uint32_t *list) { return ck_sc2(SYS_getgroups, n, list); }
CK_ALWAYS_INLINE long ck_setgroups(long n, const uint32_t *list) { return ck_sc2(SYS_setgroups, n, list); }
CK_ALWAYS_INLINE long ck_getitimer(int which, struct itimerval *v) { return ck_sc2(SYS_getitimer, which, v); }
CK_ALWAYS_INLINE long ck_setitimer(int which, const struct itimerval *v) { return ck_sc3(SYS_setitimer, which, v, 0); }
CK_ALWAYS_INLINE long ck_prlimit(int res, const struct rlimit *nl, struct rlimit *ol) { return ck_sc4(SYS_prlimit64, 0, res, nl, ol); }
CK_ALWAYS_INLINE long ck_personality(unsigned long p) { return ck_sc1(SYS_personality, p); }
CK_ALWAYS_INLINE long ck_clock_gettime(int clk, struct timespec *ts) { return ck_sc2(SYS_clock_gettime, clk, ts); }
CK_ALWAYS_INLINE long ck_nanosleep_ms(long ms)
{
    struct timespec ts = {ms / 1000, (ms % 1000) * 1000000L};
    return ck_sc2(SYS_nanosleep, &ts, 0);
}
CK_ALWAYS_INLINE long ck_sched_yield(void) { return ck_sc0(SYS_sched_yield); }
CK_ALWAYS_INLINE long ck_poll_ms(struct pollfd *fds, unsigned n, long ms)
{
    struct timespec ts = {ms / 1000, (ms % 1000) * 1000000L};
    return ck_sc5(SYS_ppoll, fds, n, &ts, 0, 0);
}
CK_ALWAYS_INLINE long ck_getpriority(int which, int who) { return ck_sc2(SYS_getpriority, which, who); }
CK_ALWAYS_INLINE long ck_setpriority(int which, int who, int prio) { return ck_sc3(SYS_setpriority, which, who, prio); }
CK_ALWAYS_INLINE long ck_sched_getscheduler(int pid) { return ck_sc1(SYS_sched_getscheduler, pid); }
CK_ALWAYS_INLINE long ck_sched_setscheduler(int pid, int policy, const int *prio)
{
    return ck_sc3(SYS_sched_setscheduler, pid, policy, prio);
}
CK_ALWAYS_INLINE long ck_sched_getparam(int pid, int *prio) { return ck_sc2(SYS_sched_getparam, pid, prio); }
CK_ALWAYS_INLINE long ck_sched_getaffinity(int pid, size_t len, void *mask)
{
    return ck_sc3(SYS_sched_getaffinity, pid, len, mask);
}
CK_ALWAYS_INLINE long ck_sched_setaffinity(int pid, size_t len, const void *mask)
{
    return ck_sc3(SYS_sched_setaffinity, pid, len, mask);
}
CK_ALWAYS_INLINE long ck_setsid(void) { return ck_sc0(SYS_setsid); }
CK_ALWAYS_INLINE long ck_setpgid(int pid, int pgid) { return ck_sc2(SYS_setpgid, pid, pgid); }
CK_ALWAYS_INLINE long ck_kill(int pid, int sig) { return ck_sc2(SYS_kill, pid, sig); }
CK_ALWAYS_INLINE long ck_clone3(void *args, size_t size) { return ck_sc2(SYS_clone3, args, size); }
/* fork(2) without glibc's atfork handlers: exit_signal 0 makes the child
 * invisible to the parent's plain wait() and sends it no SIGCHLD */
CK_ALWAYS_INLINE long ck_clone_quiet(void) { return ck_sc5(SYS_clone, 0, 0, 0, 0, 0); }
CK_ALWAYS_INLINE long ck_wait4(int pid, int *status, int options) { return ck_sc4(SYS_wait4, pid, status, options, 0); }
CK_ALWAYS_INLINE long ck_close_range(unsigned first, unsigned last) { return ck_sc3(SYS_close_range, first, last, 0); }
CK_ALWAYS_INLINE long ck_renameat(int dirfd, const char *from, const char *to)
{
    return ck_sc5(SYS_renameat2, dirfd, from, dirfd, to, 0);
}
CK_ALWAYS_INLINE long ck_flock(int fd, int op) { return ck_sc2(SYS_flock, fd, op); }
CK_ALWAYS_INLINE long ck_faccessat(int dirfd, const char *path) { return ck_sc4(SYS_faccessat2, dirfd, path, 0, 0); }
/* x86-64 takes the whole offset in pos_l */
CK_ALWAYS_INLINE long ck_pwritev(int fd, const void *iov, int n, uint64_t off)
{
    return ck_sc5(SYS_pwritev, fd, iov, n, off, 0);
}
CK_ALWAYS_INLINE long ck_execve(const char *path, char *const argv[], char *const envp[])
{
    return ck_sc3(SYS_execve, path, argv, envp);
}
CK_ALWAYS_INLINE long ck_rt_sigtimedwait(const uint64_t *set, void *info, const struct timespec *ts)
{
    return ck_sc4(SYS_rt_sigtimedwait, set, info, ts, 8);
}
__attribute__((noreturn)) CK_ALWAYS_INLINE void ck_exit_group(int code)
{
    for (;;)
        ck_sc1(SYS_exit_group, code);
}
__attribute__((noreturn)) CK_ALWAYS_INLINE void ck_exit_thread(int code)
{
    for (;;)
        ck_sc1(SYS_exit, code);
}

/* sockets */
CK_ALWAYS_INLINE long ck_socket(int dom, int type, int proto) { return ck_sc3(SYS_socket, dom, type, proto); }
CK_ALWAYS_INLINE long ck_connect(int fd, const void *addr, unsigned len) { return ck_sc3(SYS_connect, fd, addr, len); }
CK_ALWAYS_INLINE long ck_socketpair(int dom, int type, int proto, int sv[2]) { return ck_sc4(SYS_socketpair, dom, type, proto, sv); }
CK_ALWAYS_INLINE long ck_bind(int fd, const void *addr, unsigned len) { return ck_sc3(SYS_bind, fd, addr, len); }
CK_ALWAYS_INLINE long ck_listen(int fd, int backlog) { return ck_sc2(SYS_listen, fd, backlog); }
CK_ALWAYS_INLINE long ck_accept4(int fd, int flags) { return ck_sc4(SYS_accept4, fd, 0, 0, flags); }
CK_ALWAYS_INLINE long ck_shutdown(int fd, int how) { return ck_sc2(SYS_shutdown, fd, how); }
CK_ALWAYS_INLINE long ck_sendto(int fd, const void *buf, size_t n, int flags, const void *addr, unsigned alen)
{
    return ck_sc6(SYS_sendto, fd, (long)buf, (long)n, flags, (long)addr, alen);
}
CK_ALWAYS_INLINE long ck_recvmsg(int fd, void *msg, int flags) { return ck_sc3(SYS_recvmsg, fd, msg, flags); }
CK_ALWAYS_INLINE long ck_sendmsg(int fd, const void *msg, int flags) { return ck_sc3(SYS_sendmsg, fd, msg, flags); }
CK_ALWAYS_INLINE long ck_getsockopt(int fd, int level, int name, void *val, unsigned *len)
{
    return ck_sc5(SYS_getsockopt, fd, level, name, val, len);
}
CK_ALWAYS_INLINE long ck_setsockopt(int fd, int level, int name, const void *val, unsigned len)
{
    return ck_sc5(SYS_setsockopt, fd, level, name, val, len);
}

CK_ALWAYS_INLINE int64_t ck_now_ns(int clk)
{
    struct timespec ts;
    if (ck_clock_gettime(clk, &ts) < 0)
        return 0;
    return (int64_t)ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

/* futex helpers on process-private words */
CK_ALWAYS_INLINE void ck_futex_wake_all(volatile uint32_t *w)
{
    ck_futex(w, FUTEX_WAKE_PRIVATE, 0x7fffffff, 0);
}
CK_ALWAYS_INLINE void ck_futex_wait(volatile uint32_t *w, uint32_t expected, long timeout_ms)
{
    struct timespec ts = {timeout_ms / 1000, (timeout_ms % 1000) * 1000000L};
    ck_futex(w, FUTEX_WAIT_PRIVATE, expected, timeout_ms >= 0 ? &ts : 0);
}

#endif
