/*
 * ckptd process image, version 1: the layout of core.img.
 *
 * One core.img per process holds everything except page contents, which go
 * to pages.img (raw 4 KiB pages, referenced by ck_page_run).  Written by the
 * shim (native/shim), read by the restorer (native/restorer) and, through
 * cffi, by the Python agent (ckptd/image/core.py).  The part between the
 * CFFI markers must stay parseable by cffi's cdef(): fixed-width types,
 * plain #define integer constants, no attributes.  Every struct is laid out
 * with explicit padding so that C and cffi agree on offsets;
 * native/common/layout_check.c asserts the sizes at build time.
 *
 * Strings (paths) live in the STRINGS section and are referenced by their
 * byte offset in it; offset 0 is the empty string.
 */
#ifndef CKPTD_IMAGE_FORMAT_H
#define CKPTD_IMAGE_FORMAT_H
#include <stdint.h>

/* BEGIN CFFI */
#define CK_CORE_MAGIC 0x45524f4354504b43   /* "CKPTCORE" as little-endian bytes */
#define CK_CORE_VERSION 8
#define CK_MAX_SECTIONS 16
#define CK_PAGE_SIZE 4096

/* section types */
#define CK_SEC_PROC 1
#define CK_SEC_THREADS 2
#define CK_SEC_VMAS 3
#define CK_SEC_RUNS 4
#define CK_SEC_FDS 5
#define CK_SEC_EPOLL 6
#define CK_SEC_SIGACTS 7
#define CK_SEC_RLIMITS 8
#define CK_SEC_PENDING 9
#define CK_SEC_FILES 10
#define CK_SEC_AUXV 11
#define CK_SEC_STRINGS 12
#define CK_SEC_BLOB 13
#define CK_SEC_SOURCES 14

struct ck_section {
    uint32_t type;
    uint32_t count;     /* number of records (or bytes for blobs) */
    uint64_t offset;    /* from the start of core.img */
    uint64_t size;      /* bytes */
};

struct ck_header {
    uint64_t magic;
    uint32_t version;
    uint32_t nsections;
    uint64_t file_size;         /* whole core.img */
    uint64_t pages_size;        /* whole pages.img */
    struct ck_section sections[16];
};

/* saved callee-saved context: where a parked thread resumes (see ctx.S) */
struct ck_jmpctx {
    uint64_t rbx;
    uint64_t rbp;
    uint64_t r12;
    uint64_t r13;
    uint64_t r14;
    uint64_t r15;
    uint64_t rsp;
    uint64_t rip;
    uint32_t mxcsr;
    uint32_t fpucw;
};

#define CK_THREAD_MAIN 1          /* the thread-group leader (tid == pid) */
#define CK_THREAD_CHECKPOINTER 2  /* the shim's own checkpoint thread */
#define CK_THREAD_RSEQ_UNKNOWN 4  /* an rseq registration the shim could not identify: refused */
#define CK_THREAD_OWN_NICE 8      /* its nice value is not ckptd-init's: set again exactly */
#define CK_THREAD_OWN_CPUS 16     /* its CPU affinity is not ckptd-init's: set again exactly */

