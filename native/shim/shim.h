/*
 * libckptd.so internals.
 *
 * The shim is LD_PRELOADed into every process of a job.  At load it starts a
 * checkpoint thread that holds a Unix-socket connection to the node agent and
 * obeys QUIESCE / DUMP / RESUME / ABORT.  Everything the checkpoint thread
 * does while the other threads are parked uses raw system calls (sys.h) and
 * the scratch arena: never malloc, stdio or any libc lock, since a parked
 * thread may hold one.
 */
#ifndef CKPTD_SHIM_H
#define CKPTD_SHIM_H

#include <errno.h>
#include <stddef.h>
#include <stdint.h>

#include "../include/ckptd/image_format.h"

#define CK_HIDDEN __attribute__((visibility("hidden")))
#define CK_MAX_THREADS 4096
#define CK_ERR_CAP 512

/* ---- shim.c: process-wide state ---- */
struct ck_shim_state {
    int active;               /* launched under ckptd and registered */
    int agent_fd;             /* connection to the agent, or -1 */
    int quiesce_signal;
    int hide_io_uring;        /* io_uring_setup() through syscall() says ENOSYS */
    int track_mode;           /* CK_TRACK_*: how incremental dumps find changed pages */
    int capture_sync;         /* CKPTD_CAPTURE=sync: write every page during the pause */
    const char *fault;        /* CKPTD_FAULT: a test's fault point for the writer (ckptd/faults.py) */
    int lazy_fd;              /* restart --lazy: the restorer's userfaultfd until RESUME, or -1 */
    volatile uint32_t lazy_pending;  /* futex: 1 until LAZY_DONE (memory still being filled) */
    int unverified;           /* restored and parked until an agent's RESUME: never released otherwise */
    volatile int busy;        /* the checkpoint thread is carrying out a command (sigterm.c's bound waits) */
    char job[128];
    char socket_path[108];
};
extern struct ck_shim_state ck_shim CK_HIDDEN;
extern struct ck_restart_info ck_restart CK_HIDDEN;

/* ---- lazy.c: after restart --lazy, 1 while the pager still fills memory ---- */
int ck_lazy_filling(void) CK_HIDDEN;

/* ---- ctx.S ---- */
int ck_save_ctx(struct ck_jmpctx *ctx) CK_HIDDEN __attribute__((returns_twice));

/* ---- arena.c: scratch memory excluded from every image ---- */
struct ck_table {
    char *base;
    size_t elem;      /* record size; 1 for byte buffers */
    size_t count;     /* records used */
    size_t cap;       /* records available */
};
int ck_arena_setup(void) CK_HIDDEN;
void ck_arena_reset(void) CK_HIDDEN;   /* give the pages back after a dump */
/* 1: a fork copies the arena (the page writer needs its tables); 0: wiped again */
int ck_arena_inherit(int on) CK_HIDDEN;
int ck_arena_contains(uint64_t start, uint64_t end) CK_HIDDEN;
/* carve a table of `cap` records of `elem` bytes out of the arena */
int ck_table_init(struct ck_table *t, size_t elem, size_t cap) CK_HIDDEN;
void *ck_table_push(struct ck_table *t) CK_HIDDEN;        /* zeroed record or NULL */
void *ck_table_at(struct ck_table *t, size_t i) CK_HIDDEN;
uint64_t ck_table_bytes_append(struct ck_table *t, const void *p, size_t n) CK_HIDDEN;
void *ck_arena_alloc(size_t n) CK_HIDDEN;
/* the part kept from one dump to the next */
void *ck_arena_keep(size_t *size) CK_HIDDEN;
/* where smaps read before parking goes */
void *ck_arena_premaps(size_t *size) CK_HIDDEN;
/* where a small incremental image's pages wait for FLUSH (writeout.c) */
void *ck_arena_stage(size_t *size) CK_HIDDEN;

