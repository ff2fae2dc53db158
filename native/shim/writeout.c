/*
 * Writing an image's pages after the job runs again: copy-on-write capture.
 *
 * While every thread is parked, dump_mem.c decides which pages go into
 * pages.img and where (the page runs).  It writes at once only what a forked
 * copy of the process would not see as it is now: shared mappings (the job
 * changes them in place), MADV_DONTFORK and MADV_WIPEONFORK mappings, and
 * private mappings of deleted files.  Then the checkpoint thread forks a
 * writer, a copy of the process whose memory stays as it was at the fork
 * (the kernel copies a page the job writes before the writer has read it),
 * and the job resumes.  The writer fills pages.img.part, renames it to
 * pages.img and exits.
 *
 * The writer is a clone child with exit signal 0: the job's wait() never
 * sees it, and its exit sends no SIGCHLD.  It closes every descriptor but
 * the three it needs, so that it keeps none of the job's files open.  It
 * waits at a gate, a pipe, until FLUSH, which the agent sends once every
 * rank of the round runs again (or until ABORT, DISCARD, the agent's
 * connection lost, the process's end, or GATE_MAX_MS).  On a node with
 * fewer cores than ranks, writers that started as soon as their own
 * process was dumped, or resumed, took the cores that the other ranks'
 * dumps and resumes needed, and every rank's pause lasts until the last
 * rank resumes (BENCHMARKS.md, "writers that wait for the round").  It holds
 * an flock on pages.img.part until it exits, so that the agent can wait for
 * it even after its parent is gone.  The checkpoint thread reaps it on FLUSH,
 * kills it on ABORT or DISCARD, and the shim's destructor waits for it when
 * the process exits, so that an exit right after a checkpoint still leaves
 * a finished image.
 *
 * An incremental image small next to the memory a fork would have to copy
 * the page tables of is staged instead: its pages are copied, during the
 * pause, into the arena's staging area (memory copy speed, no page faults:
 * the area stays resident from one checkpoint to the next), and FLUSH
 * writes them out from there while the job runs.  One bigger than the area
 * is written during the pause.
 *
 * CKPTD_CAPTURE=sync, a fork the kernel refuses (memory), or an agent that
 * says the copy might not fit in memory (DUMP sync=1, agent/capture_budget.py)
 * writes the same pages during the pause (or stages a small image).
 *
 * Encryption at rest (launch --encrypt, image_format.h CK_GCM_*): DUMP
 * carries the key, expanded into the arena (which no image holds).  Every
 * byte goes to pages.img as AES-256-GCM ciphertext at its own offset:
 * the pause's writes through `seal.buf`, the writer's and the staged ones
 * encrypted where they are copied anyway (the bounce buffer, the staging
 * area).  The writer tags each 64 KiB chunk as it writes in file order
 * (reading back what the pause wrote, as it does to hash it), the other
 * paths tag the finished file by reading it back; the tags go to
 * pages.img.gcm before pages.img is named.  The checksum is over the
 * ciphertext.  Staged pages wait in the clear in the arena until FLUSH,
 * which carries the key again.
 */
#include "shim.h"
#include "../common/sys.h"
#include "../common/util.h"
#include "../common/sealed.h"

#include <errno.h>
#include <sys/file.h>
#include <sys/prctl.h>
#include <sys/wait.h>

#define BOUNCE_SIZE (1u << 20)

#define STAGE_INDEX (2u << 20)  /* the staging area's head: where each staged piece goes */

static volatile int writer_pid;      /* 0: none */
static int gate_fd = -1;             /* the write end of the writer's gate; -1: open */
/* A gate nobody opens (a coordinator lost after RESUME) must not keep the
 * writer's copy of the job's memory for ever: it opens by itself then */
#define GATE_MAX_MS 60000

/* pages staged for FLUSH: `len` bytes at `off` in pages.img, one after the
 * other in the staging area after its index */
struct staged_piece {
    uint64_t off;
    uint64_t len;
};
static struct {
    int pages_fd;  /* pages.img.part; -1: nothing staged */
    int dirfd;
    uint64_t npieces;
    int sealed;         /* encrypted job: FLUSH brings the key */
    uint8_t prefix[8];  /* the image's nonce prefix */
} staged = {-1, -1, 0, 0, {0}};
static int staged_claimed;  /* FLUSH and the exit destructor: one of them writes */
static int capture_mode;     /* CK_CAPTURE_* of the last image */

int ck_writeout_mode(void) { return capture_mode; }
static char writer_dir[4096];        /* its image directory, for FLUSH's messages */
static char *bounce;
static char *pipe_other;  /* the encrypting writer's first bounce buffer (bounce's other is seal.buf2) */

int ck_vma_written_later(const struct ck_vma *v)
{
    if (v->flags & (CK_VMA_SHARED | CK_VMA_DELETED | CK_VMA_NOCONTENT))
        return 0;
    return !(v->madv & (CK_MADV_DONTFORK | CK_MADV_WIPEONFORK));
}

static int pwritev_raw(int fd, struct ck_iov *iov, int n, uint64_t off);
struct writeback;
static void follow_writeback(int fd, struct writeback *w, uint64_t end);

/* encryption at rest: the image whose pages file this process writes
 * encrypted now (NULL: none), and where the ciphertext is made */
static struct {
    struct ck_image *im;
    char *buf;  /* BOUNCE_SIZE, arena */
    char *buf2; /* the writer's second bounce buffer (arena) */
    struct ck_sealer *sealer;  /* arena */
} seal;

/* The encrypting writer runs two threads: the writer's own copies and
 * encrypts its pieces into one bounce buffer and tags them, while a second
 * thread hashes the other buffer, writes it and follows its writeback.
 * One buffer at a time is handed over (`busy`, a futex: 0 idle, 1 a buffer
 * is being written, 2 stop). */
static struct {
    volatile uint32_t busy;
    const char *buf;
    uint64_t off;
    size_t fill;
    int fd;
    int err;
    struct writeback *wb;
    struct ck_checksum *sum;
} wpipe;

/* a thread of this process (clone FLAGS: shared memory, and descriptors
 * unless CLONE_FILES is left out; no TLS of its own: nothing it runs reads
 * any) on `stack`, running fn(arg), then exiting alone; its id, or -errno */