struct ck_thread {
    int32_t tid;                /* as the process sees it (inside its pid ns) */
    uint32_t flags;
    uint64_t fs_base;
    uint64_t gs_base;
    uint64_t clear_child_tid;   /* set_tid_address(); glibc's pthread join word */
    uint64_t robust_list;
    uint64_t robust_len;
    uint64_t rseq_addr;         /* 0: not registered */
    uint32_t rseq_len;
    uint32_t rseq_sig;
    uint64_t sigmask;           /* blocked set while running normally */
    uint32_t cap_effective[2];
    uint32_t cap_permitted[2];
    uint32_t cap_inheritable[2];
    uint32_t pad0;
    uint32_t pad1;
    struct ck_jmpctx ctx;
    char comm[16];
    /* per-thread attributes the kernel keeps per task, read by the thread
     * itself (quiesce.c) and set again by its restored thread (threads.c),
     * so that nothing comes back silently different (issue 18) */
    uint32_t uid[4];            /* real, effective, saved, filesystem */
    uint32_t gid[4];
    uint64_t cap_bounding;      /* PR_CAPBSET_READ, one bit per capability */
    uint64_t cap_ambient;       /* PR_CAP_AMBIENT_IS_SET */
    uint64_t timer_slack_ns;    /* PR_GET_TIMERSLACK */
    uint32_t securebits;        /* PR_GET_SECUREBITS (SECBIT_KEEP_CAPS: PR_SET_KEEPCAPS) */
    int32_t pdeathsig;          /* PR_GET_PDEATHSIG */
    uint32_t no_new_privs;      /* PR_GET_NO_NEW_PRIVS */
    /* scheduling.  ckptd-init (pid 1 of the job's pid namespace) has what
     * the node gave the job; a thread whose nice value or CPU affinity is
     * not init's set it itself (os.nice, taskset, a pinned DataLoader) and
     * gets it back exactly, or the restore fails; one that kept the node's
     * gets the new node's (CK_THREAD_OWN_*).  A policy other than
     * SCHED_OTHER comes back exactly, or the restore fails. */
    int32_t nice;               /* -20..19 */
    uint32_t sched_policy;      /* sched_getscheduler(), SCHED_RESET_ON_FORK included */
    uint32_t sched_priority;    /* sched_getparam(): a real-time policy's priority */
    uint32_t cpus_bytes;        /* how much of cpus sched_getaffinity filled */
    uint64_t cpus[16];          /* the CPUs it may run on, 0..1023 */
};

/* ck_vma.flags */
#define CK_VMA_SHARED 0x1        /* MAP_SHARED */
#define CK_VMA_FILE 0x2          /* backed by a file that is mapped again */
#define CK_VMA_ANON 0x4          /* anonymous (private or shared) */
#define CK_VMA_GROWSDOWN 0x8
#define CK_VMA_STACK 0x10        /* [stack] */
#define CK_VMA_HEAP 0x20         /* [heap] */
#define CK_VMA_VDSO 0x40         /* [vdso]: moved, not dumped */
#define CK_VMA_VVAR 0x80         /* [vvar] and [vvar_vclock]: moved, not dumped */
#define CK_VMA_NORESERVE 0x100
#define CK_VMA_NOCONTENT 0x200   /* shim scratch: comes back empty */
#define CK_VMA_DELETED 0x400     /* file gone: private, contents saved in full, restored
                                    anonymous; with CK_VMA_SHARED (not on tmpfs), mapped
                                    from the deleted file the restore plan makes again */
#define CK_VMA_LOCKED 0x800
#define CK_VMA_SHMEM 0x1000      /* MAP_SHARED of an object with no path to reopen
                                    (shared anonymous, memfd, deleted /dev/shm file):
                                    mapped from the object the restore plan creates;
                                    dev/ino name it, pages hold what was resident */
#define CK_VMA_TRACKED 0x2000    /* informational: its written pages were tracked
                                    (the unwritten ones may come from earlier images) */
#define CK_VMA_MAYWRITE 0x4000   /* VM_MAYWRITE ("mw"): a shared mapping may be made
                                    writable with mprotect; mapped again from a
                                    descriptor open for writing only then */
#define CK_VMA_SYSV 0x8000       /* a System V shared memory attachment (shmat): ino is
                                    its shmid, pgoff its offset in the segment; the
                                    segment itself (kept under its id in the job's IPC
                                    namespace) is saved once for the job by the agent
                                    (agent/sysv_ipc.py), so no pages are saved here */

/* ck_vma.madv: advice replayed with madvise() */
#define CK_MADV_HUGEPAGE 0x1
#define CK_MADV_NOHUGEPAGE 0x2
#define CK_MADV_DONTFORK 0x4
#define CK_MADV_WIPEONFORK 0x8
#define CK_MADV_DONTDUMP 0x10
#define CK_MADV_MERGEABLE 0x20
#define CK_MADV_RANDOM 0x40
#define CK_MADV_SEQUENTIAL 0x80
#define CK_MADV_LOCKONFAULT 0x100  /* "lf": mlock2(MLOCK_ONFAULT), with CK_VMA_LOCKED */