/* ---- quiesce.c ---- */
int ck_quiesce_install(int sig) CK_HIDDEN;
/* park every other thread; 0 or -1 with err filled */
int ck_quiesce(long timeout_ms, char *err, size_t errcap) CK_HIDDEN;
void ck_release(void) CK_HIDDEN;
int ck_is_parked(void) CK_HIDDEN;
void ck_quiesce_after_fork(void) CK_HIDDEN;  /* a forked child starts outside any checkpoint */
/* records of the parked threads, valid while parked */
struct ck_thread *ck_parked_threads(uint32_t *n) CK_HIDDEN;
/* quiesce.c: pending signals taken with their siginfo and queued again */
#define CK_TAKE_OWN 1     /* the calling thread's own queue */
#define CK_TAKE_SHARED 2  /* the process-wide queue */
void ck_take_pending(int which) CK_HIDDEN;
struct ck_pending *ck_taken_pending(uint32_t *n, uint32_t *failed, const int64_t **at) CK_HIDDEN;
int ck_take_all_pending(void) CK_HIDDEN;
/* dump_timers.c: POSIX timers */
const char *ck_timers_refusal(int strict) CK_HIDDEN;
/* sigev_thread.c: SIGEV_THREAD timers run by the shim's own helper thread */
int32_t ck_sigev_helper_tid(void) CK_HIDDEN;  /* 0: none in this process */
void ck_sigev_after_fork(void) CK_HIDDEN;
long ck_timer_requeue_taken(const uint8_t *info, int64_t *at) CK_HIDDEN;
void ck_fill_thread(struct ck_thread *t, uint64_t sigmask) CK_HIDDEN;
/* after a restore: wait until every parked thread is back in shim code */
void ck_wait_threads_arrived(uint32_t n) CK_HIDDEN;

/* ---- dump.c ---- */
#define CK_DUMP_OK 0
#define CK_DUMP_ERROR 1
#define CK_DUMP_RESTORED 2
#define CK_DUMP_RETRY 3 /* a passing state (fds in flight): the same dump moments later may succeed */
struct ck_dump_stats {
    uint64_t pages_bytes;
    uint64_t core_bytes;
    uint64_t files_bytes;
    uint64_t ref_bytes;        /* pages taken from earlier images instead of written */
    uint32_t nvmas;
    uint32_t nthreads;
    uint32_t nfds;
    uint32_t nfiles;
    uint32_t capture;          /* how its pages were written: CK_CAPTURE_* (writeout.c) */
    int64_t duration_ns;
};
/* base: the checkpoint the agent expects this one to build on ("" for a
 * full image); self: this image's directory relative to the job's, under
 * its final name; depth: how many levels that is */
struct ck_dump_args {
    const char *dir;
    const char *base;
    const char *self;
    uint32_t depth;
    int keep_cached;  /* 1: the agent reads pages.img again (dedup): the writer leaves it cached */
    int no_writer;    /* 1: the copy a writer could cost might not fit in memory (agent/capture_budget.py) */
    int dedup;        /* launch --dedup: CK_DEDUP_SOURCE (rank 0) or CK_DEDUP_COMPARE (another rank) */
    char *key_hex;    /* launch --encrypt: the key, 64 hex digits inside the command line (wiped once read), or NULL */
};
int ck_dump(const struct ck_dump_args *a, struct ck_dump_stats *st, char *err, size_t errcap) CK_HIDDEN;

/* the image being built; sections are tables in the arena */
struct ck_image {
    int dirfd;
    int core_fd;              /* core.img made before the pause (image_dir.c), or -1 */
    int pages_fd;             /* pages.img.part, flock()ed until it is complete */
    int diag_fd;              /* NETLINK_SOCK_DIAG while descriptors are described */
    int own_fds[8];           /* the shim's descriptors: never part of the image */
    int n_own_fds;
    int keep_cached;          /* ck_dump_args.keep_cached */
    int no_writer;            /* ck_dump_args.no_writer: pages written during the pause (or staged) */
    int dedup;                /* ck_dump_args.dedup (writeout_dedup.c) */
    const struct ck_gcm_key *key;  /* launch --encrypt: in the arena (never in an image); NULL: plain */
    uint8_t prefix[8];        /* pages.img's nonce prefix (image_format.h, CK_GCM_*) */
    struct ck_proc proc;
    struct ck_table threads, vmas, runs, fds, epoll, pending, files, strings, blob, sources;
    char auxv[1024];
    size_t auxv_len;
    char *err;
    size_t errcap;
    int retry; /* the failure recorded last is a passing state: worth another round (ck_image_passing) */
};
uint32_t ck_image_string(struct ck_image *im, const char *s) CK_HIDDEN;
int ck_dump_timers(struct ck_image *im, struct ck_pending *taken, const int64_t *at, uint32_t ntaken) CK_HIDDEN;
/* quiesce.c: a registration the program made itself with syscall(SYS_rseq) */
void ck_rseq_registered(long area, uint32_t len, int flags, uint32_t sig) CK_HIDDEN;
int ck_image_fail(struct ck_image *im, const char *what, const char *detail, long rc) CK_HIDDEN;
/* the failure just recorded is a passing state (a connection not yet accepted,
 * descriptors in flight): the shim says ERROR retry=1 and the coordinator runs
 * the round again (coordinator/barrier.py).  Returns rc. */