__asm__(".text\n"
        ".globl ck_writer_thread\n"
        ".hidden ck_writer_thread\n"
        ".type ck_writer_thread,@function\n"
        "ck_writer_thread:\n"
        "    sub $16, %rdi\n"
        "    mov %rdx, 0(%rdi)\n"    /* arg */
        "    mov %rsi, 8(%rdi)\n"    /* fn */
        "    mov %rdi, %rsi\n"       /* the child's stack */
        "    mov %rcx, %rdi\n"       /* flags */
        "    xor %edx, %edx\n"
        "    xor %r10d, %r10d\n"
        "    xor %r8d, %r8d\n"
        "    mov $56, %eax\n"        /* SYS_clone */
        "    syscall\n"
        "    test %rax, %rax\n"
        "    jnz 1f\n"
        "    pop %rdi\n"
        "    pop %rax\n"
        "    call *%rax\n"
        "    mov $60, %eax\n"        /* SYS_exit: this thread only */
        "    xor %edi, %edi\n"
        "    syscall\n"
        "1:  ret\n"
        ".size ck_writer_thread, .-ck_writer_thread\n");

static void pipe_thread(void *unused)
{
    (void)unused;
    for (;;) {
        uint32_t b = __atomic_load_n(&wpipe.busy, __ATOMIC_ACQUIRE);
        if (b == 0) {
            ck_futex_wait(&wpipe.busy, 0, -1);
            continue;
        }
        if (b == 2)
            return;
        ck_checksum_add(wpipe.sum, wpipe.off, wpipe.buf, wpipe.fill);
        struct ck_iov one = {wpipe.buf, wpipe.fill};
        int rc = pwritev_raw(wpipe.fd, &one, 1, wpipe.off);
        if (rc && !wpipe.err)
            wpipe.err = rc;
        follow_writeback(wpipe.fd, wpipe.wb, wpipe.off + wpipe.fill);
        __atomic_store_n(&wpipe.busy, 0, __ATOMIC_RELEASE);
        ck_futex_wake_all(&wpipe.busy);
    }
}

/* wait until the second thread has written what it was handed; its error */
static int pipe_drain(void)
{
    while (__atomic_load_n(&wpipe.busy, __ATOMIC_ACQUIRE) == 1)
        ck_futex_wait(&wpipe.busy, 1, -1);
    return wpipe.err;
}

static int pwritev_raw(int fd, struct ck_iov *iov, int n, uint64_t off)
{
    int i = 0;
    while (i < n) {
        long w = ck_pwritev(fd, &iov[i], n - i, off);
        if (w == -EINTR)
            continue;
        if (w <= 0)
            return w < 0 ? (int)w : -EIO;
        off += (uint64_t)w;
        /* skip what went out; a partial iovec goes on from where it stopped */
        while (i < n && (size_t)w >= iov[i].len) {
            w -= (long)iov[i].len;
            i++;
        }
        if (i < n && w > 0) {
            iov[i].base = (const char *)iov[i].base + w;
            iov[i].len -= (size_t)w;
        }
    }
    return 0;
}

/* The cipher runs on a stack of its own in the arena: the checkpoint
 * thread's stack is in the image (the pause writes it, the forked writer
 * writes it from its own copy while running on it), and what the cipher
 * leaves in its frames (round keys: the first two are the key) must not
 * be.  ck_call_on_stack switches to `top`, calls fn(arg), switches back. */
long ck_call_on_stack(char *top, long (*fn)(void *), void *arg) CK_HIDDEN;
__asm__(".text\n"
        ".globl ck_call_on_stack\n"
        ".hidden ck_call_on_stack\n"
        ".type ck_call_on_stack,@function\n"
        "ck_call_on_stack:\n"
        "    push %rbp\n"
        "    mov %rsp, %rbp\n"
        "    mov %rdi, %rsp\n"
        "    mov %rdx, %rdi\n"
        "    call *%rsi\n"
        "    mov %rbp, %rsp\n"
        "    pop %rbp\n"
        "    ret\n"
        ".size ck_call_on_stack, .-ck_call_on_stack\n");

#define CRYPT_STACK (256u << 10)
static char *crypt_stack_top;  /* in the arena; taken with the key */
static int on_crypt_stack;

static long crypt_call(long (*fn)(void *), void *arg)
{
    if (on_crypt_stack || !crypt_stack_top)
        return fn(arg);
    on_crypt_stack = 1;
    long rc = ck_call_on_stack(crypt_stack_top, fn, arg);
    on_crypt_stack = 0;
    return rc;
}

struct sealed_write {
    int fd;
    struct ck_iov *iov;
    int n;
    uint64_t off;
};

static long sealed_pwritev(void *arg)
{
    struct sealed_write *a = arg;
    struct ck_iov *iov = a->iov;
    uint64_t off = a->off;
    int fd = a->fd, n = a->n;
    for (int i = 0; i < n; i++) {
        const char *p = iov[i].base;
        for (size_t done = 0; done < iov[i].len;) {
            size_t k = iov[i].len - done < BOUNCE_SIZE ? iov[i].len - done : BOUNCE_SIZE;
            ck_seal_crypt(seal.im->key, seal.im->prefix, off, (uint8_t *)seal.buf, (const uint8_t *)p + done, k);
            struct ck_iov one = {seal.buf, k};
            int rc = pwritev_raw(fd, &one, 1, off);
            if (rc < 0)
                return rc;
            off += k;
            done += k;
        }
    }
    return 0;
}

int ck_pwritev_all(int fd, struct ck_iov *iov, int n, uint64_t off)
{
    if (!seal.im || fd != seal.im->pages_fd)
        return pwritev_raw(fd, iov, n, off);
    struct sealed_write a = {fd, iov, n, off};
    return (int)crypt_call(sealed_pwritev, &a);
}

static int hexval(char c)
{
    return c >= '0' && c <= '9' ? c - '0' : c >= 'a' && c <= 'f' ? c - 'a' + 10 : c >= 'A' && c <= 'F' ? c - 'A' + 10 : -1;
}

struct key_init {
    struct ck_gcm_key *k;
    const uint8_t *raw;
};

static long key_init(void *arg)
{
    struct key_init *a = arg;
    ck_gcm_init(a->k, a->raw);
    return 0;
}