struct ck_vma {
    uint64_t start;
    uint64_t end;
    uint64_t pgoff;             /* file offset in bytes */
    uint32_t prot;              /* PROT_* */
    uint32_t flags;             /* CK_VMA_* */
    uint32_t madv;              /* CK_MADV_* */
    uint32_t path;              /* string offset; 0 for anonymous */
    uint64_t dev;
    uint64_t ino;
    uint64_t file_size;         /* identity of the file at checkpoint */
    int64_t mtime_ns;
    uint64_t first_run;         /* index into RUNS */
    uint64_t nruns;
    /* CK_VMA_SHARED|CK_VMA_DELETED (issue 19: MAP_SHARED of a deleted file,
       not on tmpfs): the file's st_mode, st_uid, st_gid, which the restore
       plan makes it again with when no descriptor of it says them (its
       size: file_size; its contents: files/deleted-<ino>.data) */
    uint32_t file_mode;
    uint32_t file_uid;
    uint32_t file_gid;
    uint32_t pad;
};

struct ck_page_run {
    uint64_t vaddr;
    uint64_t npages;
    uint64_t offset;            /* in pages.img, or in the source's pages file */
    uint32_t src;               /* 0: this image's pages.img; n: SOURCES[n-1] */
    uint32_t pad;
};

/* An incremental image takes the pages that did not change since its parent
 * from earlier checkpoints' pages.img files: SOURCES lists them, each by its
 * path relative to the job's checkpoint directory (ck_proc.job_depth levels
 * above this image) and its size, checked before a page is read. */
#define CK_MAX_SOURCES 64
struct ck_page_source {
    uint32_t path;              /* string offset, e.g. "ckpt-3/rank-1/proc-12/pages.img" */
    uint32_t pad;
    uint64_t size;
};

/* ck_fd.type */
#define CK_FD_REG 1
#define CK_FD_DIR 2
#define CK_FD_CHR 3              /* character device reopened by path (/dev/null...) */
#define CK_FD_PIPE 4             /* pipe or FIFO: the restore plan recreates it once per job */
#define CK_FD_EVENTFD 5
#define CK_FD_EPOLL 6
#define CK_FD_STDIO 7            /* pipe/tty/socket outside the job: reconnected to the job's log */
#define CK_FD_DUP 8              /* same open file description as ck_fd.dup_of */
#define CK_FD_UNIX 9             /* Unix domain socket: recreated by the restore plan */
#define CK_FD_SHMEM 10           /* memfd or deleted tmpfs file: contents in files/shm-<ino>.data */
#define CK_FD_TCP 11             /* TCP socket (IPv4/IPv6): recreated by the restore plan */
#define CK_FD_OPATH 12           /* O_PATH descriptor of any file kind: reopened by path with O_PATH */
#define CK_FD_DELETED 13         /* open file or directory whose name was removed (not on tmpfs):
                                    contents in files/deleted-<ino>.data, recreated by the restore
                                    plan and removed again */
#define CK_FD_TIMERFD 14         /* timerfd: clock, interval, time left, ticks not read */
#define CK_FD_SIGNALFD 15        /* signalfd: its mask */
#define CK_FD_PIDFD 16           /* pidfd of a process of the job: opened again with pidfd_open */
#define CK_FD_INOTIFY 17         /* inotify: its watches, added again by path in their order */
#define CK_FD_PTY_MASTER 18      /* a pseudo-terminal's master (/dev/ptmx): the pair made again at its number */
#define CK_FD_PTY_SLAVE 19       /* a pseudo-terminal's slave (/dev/pts/N): reopened by path */
#define CK_FD_UDP 20             /* datagram inet socket (UDP, ICMP ping; IPv4/IPv6): recreated by the
                                    restore plan, bound and connected again (native/shim/dump_dgram.c) */
#define CK_FD_RAW 21             /* raw inet socket (SOCK_RAW, its protocol): as CK_FD_UDP */

/* ck_fd.sock_opts (CK_FD_TCP, CK_FD_UDP, CK_FD_RAW): options set again on the new socket */
#define CK_SOCKOPT_NODELAY 0x1
#define CK_SOCKOPT_KEEPALIVE 0x2
#define CK_SOCKOPT_REUSEADDR 0x4
#define CK_SOCKOPT_REUSEPORT 0x8
#define CK_SOCKOPT_V6ONLY 0x10
#define CK_SOCKOPT_FREEBIND 0x20     /* IP_FREEBIND: set before the bind it allows */
#define CK_SOCKOPT_TRANSPARENT 0x40  /* IP_TRANSPARENT: the same */