int ck_image_passing(struct ck_image *im, int rc) CK_HIDDEN;
int ck_image_is_own_fd(struct ck_image *im, int fd) CK_HIDDEN;
void ck_image_add_own_fd(struct ck_image *im, int fd) CK_HIDDEN;

/* ---- image_dir.c: the image's directory and files, made before the pause ---- */
/* PREMAP dir=: open it and create core.img, pages.img.part and files/ (best effort) */
void ck_image_dir_prepare(const char *dir) CK_HIDDEN;
/* DUMP dir=: 0 and im's dirfd, core_fd and pages_fd set if dir is the one
 * prepared (by this process, with its ids now); else -1, nothing kept */
int ck_image_dir_take(const char *dir, struct ck_image *im) CK_HIDDEN;
void ck_image_dir_drop(void) CK_HIDDEN;        /* close what was not taken */
void ck_image_dir_after_fork(void) CK_HIDDEN;  /* in a child: its copies closed */

/* ---- track.c: pages written since the last image ---- */
#define CK_SOURCE_PATH 256
/* CKPTD_TRACK: auto (the default) write-protects with userfaultfd and falls
 * back to page hashes where the kernel refuses it; uffd and hash force one */
enum { CK_TRACK_AUTO, CK_TRACK_UFFD, CK_TRACK_HASH, CK_TRACK_OFF };
void ck_track_forget(void) CK_HIDDEN;
int ck_track_hashing(void) CK_HIDDEN;
uint64_t ck_page_hash(const void *page) CK_HIDDEN;
int ck_track_prev_hash(uint64_t vaddr, uint64_t *hash) CK_HIDDEN;
int ck_track_begin(struct ck_image *im, const char *base, const char *self) CK_HIDDEN;
int ck_track_incremental(void) CK_HIDDEN;
/* 1: the last image's pages are tracked, so the next one can be incremental */
int ck_track_armed(void) CK_HIDDEN;
int ck_track_registered(uint64_t start, uint64_t end, uint32_t vmflags) CK_HIDDEN;
const struct ck_page_run *ck_track_lookup(uint64_t vaddr, uint64_t *next) CK_HIDDEN;
uint32_t ck_track_source(struct ck_image *im, uint32_t prev_src) CK_HIDDEN;
void ck_track_commit(struct ck_image *im, uint64_t pages_size) CK_HIDDEN;
int ck_track_rebase(const char *core_path, const char *self) CK_HIDDEN;
/* restored: the restorer's protection (its descriptor, or -1), then the image it came from */
void ck_track_restored(int track_uffd) CK_HIDDEN;
int ck_track_adopt(const char *core_path, const char *self) CK_HIDDEN;

/* ---- writeout.c: pages written after the job resumes ---- */
struct ck_iov {
    const void *base;
    size_t len;
};
#define CK_IOV_BATCH 1024  /* runs per pwritev: scattered dirty pages are one page each */
int ck_pwritev_all(int fd, struct ck_iov *iov, int n, uint64_t off) CK_HIDDEN;
/* [vaddr, vaddr+len) of a PROT_NONE mapping to `off` in fd, through
 * /proc/self/mem (which ignores protections) and a 1 MiB buffer */
int ck_copy_unreadable(int fd, int mem_fd, char *buf, uint64_t vaddr, uint64_t len, uint64_t off) CK_HIDDEN;
/* 1 if a forked copy of the process sees this mapping's pages as they are now */
int ck_vma_written_later(const struct ck_vma *v) CK_HIDDEN;
/* fork the writer of the mappings left for later (or stage them, or write them now) */
int ck_writeout_start(struct ck_image *im, const char *dir) CK_HIDDEN;
enum { CK_CAPTURE_PAUSE = 0, CK_CAPTURE_WRITER = 1, CK_CAPTURE_STAGED = 2 };
int ck_writeout_mode(void) CK_HIDDEN;  /* how the last ck_writeout_start did it */
/* wait for the writer: 0 written, 1 none running, -1 failed (err filled);
 * key_hex: FLUSH's key=, which staged pages of an encrypted job need */