const struct ck_gcm_key *ck_seal_take_key(char *hex, int *bad)
{
    *bad = 0;
    if (!hex)
        return 0;
    struct ck_gcm_key *k = ck_arena_alloc(sizeof(*k) + CK_GCM_KEY_BYTES);
    uint8_t *raw = k ? (uint8_t *)(k + 1) : 0;
    char *stack = ck_arena_alloc(CRYPT_STACK);
    crypt_stack_top = stack ? stack + CRYPT_STACK : 0;
    size_t n = ck_strlen(hex);
    for (size_t i = 0; raw && n == 2 * CK_GCM_KEY_BYTES && i < CK_GCM_KEY_BYTES; i++) {
        int hi = hexval(hex[2 * i]), lo = hexval(hex[2 * i + 1]);
        if (hi < 0 || lo < 0)
            *bad = 1;
        raw[i] = (uint8_t)(hi << 4 | (lo & 15));
    }
    ck_gcm_wipe(hex, n);  /* the command line is in the shim's memory, which images hold */
    if (!raw || !stack || n != 2 * CK_GCM_KEY_BYTES || *bad || !ck_gcm_supported()) {
        *bad = 1;
        return 0;
    }
    struct key_init a = {k, raw};
    crypt_call(key_init, &a);
    ck_gcm_wipe(raw, CK_GCM_KEY_BYTES);
    return k;
}

int ck_seal_begin(struct ck_image *im)
{
    seal.im = 0;
    if (!im->key)
        return 0;
    seal.buf = ck_arena_alloc(BOUNCE_SIZE);
    seal.buf2 = ck_arena_alloc(BOUNCE_SIZE);
    seal.sealer = ck_arena_alloc(sizeof(struct ck_sealer));
    if (!seal.buf || !seal.buf2 || !seal.sealer)
        return ck_image_fail(im, "cannot allocate checkpoint scratch memory", 0, 0);
    int rc = ck_seal_new_prefix(im->prefix);
    if (rc < 0)
        return ck_image_fail(im, "cannot get random bytes for encryption (getrandom)", 0, rc);
    seal.im = im;
    return 0;
}

void ck_seal_end(void) { seal.im = 0; }

struct seal_copy {
    const struct ck_gcm_key *key;
    int in, out, side;
};

static long seal_copy(void *arg)
{
    struct seal_copy *a = arg;
    return ck_seal_copy(a->key, a->in, a->out, a->side, (uint8_t *)seal.buf);
}