/* ck_fd.sock_state (CK_FD_UNIX, CK_FD_TCP; CK_FD_UDP and CK_FD_RAW: connected or not) */
#define CK_SOCK_UNCONNECTED 0
#define CK_SOCK_CONNECTED 1
#define CK_SOCK_LISTEN 2

/* ck_fd.flags */
#define CK_FDF_PIPE_WRITE_END 0x1
#define CK_FDF_EVENTFD_SEMAPHORE 0x2
#define CK_FDF_WRITTEN 0x4       /* regular file open for writing: content saved */
#define CK_FDF_FIFO 0x8          /* CK_FD_PIPE that is a named FIFO (path) */
#define CK_FDF_DATA_SAVED 0x10   /* data_off/data_len hold the queued bytes */
#define CK_FDF_MEMFD 0x20        /* CK_FD_SHMEM made by memfd_create: seals is valid */
#define CK_FDF_IN_FLIGHT 0x40    /* not the process's: a copy of a descriptor in flight in one of its
                                    Unix sockets (SCM_RIGHTS), named by that socket's ck_rights */

struct ck_fd {
    int32_t fd;
    uint32_t type;
    uint32_t open_flags;        /* F_GETFL */
    uint32_t fd_flags;          /* F_GETFD */
    uint32_t flags;             /* CK_FDF_* */
    uint32_t path;              /* string offset */
    int32_t dup_of;             /* CK_FD_DUP: lower fd sharing the description */
    uint32_t mode;              /* st_mode */
    uint64_t pos;
    uint64_t dev;
    uint64_t ino;               /* pipe id for CK_FD_PIPE */
    uint64_t size;
    int64_t mtime_ns;
    uint64_t data_off;          /* queued bytes in BLOB (pipe: raw; socket: see nqueued) */
    uint64_t data_len;
    uint64_t pipe_size;         /* F_GETPIPE_SZ */
    uint64_t evcount;           /* eventfd counter */
    uint32_t first_epoll;       /* CK_FD_EPOLL: index into EPOLL */
    uint32_t nepoll;
    /* CK_FD_UNIX */
    uint32_t sock_type;         /* SOCK_STREAM, SOCK_DGRAM, SOCK_SEQPACKET */
    uint32_t sock_state;        /* CK_SOCK_* */
    uint64_t peer_ino;          /* the connected peer's inode; 0: none or gone */
    uint64_t name_off;          /* bound address (sun_path bytes) in BLOB */
    uint32_t name_len;          /* 0: unnamed */
    uint32_t shutdown;          /* 1 receive side shut, 2 send side shut; CK_FD_TCP:
                                   1 the peer's FIN arrived (close wait), 2 this
                                   end's FIN was acknowledged (FIN wait 2), 4 with 1:
                                   the peer's end was closed on this host (no
                                   process holds it) */
    uint32_t backlog;           /* CK_SOCK_LISTEN */
    uint32_t nqueued;           /* messages in data: dgram/seqpacket records are a
                                   little-endian uint32 length, then the bytes; a
                                   Unix listener's data: the uint32 inodes of the
                                   client ends of its backlog, in accept order */
    /* CK_FD_TCP (name_off/name_len: the local sockaddr; data: the receive queue) */
    uint32_t sock_family;       /* AF_INET, AF_INET6 */
    uint32_t sock_opts;         /* CK_SOCKOPT_* */
    uint64_t peer_off;          /* the remote sockaddr in BLOB */
    uint32_t peer_len;
    uint32_t rcvbuf;            /* SO_RCVBUF, SO_SNDBUF as read */
    uint64_t sndq_off;          /* written but not yet sent (Nagle, a full window) */
    uint64_t sndq_len;
    uint32_t sndbuf;
    /* CK_FD_TCP, connected: read in TCP repair mode (CAP_NET_ADMIN) so that
       this end can be rebuilt alone, without its peer's image: the peer is
       another rank of the job, maybe on another node */
    uint32_t repair;            /* 1: the fields below are valid */
    uint32_t mss;               /* TCP_MAXSEG */
    uint32_t snd_wscale;
    uint32_t rcv_wscale;
    uint32_t tcpi_options;      /* TCPI_OPT_*: which options were negotiated */
    uint32_t timestamp;         /* TCP_TIMESTAMP: the connection's clock */
    uint32_t snd_seq;           /* sequence number of the send queue's first byte */
    uint32_t rcv_seq;           /* sequence number of the receive queue's first byte */
    uint32_t snd_wl1;           /* struct tcp_repair_window */
    uint32_t snd_wnd;
    uint32_t max_window;
    uint32_t rcv_wnd;
    uint32_t rcv_wup;
    uint32_t pad1;
    uint64_t sendq_off;         /* the whole send queue in BLOB: sent-not-acked, then unsent */
    uint64_t sendq_len;
    /* the description's SIGIO owner (F_GETOWN_EX) and signal (F_GETSIG):
       a process that asked for O_ASYNC signals gets them again after a restart */
    uint32_t owner_type;        /* F_OWNER_TID, F_OWNER_PID, F_OWNER_PGRP */
    int32_t owner_pid;          /* 0: no owner */
    uint32_t sigio_signal;      /* 0: SIGIO */
    /* the file locks held through this descriptor (its fdinfo's "lock:" lines):
       flock and OFD locks of its description, POSIX locks of this process */
    uint32_t nlocks;
    uint64_t locks_off;         /* nlocks struct ck_file_lock in BLOB */
    /* CK_FD_UNIX, CK_FD_TCP: the options of native/common/sockopts.h as
       read (linger, keepalive timers, timeouts...), nsockopts ck_sockopt
       records in BLOB, set again on the new socket by the restore plan */
    uint64_t sockopt_off;
    uint32_t nsockopts;
    /* CK_FD_SHMEM with CK_FDF_MEMFD: F_GET_SEALS, added again once the
       contents are back (F_SEAL_SEAL alone: created without MFD_ALLOW_SEALING) */
    uint32_t seals;
    /* CK_FD_DELETED (and a deleted working directory, ck_proc.cwd_deleted):
       the owner it is recreated with (st_uid, st_gid) */
    uint32_t uid;
    uint32_t gid;
    /* CK_FD_TIMERFD: what timerfd_gettime said, the time left kept relative
       (what was left at the checkpoint is what is left after the restart),
       and the expirations not read yet (fdinfo "ticks") */
    uint32_t clockid;
    /* TFD_TIMER_ABSTIME for a timer armed with it on a wall clock
       (CLOCK_REALTIME, CLOCK_REALTIME_ALARM): it_value_ns is then its
       deadline on that clock, which the restart keeps, as the program asked;
       0 for every other timer (format 7; a pad before) */
    uint32_t settime_flags;
    uint64_t it_interval_ns;
    uint64_t it_value_ns;       /* 0: disarmed */
    uint64_t ticks;
    /* CK_FD_SIGNALFD: the signals it reads (bit N-1: signal N) */
    uint64_t sigmask;
    /* CK_FD_PIDFD: the process (or thread: O_EXCL, PIDFD_THREAD) it refers to,
       a pid in the job's pid namespace, which the restore keeps */
    int32_t target_pid;
    /* CK_FD_INOTIFY: the highest watch descriptor it ever gave out (the
       next one is that plus one: the restore makes it so), and its watches,
       nwatches ck_inotify_watch records in BLOB, in wd order */
    int32_t last_wd;
    uint32_t nwatches;
    uint32_t pad4;
    uint64_t watches_off;
    /* CK_FD_UDP, CK_FD_RAW: the protocol the socket was made with (SO_PROTOCOL:
       IPPROTO_UDP, IPPROTO_ICMP(V6), a raw socket's); sock_type, sock_family,
       sock_state, name and peer as for CK_FD_TCP */
    uint32_t sock_protocol;
    /* CK_FD_UDP, CK_FD_RAW: the multicast groups the socket joined, nmcast
       ck_mcast_group records in BLOB, joined again at restore */
    uint32_t nmcast;
    uint64_t mcast_off;
    /* CK_FD_UNIX with queued messages that carry descriptors (SCM_RIGHTS):
       nrights ck_rights records in BLOB, in queue order, each followed by
       its nfds int32 descriptor numbers (CK_FDF_IN_FLIGHT records of this
       image), padded to 8 bytes; the restore sends them again with them */
    uint64_t rights_off;
    uint32_t nrights;
    uint32_t pad5;
    /* CK_FD_PTY_MASTER, CK_FD_PTY_SLAVE: the pair's number (/dev/pts/N),
       the same after a restart (the job has a devpts instance of its own).
       A master also saves the pair's state: the slave's termios (struct
       termios2, TCGETS2), its window size (struct winsize), CK_PTY_* and
       the bytes the slave wrote that the master has not read (data_off,
       data_len) */
    uint32_t pty_index;
    uint32_t pty_state;         /* CK_PTY_* */
    uint8_t termios[44];
    uint16_t winsize[4];
    uint32_t pad6;
};