int ck_writeout_flush(char *err, size_t errcap, char *key_hex) CK_HIDDEN;
/* the writer, waiting at its gate since the dump, may start (writeout.c) */
void ck_writeout_go(void) CK_HIDDEN;
/* in a forked child: forget the parent's writer, gate and staged pages */
void ck_writeout_after_fork(void) CK_HIDDEN;
/* Encryption at rest: the key a command carries (64 hex digits, wiped in
 * place) expanded into the arena; NULL when hex is NULL or malformed
 * (*bad set).  ck_seal_begin makes every write to im->pages_fd go out
 * encrypted (the pause's writes); ck_seal_end stops it. */
struct ck_gcm_key;
const struct ck_gcm_key *ck_seal_take_key(char *hex, int *bad) CK_HIDDEN;
/* in (read to its end) sealed into out, its tags into `name`.gcm (in the
 * image directory); 0 or -errno */
int ck_seal_copy_file(struct ck_image *im, int in, int out, const char *name) CK_HIDDEN;
int ck_seal_begin(struct ck_image *im) CK_HIDDEN;
void ck_seal_end(void) CK_HIDDEN;
/* the parts of the checkpoint thread's stack the crypto used, zeroed */
void ck_seal_scrub_stack(void) CK_HIDDEN;
void ck_writeout_discard(void) CK_HIDDEN;

/* ---- checksum.c: pages.img's xxh3-128, computed by the writer ---- */
/* the digest the writer leaves on pages.img ("HEX SIZE"); the agent reads
 * it (ckptd/image/checksum.py WRITER_XATTR) */
#define CK_CHECKSUM_XATTR "user.ckptd.xxh3_128"
struct ck_checksum {
    int on;       /* 0: not hashing (no library, or out of order) */
    uint64_t at;  /* the file offset hashed up to */
};
void ck_checksum_load(void) CK_HIDDEN;  /* in the constructor: dlopen libxxhash */
int ck_checksum_start(struct ck_checksum *s) CK_HIDDEN;
/* bytes at file offset `off`; anything but the next offset stops the hash */
void ck_checksum_add(struct ck_checksum *s, uint64_t off, const void *p, uint64_t len) CK_HIDDEN;
/* bytes already in the file, read back through buf */
int ck_checksum_add_file(struct ck_checksum *s, int fd, char *buf, size_t cap, uint64_t off, uint64_t len) CK_HIDDEN;
/* the digest onto fd's file if all of it was hashed (best effort) */
void ck_checksum_finish(struct ck_checksum *s, int fd) CK_HIDDEN;
/* xxh3-64 of a page, for writeout_dedup.c; NULL without the library */
typedef uint64_t (*ck_page_hash_fn)(const void *p, size_t n);
ck_page_hash_fn ck_checksum_page_hash(void) CK_HIDDEN;

/* ---- writeout_dedup.c: a rank's writer leaves out the pages rank 0 holds ---- */
#define CK_DEDUP_SOURCE 1   /* rank 0: its writer says how far it has written */
#define CK_DEDUP_COMPARE 2  /* another rank: its writer compares with rank 0's pages */
/* rank 0's writer: pages.progress in dirfd, or -1; then how far it has
 * written, in file order (~0: all of it) */
int ck_dedup_progress_open(int dirfd) CK_HIDDEN;
void ck_dedup_progress(int fd, uint64_t upto) CK_HIDDEN;
struct ck_dedup;
/* in the writer: wait for the agent's dedup.spec in dirfd and index rank
 * 0's pages it names; NULL: write every page (no spec, "none", a bad one) */
struct ck_dedup *ck_dedup_begin(int dirfd) CK_HIDDEN;
/* the `npages` pages at `mem`, going to file offset `off`, one page run of
 * the image: out(ctx, off, mem, len, held) for each stretch in order, held
 * 1 where rank 0 holds it (recorded in pages.match, left a hole); the
 * first nonzero out() is returned */
