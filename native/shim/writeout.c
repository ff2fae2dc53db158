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
 * the two it needs, so that it keeps none of the job's files open.  It holds
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
 * CKPTD_CAPTURE=sync, or a fork the kernel refuses (memory), writes the same
 * pages during the pause.
 */
#include "shim.h"
#include "../common/sys.h"
#include "../common/util.h"

#include <errno.h>
#include <sys/file.h>
#include <sys/prctl.h>
#include <sys/wait.h>

#define BOUNCE_SIZE (1u << 20)

#define STAGE_INDEX (2u << 20)  /* the staging area's head: where each staged piece goes */

static volatile int writer_pid;      /* 0: none */

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
} staged = {-1, -1, 0};
static int staged_claimed;  /* FLUSH and the exit destructor: one of them writes */
static int capture_mode;     /* CK_CAPTURE_* of the last image */

int ck_writeout_mode(void) { return capture_mode; }
static char writer_dir[4096];        /* its image directory, for FLUSH's messages */
static char *bounce;

int ck_vma_written_later(const struct ck_vma *v)
{
    if (v->flags & (CK_VMA_SHARED | CK_VMA_DELETED | CK_VMA_NOCONTENT))
        return 0;
    return !(v->madv & (CK_MADV_DONTFORK | CK_MADV_WIPEONFORK));
}

int ck_pwritev_all(int fd, struct ck_iov *iov, int n, uint64_t off)
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
};

static int hashed_flush(struct hashed_out *o)
{
    if (!o->fill)
        return 0;
    ck_checksum_add(o->sum, o->off, bounce, o->fill);
    struct ck_iov one = {bounce, o->fill};
    int rc = ck_pwritev_all(o->fd, &one, 1, o->off);
    o->off += o->fill;
    o->fill = 0;
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
        __builtin_memcpy(bounce + o->fill, src, k);
        o->fill += k;
        src += k;
        len -= k;
        if (o->fill == BOUNCE_SIZE)
            rc = hashed_flush(o);
    }
    return rc;
}

static int hashed_run(void *ctx, const struct ck_vma *v, const struct ck_page_run *r)
{
    struct hashed_out *o = ctx;
    uint64_t size = r->npages * CK_PAGE_SIZE;
    int later = ck_vma_written_later(v);
    if (r->src)
        return 0;  /* an earlier image's pages */
    if (later && (v->prot & PROT_READ))
        return hashed_put(o, r->offset, (const char *)r->vaddr, size);
    int rc = hashed_flush(o);  /* bounce is needed below */
    if (rc == 0 && later)
        rc = write_unreadable(o->fd, &o->mem_fd, r);
    if (rc == 0)  /* written during the pause, or just now */
        rc = ck_checksum_add_file(o->sum, o->fd, bounce, BOUNCE_SIZE, r->offset, size);
    return rc;
}

static int write_later_runs_hashed(struct ck_image *im, int fd, struct ck_checksum *sum)
{
    /* what it hashed the agent does not read back (but to deduplicate): it
     * need not stay cached */
    struct hashed_out o = {fd, -1, 0, 0, {0, 0, !im->keep_cached}, sum};
    int rc = each_run(im, 1, hashed_run, &o);
    if (rc == 0)
        rc = hashed_flush(&o);
    if (o.mem_fd >= 0)
        ck_close(o.mem_fd);
    return rc;
}

__attribute__((noreturn)) static void writer_main(struct ck_image *im)
{
    ck_prctl(PR_SET_NAME, (unsigned long)"ckptd-writer", 0, 0, 0);
    /* keep only pages.img.part (as 0) and the image directory (as 1) */
    if (ck_dup3(im->pages_fd, 0, 0) < 0 || ck_dup3(im->dirfd, 1, 0) < 0)
        ck_exit_group(EBADF);
    ck_close_range(2, ~0u);
    struct ck_checksum sum;
    int rc = ck_checksum_start(&sum) ? write_later_runs_hashed(im, 0, &sum) : write_later_runs(im, 0);
    if (rc == 0) {
        ck_checksum_finish(&sum, 0);
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

/* write what stage_runs copied aside, then name pages.img; 0 or -errno */
static int write_staged(void)
{
    size_t cap;
    char *area = ck_arena_stage(&cap);
    const struct staged_piece *index = (const struct staged_piece *)area;
    const char *data = area + STAGE_INDEX;
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

int ck_writeout_start(struct ck_image *im, const char *dir)
{
    bounce = ck_arena_alloc(BOUNCE_SIZE);  /* the arena starts over after every dump */
    capture_mode = CK_CAPTURE_PAUSE;
    if (!bounce)
        return ck_image_fail(im, "cannot allocate checkpoint scratch memory", 0, 0);
    if (ck_shim.capture_sync == 0 && !cheaper_to_write_now(im)) {
        /* the writer needs the tables in the arena, which children
         * otherwise get wiped (arena.c) */
        long pid = -1;
        if (ck_arena_inherit(1) == 0) {
            pid = ck_clone_quiet();
            if (pid == 0)
                writer_main(im);
        }
        ck_arena_inherit(0);
        if (pid > 0) {
            ck_strlcpy(writer_dir, dir, sizeof(writer_dir));
            writer_pid = (int)pid;
            capture_mode = CK_CAPTURE_WRITER;
            return 0;
        }
        /* no fork (memory, a process limit): write them now instead */
    } else if (ck_shim.capture_sync == 0 && stage_runs(im) == 0) {
        /* FLUSH writes them; the pages file and its directory stay open until then */
        staged.pages_fd = (int)ck_fcntl(im->pages_fd, F_DUPFD_CLOEXEC, 0);
        staged.dirfd = (int)ck_fcntl(im->dirfd, F_DUPFD_CLOEXEC, 0);
        if (staged.pages_fd >= 0 && staged.dirfd >= 0) {
            ck_strlcpy(writer_dir, dir, sizeof(writer_dir));
            capture_mode = CK_CAPTURE_STAGED;
            return 0;
        }
        drop_staged();  /* no descriptors left: write them now */
    }
    int rc = write_later_runs(im, im->pages_fd);
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

int ck_writeout_flush(char *err, size_t errcap)
{
    if (claim_staged()) {
        int rc = write_staged();
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
    reap(pid, &status);
    writer_pid = 0;
}

/* a normal exit right after a checkpoint waits until the image is written
 * (an _exit does not: a staged image is then never finished, and FLUSH's
 * caller, finding pages.img missing, fails the round) */
__attribute__((destructor)) static void wait_for_writer(void)
{
    if (claim_staged()) {
        write_staged();
        drop_staged();
    }
    int pid = writer_pid, status;
    if (pid > 0)
        reap(pid, &status);
}