/* one multicast group a datagram socket joined (any source: one with a
   source filter is refused), joined again on the interface of that name */
struct ck_mcast_group {
    uint32_t family;            /* the group's: AF_INET, AF_INET6 */
    uint32_t ifindex;           /* informational: the index at checkpoint */
    uint8_t group[16];          /* the address (4 bytes for AF_INET) */
    char ifname[16];            /* the interface (IFNAMSIZ) */
};

/* one queued message of a Unix socket that carries descriptors */
struct ck_rights {
    uint64_t at;    /* a stream: the offset of its first byte in the saved bytes; else its record's index */
    uint32_t len;   /* its bytes (a stream: from `at` to the end of the kernel's buffer the descriptors ride on) */
    uint32_t nfds;  /* descriptor numbers that follow */
};

/* ck_fd.pty_state (CK_FD_PTY_MASTER) */
#define CK_PTY_LOCKED 0x1        /* TIOCGPTLCK: the slave cannot be opened (before unlockpt) */
#define CK_PTY_PACKET 0x2        /* TIOCGPKT: the master reads in packet mode */
#define CK_PTY_HUP 0x4           /* the slave was opened and every descriptor of it closed: the master reads EIO */

/* one inotify watch (CK_FD_INOTIFY), added again by path at restore */
struct ck_inotify_watch {
    int32_t wd;
    uint32_t mask;              /* as fdinfo shows it: events, IN_ONESHOT, IN_EXCL_UNLINK */
    uint64_t ino;               /* the watched inode, checked against the path */
    uint32_t path;              /* string offset: the path the kernel names it by now */
    uint32_t pad;
};