int ck_seal_copy_file(struct ck_image *im, int in, int out, const char *name)
{
    char side[80];
    struct ck_buf b;
    ck_buf_init(&b, side, sizeof(side));
    ck_buf_str(&b, name);
    ck_buf_str(&b, CK_GCM_SUFFIX);
    if (b.overflow || !seal.buf)
        return -ENAMETOOLONG;
    int fd = (int)ck_openat(im->dirfd, side, O_RDWR | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
    if (fd < 0)
        return fd;
    struct seal_copy a = {im->key, in, out, fd};
    int rc = (int)crypt_call(seal_copy, &a);
    ck_close(fd);
    return rc;
}

__attribute__((noinline)) void ck_seal_scrub_stack(void)
{
    volatile char pad[16384];
    for (size_t i = 0; i < sizeof(pad); i++)
        pad[i] = 0;
}

struct tag_file {
    const struct ck_gcm_key *key;
    const uint8_t *prefix;
    int fd, side;
    char *buf;
};

static long tag_file(void *arg)
{
    struct tag_file *a = arg;
    return ck_seal_tag_file(a->key, a->prefix, a->fd, a->side, (uint8_t *)a->buf);
}

/* the sidecar of a pages file whose ciphertext is all there, read back
 * through buf (at least CK_GCM_CHUNK bytes) */
static int seal_tags_from_file(int dirfd, int fd, const struct ck_gcm_key *key, const uint8_t prefix[8], char *buf)
{
    int side = (int)ck_openat(dirfd, "pages.img.gcm", O_RDWR | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
    if (side < 0)
        return side;
    struct tag_file a = {key, prefix, fd, side, buf};
    int rc = (int)crypt_call(tag_file, &a);
    ck_close(side);
    return rc;
}

int ck_copy_unreadable(int fd, int mem_fd, char *buf, uint64_t vaddr, uint64_t len, uint64_t off)
{
    for (uint64_t done = 0; done < len;) {
        size_t n = len - done > BOUNCE_SIZE ? BOUNCE_SIZE : len - done;
        long r = ck_pread(mem_fd, buf, n, vaddr + done);
        if (r == -EINTR)
            continue;
        if (r <= 0)
            return r < 0 ? (int)r : -EIO;
        struct ck_iov one = {buf, (size_t)r};
        int rc = ck_pwritev_all(fd, &one, 1, off + done);
        if (rc < 0)
            return rc;
        done += (uint64_t)r;
    }
    return 0;
}

/* The writer starts writeback of what it has written every WRITEBACK_STEP
 * bytes: otherwise the kernel leaves up to a tenth of memory dirty until
 * the agent's fsync, and the disk idles while the writer fills the page
 * cache.  SYNC_FILE_RANGE_WRITE only queues the I/O; it does not wait.
 *
 * A writer that hashed its image (the agent will not read it back) also
 * keeps no more than DROP_BEHIND of it in the page cache: it waits until
 * what lies further back is on disk and drops it.  Otherwise a checkpoint
 * needs as much fresh page cache as the image is big, on top of the job's
 * own memory, and fresh memory is what costs here: on a VM that hands
 * freed memory back to its host, writing 4 GiB with 4 GiB resident went
 * at 0.62 of the rate of the same write without it, and at 1.04 with the
 * page cache recycled this way (scripts/bench_page_cache.py). */
#define WRITEBACK_STEP (64ull << 20)
#define DROP_BEHIND (256ull << 20)
#define CK_SYNC_FILE_RANGE_WAIT_BEFORE 1
#define CK_SYNC_FILE_RANGE_WRITE 2
#define CK_SYNC_FILE_RANGE_WAIT_AFTER 4
#define CK_POSIX_FADV_DONTNEED 4

struct writeback {
    uint64_t started;  /* writeback queued below this offset */
    uint64_t dropped;  /* on disk and out of the page cache below this one */
    int drop;          /* 1: keep at most DROP_BEHIND cached */
};

static void follow_writeback(int fd, struct writeback *w, uint64_t end)
{
    if (end < w->started + WRITEBACK_STEP)
        return;
    /* hints, all of them: the agent's fsync is what counts */
    (void)ck_sc4(SYS_sync_file_range, fd, w->started, end - w->started, CK_SYNC_FILE_RANGE_WRITE);
    w->started = end;
    if (!w->drop || end < w->dropped + DROP_BEHIND + WRITEBACK_STEP)
        return;
    uint64_t upto = end - DROP_BEHIND;
    (void)ck_sc4(SYS_sync_file_range, fd, w->dropped, upto - w->dropped,
                 CK_SYNC_FILE_RANGE_WAIT_BEFORE | CK_SYNC_FILE_RANGE_WRITE | CK_SYNC_FILE_RANGE_WAIT_AFTER);
    (void)ck_sc4(SYS_fadvise64, fd, w->dropped, upto - w->dropped, CK_POSIX_FADV_DONTNEED);
    w->dropped = upto;
}

/* Calls fn on every page run of the mappings left for later (of every
 * mapping: all), in file order, and stops at the first nonzero return.
 * Runs of an earlier image (r->src) come too: most callers skip them. */
typedef int (*run_fn)(void *ctx, const struct ck_vma *v, const struct ck_page_run *r);

static int each_run(struct ck_image *im, int all, run_fn fn, void *ctx)
{
    for (size_t vi = 0; vi < im->vmas.count; vi++) {
        const struct ck_vma *v = ck_table_at(&im->vmas, vi);
        if (!all && !ck_vma_written_later(v))
            continue;
        for (uint64_t ri = v->first_run; ri < v->first_run + v->nruns; ri++) {
            int rc = fn(ctx, v, ck_table_at(&im->runs, ri));
            if (rc)
                return rc;
        }
    }
    return 0;
}

/* the pages of run r, of a PROT_NONE mapping, through /proc/self/mem
 * (opened once, into *mem_fd) and `bounce` */
static int write_unreadable(int fd, int *mem_fd, const struct ck_page_run *r)
{
    if (*mem_fd < 0)
        *mem_fd = (int)ck_open("/proc/self/mem", O_RDONLY | O_CLOEXEC, 0);
    if (*mem_fd < 0)
        return *mem_fd;
    return ck_copy_unreadable(fd, *mem_fd, bounce, r->vaddr, r->npages * CK_PAGE_SIZE, r->offset);
}

/* Every run this image holds itself, of the mappings left for later,
 * written from where it lies in memory, up to CK_IOV_BATCH runs per
 * pwritev. */
struct direct_out {
    int fd;
    int mem_fd;
    int n;           /* iovecs pending */
    uint64_t first;  /* their file offset */
    uint64_t len;
    struct writeback wb;
    struct ck_iov *iov;
};

static int direct_flush(struct direct_out *o)
{
    if (!o->n)
        return 0;
    int rc = ck_pwritev_all(o->fd, o->iov, o->n, o->first);
    follow_writeback(o->fd, &o->wb, o->first + o->len);
    o->n = 0;
    o->len = 0;
    return rc;
}

static int direct_run(void *ctx, const struct ck_vma *v, const struct ck_page_run *r)
{
    struct direct_out *o = ctx;
    uint64_t size = r->npages * CK_PAGE_SIZE;
    if (r->src)
        return 0;  /* an earlier image's pages */
    if (!(v->prot & PROT_READ)) {
        int rc = direct_flush(o);
        return rc ? rc : write_unreadable(o->fd, &o->mem_fd, r);
    }
    /* in pieces of at most WRITEBACK_STEP, so writeback follows the writer */
    for (uint64_t done = 0; done < size;) {
        uint64_t piece = size - done < WRITEBACK_STEP ? size - done : WRITEBACK_STEP;
        if (o->n && (o->n == CK_IOV_BATCH || o->first + o->len != r->offset + done || o->len >= WRITEBACK_STEP)) {
            int rc = direct_flush(o);
            if (rc)
                return rc;
        }
        if (!o->n)
            o->first = r->offset + done;
        o->iov[o->n].base = (const void *)(r->vaddr + done);
        o->iov[o->n].len = piece;
        o->n++;
        o->len += piece;
        done += piece;
    }
    return 0;
}

static int write_later_runs(struct ck_image *im, int fd)
{
    static struct ck_iov iov[CK_IOV_BATCH];
    struct direct_out o = {fd, -1, 0, 0, 0, {0, 0, 0}, iov};
    int rc = each_run(im, 0, direct_run, &o);
    if (rc == 0)
        rc = direct_flush(&o);
    if (o.mem_fd >= 0)
        ck_close(o.mem_fd);
    return rc;
}

/* The same runs, hashed (checksum.c): copied through `bounce`, which is
 * hashed and then written, so that what is hashed is exactly what is
 * written.  Hashing the job's memory in place and writing it from there
 * would not be: the writer's own stack, the kernel's rseq updates and the
 * hash's state change pages of the image as it goes.  The runs the pause
 * wrote are read back from the file, in their place in the file's order. */
struct hashed_out {
    int fd;
    int mem_fd;
    uint64_t off;  /* the file offset of bounce[0] */
    size_t fill;
    struct writeback wb;
    struct ck_checksum *sum;
    struct ck_image *im;        /* its key and prefix when encrypting */
    struct ck_sealer *sealer;   /* NULL: not encrypting */
    int piped;                  /* the second thread writes (wpipe) */
    struct ck_dedup *dd;        /* launch --dedup, a rank other than 0: leave out rank 0's pages */
    uint64_t end;               /* where the image's last run ends: the file's size */
    int progress;               /* launch --dedup, rank 0: pages.progress (writeout_dedup.c); -1: none */
};

static int hashed_flush(struct hashed_out *o)
{
    if (!o->fill)
        return 0;
    if (o->piped) {
        ck_sealer_add(o->sealer, o->off, (const uint8_t *)bounce, o->fill);
        int rc = pipe_drain();  /* the other buffer is free again */
        wpipe.buf = bounce;
        wpipe.off = o->off;
        wpipe.fill = o->fill;
        __atomic_store_n(&wpipe.busy, 1, __ATOMIC_RELEASE);
        ck_futex_wake_all(&wpipe.busy);
        bounce = bounce == seal.buf2 ? pipe_other : seal.buf2;
        o->off += o->fill;
        o->fill = 0;
        return rc;
    }
    ck_checksum_add(o->sum, o->off, bounce, o->fill);
    if (o->sealer)
        ck_sealer_add(o->sealer, o->off, (const uint8_t *)bounce, o->fill);
    struct ck_iov one = {bounce, o->fill};
    int rc = pwritev_raw(o->fd, &one, 1, o->off);  /* encrypted already, if at all */
    o->off += o->fill;
    o->fill = 0;
    if (rc == 0)
        ck_dedup_progress(o->progress, o->off);
    follow_writeback(o->fd, &o->wb, o->off);
    return rc;
}

static int hashed_put(struct hashed_out *o, uint64_t off, const char *src, uint64_t len)
{
    int rc = 0;
    if (o->fill && o->off + o->fill != off)
        rc = hashed_flush(o);
    if (!o->fill)
        o->off = off;
    while (len && rc == 0) {
        size_t k = len < BOUNCE_SIZE - o->fill ? len : BOUNCE_SIZE - o->fill;
        if (o->sealer)  /* encrypted as it is copied */
            ck_seal_crypt(o->im->key, o->im->prefix, o->off + o->fill, (uint8_t *)bounce + o->fill, (const uint8_t *)src,
                          k);
        else
            __builtin_memcpy(bounce + o->fill, src, k);
        o->fill += k;
        src += k;
        len -= k;
        if (o->fill == BOUNCE_SIZE)
            rc = hashed_flush(o);
    }
    return rc;
}

/* what is in the file already (the pause wrote it, encrypted if at all),
 * read back to be hashed and tagged in its place */
static int read_back(struct hashed_out *o, uint64_t off, uint64_t len)
{
    if (o->piped && pipe_drain())  /* hashed and tagged in file order */
        return wpipe.err;
    if (!o->sealer)
        return ck_checksum_add_file(o->sum, o->fd, bounce, BOUNCE_SIZE, off, len);
    for (uint64_t done = 0; done < len;) {
        size_t n = len - done > BOUNCE_SIZE ? BOUNCE_SIZE : len - done;
        long r = ck_pread(o->fd, bounce, n, off + done);
        if (r == -EINTR)
            continue;
        if (r <= 0)
            return r < 0 ? (int)r : -EIO;
        ck_checksum_add(o->sum, off + done, bounce, (uint64_t)r);
        ck_sealer_add(o->sealer, off + done, (const uint8_t *)bounce, (uint64_t)r);
        done += (uint64_t)r;
    }
    return 0;
}

/* pages rank 0 holds alike (writeout_dedup.c): a hole, zeros to the checksum */
static int hashed_hole(struct hashed_out *o, uint64_t off, uint64_t len)
{
    static const char zeros[1 << 16];
    int rc = hashed_flush(o);
    for (uint64_t done = 0; done < len && rc == 0; done += sizeof(zeros))
        ck_checksum_add(o->sum, off + done, zeros, len - done < sizeof(zeros) ? len - done : sizeof(zeros));
    return rc;
}

static int dedup_out(void *ctx, uint64_t off, const char *mem, uint64_t len, int held)
{
    struct hashed_out *o = ctx;
    return held ? hashed_hole(o, off, len) : hashed_put(o, off, mem, len);
}

static int hashed_run(void *ctx, const struct ck_vma *v, const struct ck_page_run *r)
{
    struct hashed_out *o = ctx;
    uint64_t size = r->npages * CK_PAGE_SIZE;
    int later = ck_vma_written_later(v);
    if (r->src)
        return 0;  /* an earlier image's pages */
    if (r->offset + size > o->end)
        o->end = r->offset + size;
    if (later && (v->prot & PROT_READ) && o->dd)
        return ck_dedup_run(o->dd, r->offset, (const char *)r->vaddr, r->npages, dedup_out, o);
    if (later && (v->prot & PROT_READ))
        return hashed_put(o, r->offset, (const char *)r->vaddr, size);
    int rc = hashed_flush(o);  /* bounce is needed below */
    if (rc == 0 && o->piped)
        rc = pipe_drain();  /* what follows is read back and hashed in file order */
    if (rc == 0 && later)
        rc = write_unreadable(o->fd, &o->mem_fd, r);
    if (rc == 0)  /* written during the pause, or just now */
        rc = read_back(o, r->offset, size);
    if (rc == 0)
        ck_dedup_progress(o->progress, r->offset + size);
    return rc;
}

static int write_later_runs_hashed(struct ck_image *im, int fd, struct ck_checksum *sum, struct ck_sealer *sealer,
                                   struct ck_dedup *dd, int progress)
{
    /* what it hashed the agent does not read back (but to deduplicate): it
     * need not stay cached */
    struct hashed_out o = {fd, -1, 0, 0, {0, 0, !im->keep_cached}, sum, im, sealer, 0, dd, 0, progress};
    if (sealer) {  /* a second thread hashes and writes while this one encrypts */
        char *stack = ck_mmap(0, 256 << 10, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
        wpipe = (typeof(wpipe)){0, 0, 0, 0, fd, 0, &o.wb, sum};
        pipe_other = bounce;
        o.piped = !ck_mmap_failed(stack) && ck_writer_thread(stack + (256 << 10), pipe_thread, 0, CK_THREAD_FLAGS) > 0;
    }
    int rc = each_run(im, 1, hashed_run, &o);
    if (rc == 0)
        rc = hashed_flush(&o);
    struct stat st;
    if (rc == 0 && dd && (rc = (int)ck_fstat(fd, &st)) == 0 && (uint64_t)st.st_size < o.end)
        rc = (int)ck_ftruncate(fd, o.end);  /* the last pages may be a hole */
    if (rc == 0 && dd)
        rc = ck_dedup_end(dd);
    if (rc == 0)
        ck_dedup_progress(progress, ~0ull);  /* every byte: the comparing ranks need not wait for the name */
    if (o.piped) {
        int prc = pipe_drain();
        if (rc == 0)
            rc = prc;
        __atomic_store_n(&wpipe.busy, 2, __ATOMIC_RELEASE);
        ck_futex_wake_all(&wpipe.busy);
        bounce = pipe_other;  /* what the callers read back through */
    }
    if (o.mem_fd >= 0)
        ck_close(o.mem_fd);
    return rc;
}

struct writer_run {
    struct ck_image *im;
    struct ck_checksum *sum;
};

/* the writer of an encrypted image, on the cipher's stack */
static long writer_sealed(void *arg)
{
    struct writer_run *a = arg;
    struct ck_image *im = a->im;
    /* the pages file is 0 here; what goes out through ck_pwritev_all
     * (PROT_NONE runs) is encrypted there, the rest in the bounce buffer */
    im->pages_fd = 0;
    seal.im = im;
    int side = (int)ck_openat(1, "pages.img.gcm", O_RDWR | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
    if (side < 0)
        return side;
    ck_sealer_start(seal.sealer, im->key, im->prefix, side);
    int rc = write_later_runs_hashed(im, 0, a->sum, seal.sealer, 0, -1);
    struct stat st;
    if (rc == 0)
        rc = (int)ck_fstat(0, &st);
    if (rc == 0)
        rc = ck_sealer_finish(seal.sealer, (uint64_t)st.st_size);
    if (rc == -EILSEQ)  /* not written in file order after all: read it back */
        rc = ck_seal_tag_file(im->key, im->prefix, 0, side, (uint8_t *)bounce);
    ck_close(side);
    return rc;
}

/* Tests only (ckptd/faults.py): CKPTD_FAULT=writer:PHASE:SIG, or @FILE holding
 * it (fired once: by whoever unlinks FILE), sends SIG to this writer at its
 * start (PHASE dump) or before it names pages.img (PHASE flush). */
static void writer_fault(const char *phase)
{
    const char *spec = ck_shim.fault;
    char buf[64];
    if (!spec || !*spec)
        return;
    if (spec[0] == '@') {
        int fd = (int)ck_open(spec + 1, O_RDONLY | O_CLOEXEC, 0);
        if (fd < 0)
            return;
        long n = ck_read(fd, buf, sizeof(buf) - 1);
        ck_close(fd);
        if (n <= 0)
            return;
        buf[n] = 0;
        while (n > 0 && (buf[n - 1] == '\n' || buf[n - 1] == ' '))
            buf[--n] = 0;
        spec = buf;
    }
    size_t len = ck_strlen(phase);
    if (ck_strncmp(spec, "writer:", 7) || ck_strncmp(spec + 7, phase, len) || spec[7 + len] != ':')
        return;
    const char *sig = spec + 8 + len;
    if (!ck_strncmp(sig, "SIG", 3))
        sig += 3;
    int signo = !ck_strcmp(sig, "KILL") ? SIGKILL : !ck_strcmp(sig, "STOP") ? SIGSTOP : 0;
    if (!signo || (ck_shim.fault[0] == '@' && ck_unlink(ck_shim.fault + 1) < 0))
        return;
    ck_kill((int)ck_getpid(), signo);
}

/* Until the round's pause has ended on every rank (FLUSH): no writer takes
 * a core from the other ranks' dumps and resumes meanwhile.  The gate opens
 * when its last write end is closed (ck_writeout_go, or the process gone). */
static void wait_at_gate(int fd)
{
    struct pollfd p = {.fd = fd, .events = POLLIN};
    while (ck_poll_ms(&p, 1, GATE_MAX_MS) == -EINTR)
        ;
    ck_close(fd);
}

__attribute__((noreturn)) static void writer_main(struct ck_image *im, int gate)
{
    ck_prctl(PR_SET_NAME, (unsigned long)"ckptd-writer", 0, 0, 0);
    /* keep only pages.img.part (as 0), the image directory (as 1) and the
     * gate (as 2); above 2 first, so that none is closed by another's dup3
     * (a job that closed its stdin has its dump's descriptors from 0 on) */
    int pages = (int)ck_fcntl(im->pages_fd, F_DUPFD, 3), dir = (int)ck_fcntl(im->dirfd, F_DUPFD, 3);
    int g = gate >= 0 ? (int)ck_fcntl(gate, F_DUPFD, 3) : -1;
    if (pages < 0 || dir < 0 || (gate >= 0 && g < 0) || ck_dup3(pages, 0, 0) < 0 || ck_dup3(dir, 1, 0) < 0 ||
        (g >= 0 && ck_dup3(g, 2, 0) < 0))
        ck_exit_group(EBADF);
    ck_close_range(g >= 0 ? 3 : 2, ~0u);  /* the gate's write end too: the shim's is the last */
    writer_fault("dump");
    if (g >= 0)
        wait_at_gate(2);
    struct ck_checksum sum;
    int hashing = ck_checksum_start(&sum), rc;
    if (im->key) {
        struct writer_run a = {im, &sum};
        rc = (int)crypt_call(writer_sealed, &a);  /* not on the stack it writes */
    } else {
        /* launch --dedup: rank 0 says how far it has written, another
         * rank writes only what rank 0's pages do not hold (writeout_dedup.c) */
        int progress = hashing && im->dedup == CK_DEDUP_SOURCE ? ck_dedup_progress_open(1) : -1;
        struct ck_dedup *dd = hashing && im->dedup == CK_DEDUP_COMPARE ? ck_dedup_begin(1) : 0;
        rc = hashing ? write_later_runs_hashed(im, 0, &sum, 0, dd, progress) : write_later_runs(im, 0);
    }
    if (rc == 0) {
        ck_checksum_finish(&sum, 0);
        writer_fault("flush");
        rc = (int)ck_renameat(1, "pages.img.part", "pages.img");
    }
    ck_exit_group(rc < 0 ? -rc : 0);
}

/* Forking costs the pause about 20 ms per GiB of memory mapped with 4 KiB
 * pages (the kernel copies each page table entry; huge pages are nearly
 * free), writing about 1 ms per MiB.  An incremental image of a big
 * process that changed little is written faster than it is forked. */
static uint64_t stage_wanted;  /* the staging area a next incremental image may need */

struct run_sizes {
    uint64_t mapped;    /* what the runs cover */
    uint64_t to_write;  /* what this image holds itself */
};

static int add_run_size(void *ctx, const struct ck_vma *v, const struct ck_page_run *r)
{
    struct run_sizes *s = ctx;
    (void)v;
    s->mapped += r->npages * CK_PAGE_SIZE;
    if (!r->src)
        s->to_write += r->npages * CK_PAGE_SIZE;
    return 0;
}

static int cheaper_to_write_now(struct ck_image *im)
{
    struct run_sizes s = {0, 0};
    (void)each_run(im, 0, add_run_size, &s);
    stage_wanted = s.mapped / 50;
    return s.to_write * 50 < s.mapped;
}

#ifndef MADV_POPULATE_WRITE
#define MADV_POPULATE_WRITE 23
#endif

/* Fault in the part of the staging area the next incremental image may
 * use, now that the job runs, so that staging costs the pause no page
 * faults (best effort: without it the first staging faults them in). */
static void prefault_stage(void)
{
    size_t cap;
    char *area = ck_arena_stage(&cap);
    uint64_t want = STAGE_INDEX + stage_wanted;
    if (area && ck_track_armed())
        ck_madvise(area, want < cap ? want : cap, MADV_POPULATE_WRITE);
}

/* Copy the runs write_later_runs would write into the staging area; 0, or
 * -1 when they do not fit or one is unreadable (nothing is kept). */
struct stage_fill {
    struct staged_piece *index;
    char *data;  /* after the index */
    uint64_t max_pieces, room;
    uint64_t n, used, end;  /* pieces, bytes, the file offset the last piece ends at */
    int copy;               /* 0: only check that it all fits */
};

static int stage_run(void *ctx, const struct ck_vma *v, const struct ck_page_run *r)
{
    struct stage_fill *s = ctx;
    uint64_t size = r->npages * CK_PAGE_SIZE;
    if (r->src)
        return 0;
    if (!(v->prot & PROT_READ))
        return -1;  /* PROT_NONE: /proc/self/mem, during the pause */
    if (s->n && s->end == r->offset) {
        if (s->copy)
            s->index[s->n - 1].len += size;
    } else {
        if (s->n == s->max_pieces)
            return -1;
        if (s->copy)
            s->index[s->n] = (struct staged_piece){r->offset, size};
        s->n++;
    }
    if (s->used + size > s->room)
        return -1;
    if (s->copy)
        __builtin_memcpy(s->data + s->used, (const void *)r->vaddr, size);
    s->used += size;
    s->end = r->offset + size;
    return 0;
}

static int stage_runs(struct ck_image *im)
{
    size_t cap;
    char *area = ck_arena_stage(&cap);
    if (!area)
        return -1;
    struct stage_fill s = {(struct staged_piece *)area, area + STAGE_INDEX, STAGE_INDEX / sizeof(struct staged_piece),
                           cap - STAGE_INDEX, 0, 0, 0, 0};
    if (each_run(im, 0, stage_run, &s) != 0)  /* first check that it all fits, then copy */
        return -1;
    s.n = s.used = s.end = 0;
    s.copy = 1;
    if (each_run(im, 0, stage_run, &s) != 0)
        return -1;
    staged.npieces = s.n;
    return 0;
}

struct staged_crypt {
    const struct ck_gcm_key *key;
    const struct staged_piece *index;
    char *data;
};

static long staged_crypt(void *arg)
{
    struct staged_crypt *a = arg;
    char *at = a->data;
    for (uint64_t i = 0; i < staged.npieces; i++) {
        ck_seal_crypt(a->key, staged.prefix, a->index[i].off, (uint8_t *)at, (const uint8_t *)at, a->index[i].len);
        at += a->index[i].len;
    }
    return 0;
}

/* write what stage_runs copied aside (encrypted in place first, with key),
 * then name pages.img; 0 or -errno */
static int write_staged(const struct ck_gcm_key *key)
{
    size_t cap;
    char *area = ck_arena_stage(&cap);
    const struct staged_piece *index = (const struct staged_piece *)area;
    char *data = area + STAGE_INDEX;
    if (staged.sealed && !key)
        return -ENOKEY;  /* never written in the clear */
    if (key) {
        struct staged_crypt a = {key, index, data};
        crypt_call(staged_crypt, &a);
    }
    static struct ck_iov iov[CK_IOV_BATCH];
    int rc = 0, n = 0;
    uint64_t first = 0;
    for (uint64_t i = 0; i < staged.npieces && rc == 0; i++) {
        iov[n].base = data;
        iov[n].len = index[i].len;
        if (!n)
            first = index[i].off;
        n++;
        data += index[i].len;
        int last = i + 1 == staged.npieces;
        /* pieces are in file order with gaps (pages written at once): one pwritev per contiguous stretch */
        if (last || n == CK_IOV_BATCH || index[i].off + index[i].len != index[i + 1].off) {
            rc = ck_pwritev_all(staged.pages_fd, iov, n, first);
            n = 0;
        }
    }
    if (rc == 0 && key) {
        char *buf = ck_arena_alloc(CK_GCM_CHUNK);
        rc = buf ? seal_tags_from_file(staged.dirfd, staged.pages_fd, key, staged.prefix, buf) : -ENOMEM;
    }
    if (rc == 0)
        rc = (int)ck_renameat(staged.dirfd, "pages.img.part", "pages.img");
    return rc;
}

/* 1: the caller writes the staged pages; 0: nothing staged, or another
 * thread is writing them */
static int claim_staged(void)
{
    return staged.pages_fd >= 0 && __atomic_exchange_n(&staged_claimed, 1, __ATOMIC_ACQ_REL) == 0;
}

static void drop_staged(void)
{
    if (staged.pages_fd >= 0)
        ck_close(staged.pages_fd);
    if (staged.dirfd >= 0)
        ck_close(staged.dirfd);
    staged.pages_fd = staged.dirfd = -1;
    staged.npieces = 0;
    __atomic_store_n(&staged_claimed, 0, __ATOMIC_RELEASE);
}

/* The writer reads private memory only (ck_vma_written_later): the job's
 * shared mappings are kept out of it (MADV_DONTFORK around the fork).  A
 * System V segment it inherited would count one attachment more
 * (shm_nattch) and move shm_lpid and shm_atim, all of which the job can
 * read, for as long as the writer waits at its gate; the job runs again
 * meanwhile.  A mapping that refuses (VM_IO, VM_PFNMAP) is inherited. */
static void shared_kept_from_fork(const struct ck_image *im, int kept)
{
    const struct ck_vma *v = (const struct ck_vma *)im->vmas.base;
    for (size_t i = 0; i < im->vmas.count; i++)
        if ((v[i].flags & CK_VMA_SHARED) && !(v[i].madv & CK_MADV_DONTFORK))
            ck_madvise((void *)v[i].start, v[i].end - v[i].start, kept ? MADV_DONTFORK : MADV_DOFORK);
}

int ck_writeout_start(struct ck_image *im, const char *dir)
{
    if (im->key)  /* before the stack is forked or staged: nothing of the key below this frame */
        ck_seal_scrub_stack();
    bounce = ck_arena_alloc(BOUNCE_SIZE);  /* the arena starts over after every dump */
    capture_mode = CK_CAPTURE_PAUSE;
    if (!bounce)
        return ck_image_fail(im, "cannot allocate checkpoint scratch memory", 0, 0);
    if (ck_shim.capture_sync == 0 && !im->no_writer && !cheaper_to_write_now(im)) {
        /* the writer needs the tables in the arena, which children
         * otherwise get wiped (arena.c) */
        long pid = -1;
        int gate[2] = {-1, -1};
        if (ck_pipe2(gate, O_CLOEXEC) < 0)
            gate[0] = gate[1] = -1;  /* no descriptor left: the writer starts at once, as it may */
        if (ck_arena_inherit(1) == 0) {
            shared_kept_from_fork(im, 1);
            pid = ck_clone_quiet();
            if (pid == 0)
                writer_main(im, gate[0]);
            shared_kept_from_fork(im, 0);
        }
        ck_arena_inherit(0);
        if (gate[0] >= 0)
            ck_close(gate[0]);
        gate_fd = gate[1];
        if (pid > 0) {
            ck_strlcpy(writer_dir, dir, sizeof(writer_dir));
            writer_pid = (int)pid;
            capture_mode = CK_CAPTURE_WRITER;
            return 0;
        }
        ck_writeout_go();  /* no writer to wait for it */
        /* no fork (memory, a process limit): write them now instead */
    } else if (ck_shim.capture_sync == 0 && stage_runs(im) == 0) {
        /* FLUSH writes them; the pages file and its directory stay open until then */
        staged.pages_fd = (int)ck_fcntl(im->pages_fd, F_DUPFD_CLOEXEC, 0);
        staged.dirfd = (int)ck_fcntl(im->dirfd, F_DUPFD_CLOEXEC, 0);
        if (staged.pages_fd >= 0 && staged.dirfd >= 0) {
            ck_strlcpy(writer_dir, dir, sizeof(writer_dir));
            capture_mode = CK_CAPTURE_STAGED;
            staged.sealed = im->key != 0;
            ck_memcpy(staged.prefix, im->prefix, sizeof(staged.prefix));
            return 0;
        }
        drop_staged();  /* no descriptors left: write them now */
    }
    int rc = write_later_runs(im, im->pages_fd);  /* encrypted on the way, if at all (seal) */
    if (rc == 0 && im->key)
        rc = seal_tags_from_file(im->dirfd, im->pages_fd, im->key, im->prefix, bounce);
    if (rc < 0)
        return ck_image_fail(im, "cannot write pages.img", 0, rc);
    rc = (int)ck_renameat(im->dirfd, "pages.img.part", "pages.img");
    if (rc < 0)
        return ck_image_fail(im, "cannot rename pages.img.part", 0, rc);
    return 0;
}

static int reap(int pid, int *status)
{
    for (;;) {
        long r = ck_wait4(pid, status, __WCLONE);
        if (r != -EINTR)
            return (int)r;
    }
}

/* written by another thread (the exit destructor): 0 if pages.img is there */
static int staged_image_done(char *err, size_t errcap)
{
    int dfd = (int)ck_open(writer_dir, O_RDONLY | O_DIRECTORY | O_CLOEXEC, 0);
    int ok = dfd >= 0 && ck_faccessat(dfd, "pages.img") == 0;
    if (dfd >= 0)
        ck_close(dfd);
    if (ok)
        return 0;
    struct ck_buf b;
    ck_buf_init(&b, err, errcap);
    ck_buf_error(&b, "pages.img was not finished", writer_dir, 0);
    return -1;
}

/* In a child the job forked: its parent's writer, gate and staged pages
 * are not its own.  Its copy of the gate's write end would keep the
 * writer waiting (until the child exits or execs), and its next QUIESCE
 * would kill the writer's pid, by then maybe another process's. */
void ck_writeout_after_fork(void)
{
    writer_pid = 0;
    ck_writeout_go();  /* closes only the child's copy: the parent's stays */
    drop_staged();
}

void ck_writeout_go(void)
{
    int fd = __atomic_exchange_n(&gate_fd, -1, __ATOMIC_ACQ_REL);
    if (fd >= 0)
        ck_close(fd);
}

int ck_writeout_flush(char *err, size_t errcap, char *key_hex)
{
    if (claim_staged()) {
        int bad;
        const struct ck_gcm_key *key = ck_seal_take_key(key_hex, &bad);
        int rc = write_staged(key);
        if (key)
            ck_gcm_wipe((void *)key, sizeof(*key));
        drop_staged();
        prefault_stage();
        if (rc == 0)
            return 0;
        struct ck_buf b;
        ck_buf_init(&b, err, errcap);
        ck_buf_error(&b, "cannot write the staged pages to pages.img", writer_dir, rc);
        return -1;
    }
    if (staged.pages_fd >= 0) {  /* the process is exiting: its destructor writes them */
        for (int i = 0; i < 6000 && __atomic_load_n(&staged.pages_fd, __ATOMIC_ACQUIRE) >= 0; i++)
            ck_nanosleep_ms(10);
        return staged_image_done(err, errcap);
    }
    int pid = writer_pid;
    if (pid <= 0)
        return 1;  /* nothing being written */
    ck_writeout_go();  /* every rank of the round runs again, or stays parked (--then-stop) */
    int status = 0;
    long r = reap(pid, &status);
    writer_pid = 0;
    prefault_stage();
    struct ck_buf b;
    ck_buf_init(&b, err, errcap);
    if (r == pid) {
        if (WIFEXITED(status) && WEXITSTATUS(status) == 0)
            return 0;
        if (WIFEXITED(status))
            ck_buf_error(&b, "the writer of pages.img failed", writer_dir, -WEXITSTATUS(status));
        else
            ck_buf_error(&b, "the writer of pages.img was killed", writer_dir, 0);
        return -1;
    }
    /* reaped by the destructor meanwhile: the rename tells */
    return staged_image_done(err, errcap);
}

void ck_writeout_discard(void)
{
    drop_staged();
    int pid = writer_pid;
    if (pid <= 0)
        return;
    int status;
    ck_kill(pid, SIGKILL);
    ck_writeout_go();
    reap(pid, &status);
    writer_pid = 0;
}

/* a normal exit right after a checkpoint waits until the image is written
 * (an _exit does not: a staged image is then never finished, and FLUSH's
 * caller, finding pages.img missing, fails the round) */
__attribute__((destructor)) static void wait_for_writer(void)
{
    if (claim_staged()) {
        write_staged(0);  /* an encrypted job's staged pages stay unwritten: no key here */
        drop_staged();
    }
    int pid = writer_pid, status;
    ck_writeout_go();
    if (pid > 0)
        reap(pid, &status);
}