typedef int (*ck_dedup_out_fn)(void *ctx, uint64_t off, const char *mem, uint64_t len, int held);
int ck_dedup_run(struct ck_dedup *dd, uint64_t off, const char *mem, uint64_t npages, ck_dedup_out_fn out,
                 void *ctx) CK_HIDDEN;
/* pages.match complete ("done" line); 0 or -errno */
int ck_dedup_end(struct ck_dedup *dd) CK_HIDDEN;

/* ---- dump_mem.c ---- */
/* read smaps while the job still runs: parsing it is slow for big mappings */
int ck_premaps_capture(void) CK_HIDDEN;
/* a raw system call's result as the libc function it stands in for returns
 * it: -1 with errno set on failure (the shim's own libc entry points) */
static inline int ck_libc_int(long rc)
{
    if (rc < 0) {
        errno = (int)-rc;
        return -1;
    }
    return (int)rc;
}

/* madvise or mlock was called: the early copy may be stale (dump_mem.c) */
void ck_premaps_stale(void) CK_HIDDEN;
int ck_dump_memory(struct ck_image *im, uint64_t *pages_bytes, uint64_t *files_bytes, uint64_t *ref_bytes) CK_HIDDEN;

/* ---- dump_fds.c ---- */
int ck_dump_fds(struct ck_image *im) CK_HIDDEN;
int ck_fail_fd(struct ck_image *im, int fd, const char *why, const char *target) CK_HIDDEN;

/* ---- dump_epoll.c ---- */
int ck_dump_epoll(struct ck_image *im, struct ck_fd *f, const char *fdinfo) CK_HIDDEN;
int ck_dump_epoll_holders(struct ck_image *im) CK_HIDDEN;

/* ---- dump_sockopts.c ---- */
/* kind: CK_SO_* bits (native/common/sockopts.h) */
int ck_dump_sockopts(struct ck_image *im, struct ck_fd *f, int fd, unsigned kind) CK_HIDDEN;

/* ---- dump_sockets.c ---- */
int ck_sock_diag_open(void) CK_HIDDEN;
int ck_dump_socket(struct ck_image *im, struct ck_fd *f, int diag_fd, const char *target) CK_HIDDEN;
int ck_peek_queue(struct ck_image *im, struct ck_fd *f, int fd) CK_HIDDEN;
/* the copies of descriptors in flight the last dump took (kept until RESUME or ABORT) */
int ck_flight_has(int fd) CK_HIDDEN;
uint32_t ck_flight_count(void) CK_HIDDEN;
int ck_flight_fd(uint32_t i) CK_HIDDEN;
void ck_flight_describing(int on) CK_HIDDEN;
void ck_flight_close(void) CK_HIDDEN;
void ck_flight_forget(void) CK_HIDDEN;

/* ---- dump_tcp.c ---- */
int ck_dump_tcp(struct ck_image *im, struct ck_fd *f, int family, const char *target) CK_HIDDEN;
/* ---- dump_dgram.c ---- */
int ck_dump_dgram(struct ck_image *im, struct ck_fd *f, int family, int type, const char *target) CK_HIDDEN;
/* let unsent TCP bytes leave, for up to timeout_ms (0: just look); returns
 * how many sockets still hold some (any past the ones it can track count) */
int ck_tcp_settle(int timeout_ms) CK_HIDDEN;
/* whether the process's IPC namespace holds any System V object (1 when it cannot tell) */
int ck_sysv_objects(void) CK_HIDDEN;

/* ---- files.c ---- */
void ck_files_track_fd(int fd) CK_HIDDEN;
int ck_dump_files(struct ck_image *im, uint64_t *bytes) CK_HIDDEN;
/* a file the job changes through a shared writable mapping */
int ck_save_written_file(struct ck_image *im, const char *path, uint64_t *bytes) CK_HIDDEN;
/* a memfd or deleted tmpfs file held open: files/shm-<ino>.data, holes kept */
int ck_save_shmem_fd(struct ck_image *im, struct ck_fd *f) CK_HIDDEN;
/* any file held open, read through a new description: PREFIX<ino>.data, holes kept */
int ck_save_fd_contents(struct ck_image *im, struct ck_fd *f, const char *prefix) CK_HIDDEN;
/* the contents of the file LINK opens (a /proc/self/fd or map_files link), SIZE bytes,
 * to <prefix><ino>.data in the image directory, once */