/* ck_file_lock.kind */
#define CK_LOCK_FLOCK 1
#define CK_LOCK_POSIX 2
#define CK_LOCK_OFD 3

/* one file lock, taken again at restore (flock, F_SETLK, F_OFD_SETLK) */
struct ck_file_lock {
    uint32_t kind;              /* CK_LOCK_* */
    uint32_t type;              /* F_RDLCK, F_WRLCK */
    uint64_t start;
    uint64_t len;               /* 0: to the end of the file */
};

struct ck_epoll_target {
    int32_t tfd;                /* the descriptor number it was registered under */
    uint32_t events;            /* as the kernel keeps them: EPOLLERR|EPOLLHUP added,
                                   only the flag bits left once EPOLLONESHOT fired */
    uint64_t data;
    /* a descriptor of the registered file in this process: tfd, or another
       one when tfd was closed (and maybe reused) after the registration;
       epoll knows a registration by (file, number), so the restore puts the
       file at tfd for the EPOLL_CTL_ADD, then puts back what tfd holds */
    int32_t holder;
    uint32_t pad;
};

/* one socket option's value as getsockopt returned it (in BLOB) */
struct ck_sockopt {
    int32_t level;
    int32_t name;
    uint32_t len;               /* bytes of val used */
    uint32_t pad;
    uint8_t val[16];            /* the largest: a struct timeval, a congestion control name */
};

/* rt_sigaction's kernel layout, one per signal 1..64 (index sig-1) */
struct ck_sigaction {
    uint64_t handler;
    uint64_t flags;
    uint64_t restorer;
    uint64_t mask;
};

struct ck_rlimit {
    uint64_t cur;
    uint64_t max;
};

/* a pending signal to raise again (tid 0: process-wide), one record per
 * queued instance, in queue order (an RT signal keeps its depth) */
struct ck_pending {
    int32_t tid;
    int32_t signo;
    /* issue 18: the siginfo as the kernel queued it (taken with a zero-timeout
       rt_sigtimedwait while parked and queued again at once), given back to
       rt_(tg)sigqueueinfo; has_info 0: one that arrived after the thread parked */
    uint32_t has_info;
    uint32_t pad;
    uint8_t info[128];
};