int ck_save_contents(struct ck_image *im, const char *link, uint64_t ino, uint64_t size, const char *prefix) CK_HIDDEN;
struct stat;
/* pseudo-terminals and a controlling terminal that is one (dump_pty.c) */
int ck_is_pty(int fd, const struct stat *st) CK_HIDDEN;
int ck_dump_pty(struct ck_image *im, struct ck_fd *f, const char *target, const struct stat *st) CK_HIDDEN;
int ck_dump_ctty(struct ck_image *im, struct ck_proc *p, uint64_t tty_nr, int64_t tpgid) CK_HIDDEN;
/* an inotify descriptor's watches, by path (dump_inotify.c) */
int ck_dump_inotify(struct ck_image *im, struct ck_fd *f, const char *fdinfo, const char *target) CK_HIDDEN;
/* an open file or directory whose name was removed, not on tmpfs (dump_deleted.c) */
int ck_dump_deleted(struct ck_image *im, struct ck_fd *f, const char *target, const struct stat *st) CK_HIDDEN;
struct ck_map_entry;
/* a MAP_SHARED mapping of such a file (dump_deleted.c) */
int ck_dump_deleted_mapping(struct ck_image *im, struct ck_vma *v, const struct ck_map_entry *e) CK_HIDDEN;

/* ---- interpose.c ---- */
void ck_interpose_init(void) CK_HIDDEN;

/* ---- eintr.c: blocking calls resumed after a checkpoint ---- */
struct sigaction;
typedef int (*ck_sigaction_fn)(int, const struct sigaction *, struct sigaction *);

/* ---- sigterm.c: a SIGTERM at its default disposition held for the agent ---- */
struct ck_kernel_sigaction;
void ck_term_install(void) CK_HIDDEN;    /* in the constructor: hide the handler if SIGTERM is SIG_DFL */
void ck_term_restored(void) CK_HIDDEN;   /* after a restore: holds end, the handler goes back */
void ck_term_decide(int hold) CK_HIDDEN; /* the agent's TERM_HOLD (1) or TERM_DELIVER (0); a dropped connection: 0 */
int ck_term_hidden(void) CK_HIDDEN;      /* 1: a pending SIGTERM is never saved (it is this incarnation's) */
/* the kernel's action as a checkpoint records it: the program's view, never the hidden handler */
void ck_term_image_action(struct ck_kernel_sigaction *k) CK_HIDDEN;
int ck_term_sigaction(const struct sigaction *act, struct sigaction *old, ck_sigaction_fn real) CK_HIDDEN;
void ck_eintr_init(void) CK_HIDDEN;  /* the real functions, from the constructor */
extern volatile int ck_sem_undo_used CK_HIDDEN;  /* eintr.c's SEM_UNDO tables overflowed */
void ck_sem_undo_init(void) CK_HIDDEN;           /* from the constructor: CKPTD_SEM_UNDO, kept over exec */
void ck_sem_undo_after_fork(void) CK_HIDDEN;     /* the child of a fork has no adjustments */
int ck_dump_sem_undo(struct ck_image *im) CK_HIDDEN;  /* the process's SEM_UNDO adjustments, for its image */
/* the quiesce handler, as it returns; parked_at: CLOCK_MONOTONIC when it parked, or 0 */
void ck_eintr_quiesced(int64_t parked_at) CK_HIDDEN;
/* the interposed sigaction: the program's handlers are counted per thread */
int ck_eintr_sigaction(int sig, const struct sigaction *act, struct sigaction *old, ck_sigaction_fn real) CK_HIDDEN;
/* syscall(SYS_futex, ...): waits with a timeout resumed; raw result */
long ck_eintr_futex(long uaddr, long op, long val, long timeout, long a4, long a5) CK_HIDDEN;

/* a raw thread running fn(arg) on the stack below stack_top (writeout.c) */
#define CK_THREAD_FLAGS 0x50f00  /* CLONE_VM|FS|FILES|SIGHAND|THREAD|SYSVSEM */
#define CK_FILES_OWN 0x400       /* CLONE_FILES: left out, the thread's closes are not the process's */
long ck_writer_thread(void *stack_top, void (*fn)(void *), void *arg, unsigned long flags) CK_HIDDEN;

#endif