/* a file the job writes: contents copied to files/<index>.data */
#define CK_FILE_CONTENT_SAVED 0x1
struct ck_file {
    uint32_t path;
    uint32_t flags;
    uint32_t mode;
    uint32_t index;
    uint64_t dev;
    uint64_t ino;
    uint64_t size;
    int64_t mtime_ns;
};

struct ck_itimer {
    int64_t interval_sec;
    int64_t interval_usec;
    int64_t value_sec;
    int64_t value_usec;
};

/* issue 19: a POSIX timer (timer_create), ntimers of them in BLOB at
   ck_proc.timers_off, by ascending id; saved by native/shim/dump_timers.c,
   created again with the same id by native/restorer/timers.c */
#define CK_TIMER_NOTIFY_TID 4       /* SIGEV_THREAD_ID, or'ed into notify */
struct ck_posix_timer {
    int32_t id;                 /* the kernel's timer id (glibc's timer_t) */
    int32_t clock;              /* CLOCK_REALTIME, MONOTONIC, BOOTTIME or TAI */
    int32_t signo;
    int32_t notify;             /* SIGEV_SIGNAL or SIGEV_NONE, | CK_TIMER_NOTIFY_TID */
    int32_t tid;                /* SIGEV_THREAD_ID: the target thread */
    int32_t overrun_last;       /* timer_getoverrun(): the overrun of the last signal taken */
    uint64_t value;             /* sigev_value */
    int64_t interval_ns;
    int64_t remaining_ns;       /* until the next expiry, 0: disarmed */
};

/* issue 19: System V semaphore undo adjustments (semop with SEM_UNDO), as
   the shim tracks them (native/shim/eintr.c): nsemundo of them in BLOB at
   ck_proc.semundo_off.  CK_SEM_UNDO_ADJ: the process's semadj for (semid,
   semnum), non-zero, made again by the restorer with a semop of -adj with
   SEM_UNDO (restorer/semundo.c) on a set the plan made adj higher;
   ns: CLOCK_MONOTONIC when it became non-zero.  CK_SEM_UNDO_CLEAR: the
   process's last SETVAL, SETALL or IPC_RMID of set semid (-1: of any set,
   the latest of those a full table dropped) at ns, which clears
   every process's adjustments in the kernel: the agent refuses a
   checkpoint where one came after another process's adjustment began. */
#define CK_SEM_UNDO_ADJ 1
#define CK_SEM_UNDO_CLEAR 2
struct ck_sem_undo {
    int32_t semid;
    int32_t semnum;             /* CK_SEM_UNDO_CLEAR: -1 (a clear counts for the whole set) */
    int32_t adj;
    int32_t kind;
    int64_t ns;
};

struct ck_proc {
    int32_t pid;                /* inside the job's pid namespace */
    int32_t ppid;
    int32_t pgid;
    int32_t sid;
    int32_t host_pid;           /* informational */
    uint32_t umask;
    uint32_t nthreads;
    uint32_t personality;
    uint32_t exe;               /* string offsets */
    uint32_t cwd;
    uint32_t quiesce_signal;
    uint32_t job_depth;         /* directories from this image up to the job's (page sources) */
    uint64_t start_code;        /* mm fields for PR_SET_MM_MAP */
    uint64_t end_code;
    uint64_t start_data;
    uint64_t end_data;
    uint64_t start_brk;
    uint64_t brk;
    uint64_t start_stack;
    uint64_t arg_start;
    uint64_t arg_end;
    uint64_t env_start;
    uint64_t env_end;
    uint64_t exe_dev;
    uint64_t exe_ino;
    uint64_t restart_info;      /* address of the shim's struct ck_restart_info */
    uint64_t xcr0;              /* CPU state components the sigframes hold */
    struct ck_itimer itimers[3];
    char comm[16];
    int64_t ckpt_realtime_ns;
    int64_t ckpt_monotonic_ns;
    /* MEMBARRIER_CMD_GET_REGISTRATIONS: the MEMBARRIER_CMD_REGISTER_* commands
       the process issued, issued again by the restorer (per mm, lost with it) */
    uint64_t membarrier;
    /* process-wide attributes set again by the restorer (proc.c), issue 18 */
    int32_t oom_score_adj;      /* /proc/self/oom_score_adj */
    uint32_t loginuid;          /* /proc/self/loginuid (audit) */
    uint32_t child_subreaper;   /* PR_GET_CHILD_SUBREAPER */
    uint32_t thp_disable;       /* PR_GET_THP_DISABLE's value */
    uint32_t dumpable;          /* PR_GET_DUMPABLE */
    uint32_t ngroups;           /* supplementary groups: ngroups uint32 in BLOB at groups_off */
    uint64_t groups_off;
    /* a working directory that was removed (its path ends in " (deleted)"):
       made again empty with this mode and owner, entered, removed again */
    uint32_t cwd_deleted;
    uint32_t cwd_mode;
    uint32_t cwd_uid;
    uint32_t cwd_gid;
    /* issue 19: POSIX timers, ntimers struct ck_posix_timer in BLOB at
       timers_off; next_timer_id is the id the next timer_create returns
       (-1: unknown, the kernel cannot set ids); timer_restore_ids is the
       process's PR_GET_TIMER_CREATE_RESTORE_IDS */
    uint32_t ntimers;
    int32_t next_timer_id;
    uint64_t timers_off;
    uint32_t timer_restore_ids;
    uint32_t pad_timers;
    /* issue 19: the controlling terminal when it is one of the job's
       pseudo-terminals (ctty_kind CK_FD_PTY_MASTER or CK_FD_PTY_SLAVE; 0:
       none), its number and its foreground process group (tpgid): given
       back by the session's leader before it forks (plan_tree.c) */
    uint32_t ctty_kind;
    uint32_t ctty_index;
    int32_t ctty_pgrp;
    uint32_t pad_ctty;
    /* issue 19: System V semaphore undo adjustments and clears, nsemundo
       struct ck_sem_undo in BLOB at semundo_off */
    uint32_t nsemundo;
    uint32_t pad_semundo;
    uint64_t semundo_off;
};

/*
 * Encryption at rest (launch --encrypt): a sealed file and its sidecar.
 *
 * A sealed file (pages.img, files/N.data, a checkpoint's output.log and
 * output.idx) holds AES-256-GCM ciphertext of exactly the plaintext's
 * length: GCM is counter mode, so every offset into it (core.img's page
 * runs, an incremental image's runs into an earlier pages.img, a lazy
 * fill window) is the same as without encryption.  The file is cut into
 * chunks of chunk_size bytes (the last one shorter); chunk i is one GCM
 * message with IV = nonce_prefix || i (4 bytes, big-endian) and no AAD.
 * Its 16-byte tag lives in the sidecar, "<file>.gcm": this header, then
 * one tag per chunk, in order.  A reader reads whole chunks, checks the
 * tag, then uses the plaintext.  The checksums in the manifest are over
 * the bytes on disk (ciphertext and sidecar), so verifying a checkpoint
 * needs no key.
 */
#define CK_GCM_MAGIC 0x314d4347544b5043    /* "CPKTGCM1" as little-endian bytes */
#define CK_GCM_VERSION 1
#define CK_GCM_CHUNK 65536                  /* lazy windows (256 KiB, 1 MiB) are whole chunks */

struct ck_gcm_header {
    uint64_t magic;             /* a sidecar, of this layout */
    uint32_t version;
    uint32_t chunk_size;        /* bytes per tag: a reader decrypts whole chunks */
    uint64_t file_size;         /* the sealed file's size: a file cut at a chunk boundary is caught */
    uint8_t nonce_prefix[8];    /* random per file: with the chunk index, no IV repeats under one key */
};
/* END CFFI */

/*
 * Filled by the restorer inside the restored shim's memory before the first
 * restored instruction runs; the shim's checkpoint thread reads it to finish
 * the restart (unmap the restorer, reconnect to the agent).
 */
#define CK_RESTART_MAGIC 0x5452415453455243ull  /* "CRESTART" */
struct ck_restart_info {
    uint64_t magic;
    uint64_t hole_start;        /* restorer region to unmap */
    uint64_t hole_len;
    uint32_t nthreads;          /* threads that will report in */
    uint32_t arrived;           /* futex: threads that reached shim code */
    char agent_socket[108];
    char checkpoint_id[64];
    int32_t lazy_uffd;          /* restart --lazy: the userfaultfd the agent takes, else -1 */
    /* the restorer's write-protect userfaultfd, armed on the restored
       memory before anything ran (common/track_arm.h), else -1: the shim
       tracks the pages from there (ADOPT); a shim before it had padding here */
    int32_t track_uffd;
};

#endif
