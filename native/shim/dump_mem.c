/*
 * Memory: one ck_vma per mapping in /proc/self/smaps, and the contents of
 * the pages that cannot be recreated from elsewhere, appended to pages.img.
 *
 *   anonymous (private or shared)   present or swapped pages only; pages that
 *                                   map the shared zero page are skipped
 *   private file mapping            only the pages the process wrote (COW'd
 *                                   anonymous copies); the rest comes back
 *                                   from the file
 *   shared file mapping             nothing: the contents live in the file
 *                                   (saved with the written files if writable)
 *   shared memory without a path    resident pages (mincore): shared anonymous,
 *   (CK_VMA_SHMEM)                  memfd, deleted /dev/shm files; the restore
 *                                   plan recreates the object once per job
 *   private mapping, deleted file   every readable page
 *   shared mapping, deleted file    nothing: mapped again from the file the
 *   (not on tmpfs)                  restore plan makes again (dump_deleted.c)
 *   [vdso], [vvar], [vvar_vclock]   nothing: the restorer moves the kernel's
 *
 * Present pages are found with the PAGEMAP_SCAN ioctl (Linux 6.7+), else by
 * reading /proc/self/pagemap.  Untouched reservations cost nothing.
 */
#include "shim.h"
#include "../common/sys.h"
#include "../common/util.h"
#include "../common/maps.h"
#include "../common/pagemap.h"

#include <errno.h>
#include <sys/file.h>
#include <sys/ioctl.h>
#include <sys/sysmacros.h>

#define PM_PRESENT (1ull << 63)
#define PM_SWAPPED (1ull << 62)
#define PM_FILE (1ull << 61)

#define REGION_VEC 4096
#define PAGEMAP_CHUNK 65536
#define BOUNCE_SIZE (1u << 20)

struct mem_ctx {
    struct ck_image *im;
    int pages_fd;
    int mem_fd;        /* /proc/self/mem, for pages we may not read directly */
    int pagemap_fd;
    int scan_ok;       /* PAGEMAP_SCAN available */
    uint64_t pages_off;
    uint64_t files_bytes;  /* files saved for shared writable mappings */
    uint64_t ref_bytes;    /* pages taken from earlier images */
    struct ck_vma *vma;
    struct ck_page_region *regions;
    uint64_t *pm;
    char *bounce;
    /* the run being accumulated */
    uint64_t run_start, run_end;
    /* runs accounted in pages.img but not yet written: contiguous in the
     * file from batch_off */
    struct ck_iov iov[CK_IOV_BATCH];
    int niov;
    uint64_t batch_off, batch_len;
    /* the file the previous mapping named, as stat() found it: a library is
     * mapped four or five times in a row, and one look serves them all */
    const char *stat_path;
    long stat_rc;
    struct stat stat_st;
};

/* write the batched runs; 0 or -errno */
static int write_batch(struct mem_ctx *m)
{
    int rc = m->niov ? ck_pwritev_all(m->pages_fd, m->iov, m->niov, m->batch_off) : 0;
    m->niov = 0;
    m->batch_len = 0;
    return rc;
}

/* copy [start, end) of our own memory to `off` in pages.img (batched: every
 * thread is parked, so the pages stay as they are until the batch goes).
 * A mapping a forked copy sees as it is now is left to the writer
 * (writeout.c), after the job resumes. */
static int copy_range(struct mem_ctx *m, uint64_t start, uint64_t end, uint64_t off)
{
    if (ck_vma_written_later(m->vma))
        return 0;
    if (m->vma->prot & PROT_READ) {
        if (m->niov == CK_IOV_BATCH || (m->niov && m->batch_off + m->batch_len != off)) {
            int rc = write_batch(m);
            if (rc < 0)
                return rc;
        }
        if (!m->niov)
            m->batch_off = off;
        m->iov[m->niov].base = (const void *)start;
        m->iov[m->niov].len = end - start;
        m->niov++;
        m->batch_len += end - start;
        return 0;
    }
    int rc = write_batch(m);
    return rc < 0 ? rc : ck_copy_unreadable(m->pages_fd, m->mem_fd, m->bounce, start, end - start, off);
}

static int flush_run(struct mem_ctx *m)
{
    if (m->run_end <= m->run_start)
        return 0;
    struct ck_page_run *r = ck_table_push(&m->im->runs);
    if (!r)
        return ck_image_fail(m->im, "too many page runs", 0, 0);
    r->vaddr = m->run_start;
    r->npages = (m->run_end - m->run_start) / CK_PAGE_SIZE;
    r->offset = m->pages_off;
    int rc = copy_range(m, m->run_start, m->run_end, m->pages_off);
    if (rc < 0)
        return ck_image_fail(m->im, "cannot write pages.img", 0, rc);
    m->pages_off += m->run_end - m->run_start;
    m->vma->nruns++;
    m->run_start = m->run_end = 0;
    return 0;
}

static int emit(struct mem_ctx *m, uint64_t start, uint64_t end)
{
    if (m->run_end == start && m->run_end > m->run_start) {
        m->run_end = end;
        return 0;
    }
    if (flush_run(m) < 0)
        return -1;
    m->run_start = start;
    m->run_end = end;
    return 0;
}

/* pages [start, end) as a run of an earlier image's pages file */
static int emit_ref(struct mem_ctx *m, uint64_t start, uint64_t end, uint32_t src, uint64_t offset)
{
    if (flush_run(m) < 0)
        return -1;
    struct ck_table *runs = &m->im->runs;
    if (m->vma->nruns) {
        struct ck_page_run *last = ck_table_at(runs, runs->count - 1);
        if (last->src == src && last->vaddr + last->npages * CK_PAGE_SIZE == start &&
            last->offset + last->npages * CK_PAGE_SIZE == offset) {
            last->npages += (end - start) / CK_PAGE_SIZE;
            m->ref_bytes += end - start;
            return 0;
        }
    }
    struct ck_page_run *r = ck_table_push(runs);
    if (!r)
        return ck_image_fail(m->im, "too many page runs", 0, 0);
    r->vaddr = start;
    r->npages = (end - start) / CK_PAGE_SIZE;
    r->offset = offset;
    r->src = src;
    m->vma->nruns++;
    m->ref_bytes += end - start;
    return 0;
}

/* present, not written since the previous image: where that image has them,
 * refer to it; what it does not have is copied */
static int emit_unchanged(struct mem_ctx *m, uint64_t start, uint64_t end)
{
    while (start < end) {
        uint64_t next = UINT64_MAX;
        const struct ck_page_run *r = ck_track_lookup(start, &next);
        if (!r) {
            uint64_t stop = next < end ? next : end;
            if (emit(m, start, stop) < 0)
                return -1;
            start = stop;
            continue;
        }
        uint64_t rend = r->vaddr + r->npages * CK_PAGE_SIZE;
        uint64_t stop = rend < end ? rend : end;
        uint32_t src = ck_track_source(m->im, r->src);
        int rc = src ? emit_ref(m, start, stop, src, r->offset + (start - r->vaddr)) : emit(m, start, stop);
        if (rc < 0)
            return -1;
        start = stop;
    }
    return 0;
}

/* A mapping under our write protection: one walk reports each present
 * page with its written bit and protects the written ones again.  Returns
 * 1 if the walk completed (the mapping stays tracked), 0 if it could not
 * run (the caller copies the mapping in full), -1 on error. */
static int scan_tracked(struct mem_ctx *m, uint64_t start, uint64_t end)
{
    struct ck_pm_scan_arg a;
    ck_pm_scan_present(&a, start, end, m->regions, REGION_VEC,
                       CK_PAGE_IS_WRITTEN | CK_PAGE_IS_PRESENT | CK_PAGE_IS_SWAPPED);
    a.flags = CK_PM_SCAN_WP_MATCHING | CK_PM_SCAN_CHECK_WPASYNC;
    int incremental = ck_track_incremental();
    uint64_t done = start;
    for (;;) {
        long n = ck_ioctl(m->pagemap_fd, CK_PAGEMAP_SCAN, &a);
        if (n < 0) {
            /* whatever it protected is copied now: still a sound base */
            m->run_start = m->run_end = 0;
            return 0;
        }
        for (long i = 0; i < n; i++) {
            const struct ck_page_region *g = &m->regions[i];
            /* after a full vector the next call may start before the end of
             * what was reported (and now reports it unwritten): skip that */
            uint64_t from = g->start > done ? g->start : done;
            if (from >= g->end)
                continue;
            int rc = (!incremental || (g->categories & CK_PAGE_IS_WRITTEN)) ? emit(m, from, g->end)
                                                                             : emit_unchanged(m, from, g->end);
            if (rc < 0)
                return -1;
            done = g->end;
        }
        if (a.walk_end >= end)
            break;
        a.start = a.walk_end;
    }
    return flush_run(m) < 0 ? -1 : 1;
}

static int scan_with_ioctl(struct mem_ctx *m, uint64_t start, uint64_t end, int anon_only)
{
    struct ck_pm_scan_arg a;
    ck_pm_scan_present(&a, start, end, m->regions, REGION_VEC, CK_PAGE_IS_PRESENT | CK_PAGE_IS_SWAPPED);
    if (anon_only) {  /* a private file mapping: only its copied-on-write pages */
        a.category_inverted |= CK_PAGE_IS_FILE;
        a.category_mask |= CK_PAGE_IS_FILE;
    }
    for (;;) {
        long n = ck_ioctl(m->pagemap_fd, CK_PAGEMAP_SCAN, &a);
        if (n < 0)
            return (int)n;
        for (long i = 0; i < n; i++)
            if (emit(m, m->regions[i].start, m->regions[i].end) < 0)
                return -EIO;
        if (a.walk_end >= end)
            return 0;
        a.start = a.walk_end;
    }
}

static int scan_with_pagemap(struct mem_ctx *m, uint64_t start, uint64_t end, int anon_only)
{
    for (uint64_t a = start; a < end;) {
        uint64_t npages = (end - a) / CK_PAGE_SIZE;
        if (npages > PAGEMAP_CHUNK)
            npages = PAGEMAP_CHUNK;
        long r = ck_pread(m->pagemap_fd, m->pm, npages * 8, (a / CK_PAGE_SIZE) * 8);
        if (r < 0)
            return ck_image_fail(m->im, "cannot read /proc/self/pagemap", 0, r);
        if (r == 0)
            break;
        npages = (uint64_t)r / 8;
        for (uint64_t i = 0; i < npages; i++) {
            uint64_t e = m->pm[i];
            int keep = (e & PM_SWAPPED) || ((e & PM_PRESENT) && !(anon_only && (e & PM_FILE)));
            if (keep && emit(m, a + i * CK_PAGE_SIZE, a + (i + 1) * CK_PAGE_SIZE) < 0)
                return -1;
        }
        a += npages * CK_PAGE_SIZE;
    }
    return 0;
}

static int dump_present(struct mem_ctx *m, uint64_t start, uint64_t end, int anon_only)
{
    if (m->scan_ok) {
        int rc = scan_with_ioctl(m, start, end, anon_only);
        if (rc == 0)
            return flush_run(m);
        if (rc != -ENOTTY && rc != -EINVAL)
            return rc == -EIO ? -1 : ck_image_fail(m->im, "PAGEMAP_SCAN failed", 0, rc);
        m->scan_ok = 0;  /* older kernel: fall back for good */
        m->run_start = m->run_end = 0;
    }
    if (scan_with_pagemap(m, start, end, anon_only) < 0)
        return -1;
    return flush_run(m);
}

/* An incremental dump without write protection (see track.c): a present
 * page whose hash is the one the previous image recorded at its address is
 * taken from that image; the others are copied. */
static int dump_hashed(struct mem_ctx *m, uint64_t start, uint64_t end)
{
    if (!m->scan_ok)
        return dump_present(m, start, end, 0);
    struct ck_pm_scan_arg a;
    ck_pm_scan_present(&a, start, end, m->regions, REGION_VEC, CK_PAGE_IS_PRESENT | CK_PAGE_IS_SWAPPED);
    uint64_t done = start;
    for (;;) {
        long n = ck_ioctl(m->pagemap_fd, CK_PAGEMAP_SCAN, &a);
        if (n < 0) {
            if (done == start && (n == -ENOTTY || n == -EINVAL))
                return dump_present(m, start, end, 0);  /* nothing emitted yet: the slow way */
            return ck_image_fail(m->im, "PAGEMAP_SCAN failed", 0, n);
        }
        for (long i = 0; i < n; i++) {
            const struct ck_page_region *g = &m->regions[i];
            uint64_t from = g->start > done ? g->start : done;
            if (from >= g->end)
                continue;
            /* consecutive pages with the same verdict go out together */
            uint64_t seg = from;
            int seg_same = -1;
            for (uint64_t p = from; p <= g->end; p += CK_PAGE_SIZE) {
                int same = 0;
                if (p < g->end) {
                    uint64_t prev;
                    same = ck_track_prev_hash(p, &prev) && prev == ck_page_hash((const void *)p);
                }
                if (p == g->end || (seg_same >= 0 && same != seg_same)) {
                    int rc = seg_same ? emit_unchanged(m, seg, p) : emit(m, seg, p);
                    if (rc < 0)
                        return -1;
                    seg = p;
                }
                seg_same = same;
            }
            done = g->end;
        }
        if (a.walk_end >= end)
            break;
        a.start = a.walk_end;
    }
    return flush_run(m);
}

/* a shared memory object: the pages resident in it (page cache, not just
 * this process's page tables), so pages another process wrote are kept */
static int dump_resident(struct mem_ctx *m, uint64_t start, uint64_t end)
{
    unsigned char *vec = (unsigned char *)m->pm;
    uint64_t chunk = (uint64_t)PAGEMAP_CHUNK * 8 * CK_PAGE_SIZE;
    for (uint64_t a = start; a < end; a += chunk) {
        uint64_t e = end - a > chunk ? a + chunk : end;
        long rc = ck_mincore((void *)a, e - a, vec);
        if (rc < 0)
            return ck_image_fail(m->im, "cannot read page residency (mincore)", 0, rc);
        for (uint64_t i = 0; i < (e - a) / CK_PAGE_SIZE; i++)
            if ((vec[i] & 1) && emit(m, a + i * CK_PAGE_SIZE, a + (i + 1) * CK_PAGE_SIZE) < 0)
                return -1;
    }
    return flush_run(m);
}

/* a deleted file's private mapping: every page that can be read */
static int dump_all_readable(struct mem_ctx *m, uint64_t start, uint64_t end)
{
    for (uint64_t a = start; a < end;) {
        long r = ck_pread(m->mem_fd, m->bounce, CK_PAGE_SIZE, a);
        if (r == CK_PAGE_SIZE) {
            if (emit(m, a, a + CK_PAGE_SIZE) < 0)
                return -1;
        } else if (flush_run(m) < 0) {
            return -1;
        }
        a += CK_PAGE_SIZE;
    }
    return flush_run(m);
}

static uint32_t madv_bits(uint32_t vmf)
{
    uint32_t m = 0;
    if (vmf & CK_VMF_HUGEPAGE) m |= CK_MADV_HUGEPAGE;
    if (vmf & CK_VMF_NOHUGEPAGE) m |= CK_MADV_NOHUGEPAGE;
    if (vmf & CK_VMF_DONTCOPY) m |= CK_MADV_DONTFORK;
    if (vmf & CK_VMF_WIPEONFORK) m |= CK_MADV_WIPEONFORK;
    if (vmf & CK_VMF_DONTDUMP) m |= CK_MADV_DONTDUMP;
    if (vmf & CK_VMF_MERGEABLE) m |= CK_MADV_MERGEABLE;
    if (vmf & CK_VMF_RANDOM) m |= CK_MADV_RANDOM;
    if (vmf & CK_VMF_SEQ) m |= CK_MADV_SEQUENTIAL;
    if (vmf & CK_VMF_LOCKONFAULT) m |= CK_MADV_LOCKONFAULT;
    return m;
}

/* one of this process's descriptors is the shared memory object ino (its
 * contents and size are saved with it: dump_fds.c runs first) */
static int holds_shmem(const struct ck_image *im, uint64_t ino)
{
    for (uint64_t i = 0; i < im->fds.count; i++) {
        const struct ck_fd *f = ck_table_at((struct ck_table *)&im->fds, i);
        if (f->type == CK_FD_SHMEM && f->ino == ino)
            return 1;
    }
    return 0;
}

static int on_mapping(const struct ck_map_entry *e, void *vctx)
{
    struct mem_ctx *m = vctx;
    struct ck_image *im = m->im;
    const char *path = e->path;

    if (!ck_strcmp(path, "[vsyscall]") || !ck_strcmp(path, "[uprobes]"))
        return 0;  /* not real mappings of the process */
    if (e->vmflags & CK_VMF_SHADOWSTACK)
        return ck_image_fail(im, "shadow stack mappings are not supported", 0, 0);

    struct ck_vma *v = ck_table_push(&im->vmas);
    if (!v)
        return ck_image_fail(im, "too many memory mappings", 0, 0);
    m->vma = v;
    v->start = e->start;
    v->end = e->end;
    v->pgoff = e->offset;
    v->prot = e->prot;
    v->madv = madv_bits(e->vmflags);
    v->first_run = im->runs.count;
    if (e->shared)
        v->flags |= CK_VMA_SHARED;
    if (e->vmflags & CK_VMF_GROWSDOWN)
        v->flags |= CK_VMA_GROWSDOWN;
    if (e->vmflags & CK_VMF_NORESERVE)
        v->flags |= CK_VMA_NORESERVE;
    if (e->vmflags & CK_VMF_LOCKED)
        v->flags |= CK_VMA_LOCKED;
    if (e->vmflags & CK_VMF_MAYWRITE)
        v->flags |= CK_VMA_MAYWRITE;

    if (ck_arena_contains(e->start, e->end)) {
        v->flags |= CK_VMA_ANON | CK_VMA_NOCONTENT;
        return 0;
    }
    if (!ck_strcmp(path, "[vdso]")) {
        v->flags |= CK_VMA_VDSO;
        return 0;
    }
    if (!ck_strcmp(path, "[vvar]") || !ck_strcmp(path, "[vvar_vclock]")) {
        v->flags |= CK_VMA_VVAR;
        v->path = ck_image_string(im, path);
        return 0;
    }
    if (e->vmflags & (CK_VMF_IO | CK_VMF_PFNMAP))
        return ck_image_fail(im, "device memory is mapped and cannot be saved", path, 0);
    if (e->vmflags & CK_VMF_DONTEXPAND)  /* only special mappings (a driver's or perf's ring) are made so */
        return ck_image_fail(im, "a special mapping (VmFlags \"de\": a driver's or perf's ring buffer) "
                                 "cannot be mapped again", path[0] ? path : "anonymous", 0);
    if (!ck_strcmp(path, "[heap]"))
        v->flags |= CK_VMA_HEAP;
    if (!ck_strcmp(path, "[stack]"))
        v->flags |= CK_VMA_STACK;

    /* shmat: the segment (the inode is its shmid) is saved once for the
     * job by the agent, from the job's IPC namespace, and kept under its id;
     * this process only says where it is attached */
    if (ck_startswith(path, "/SYSV") && e->shared && e->dev_major == 0) {
        v->flags |= CK_VMA_SYSV;
        v->ino = e->ino;
        v->path = ck_image_string(im, path);
        return 0;
    }
    /* MAP_SHARED | MAP_ANONYMOUS, memfd, a deleted tmpfs file: no path to map
     * again; other processes of the job may share it (the plan matches them) */
    if (e->shared && e->dev_major == 0 && (ck_endswith(path, " (deleted)") || ck_startswith(path, "/memfd:"))) {
        v->flags |= CK_VMA_SHMEM;
        v->dev = makedev(e->dev_major, e->dev_minor);  /* as stat() reports it */
        v->ino = e->ino;
        v->path = ck_image_string(im, path);
        return dump_resident(m, e->start, e->end);
    }
    /* MAP_PRIVATE of a memfd this process holds: mapped again from the
     * object the plan recreates, so that the pages it did not copy on write
     * still show the file; only the copied ones are saved.  (Not held: its
     * readable pages are saved, as for a deleted file, below.) */
    if (!e->shared && e->dev_major == 0 && ck_startswith(path, "/memfd:") && holds_shmem(im, e->ino)) {
        v->flags |= CK_VMA_SHMEM;
        v->dev = makedev(e->dev_major, e->dev_minor);
        v->ino = e->ino;
        v->path = ck_image_string(im, path);
        return dump_present(m, e->start, e->end, 1);
    }
    int anonymous = path[0] == 0 || path[0] == '[';
    if (anonymous) {
        v->flags |= CK_VMA_ANON;
        if (!e->shared && ck_track_registered(e->start, e->end, e->vmflags)) {
            uint64_t first = im->runs.count, refs = m->ref_bytes;
            int rc = scan_tracked(m, e->start, e->end);
            if (rc < 0)
                return -1;
            if (rc == 1) {
                v->flags |= CK_VMA_TRACKED;
                return 0;
            }
            im->runs.count = first;  /* start the mapping over, in full */
            v->nruns = 0;
            m->ref_bytes = refs;
        }
        if (!e->shared && (e->prot & PROT_READ) && ck_track_hashing())
            return dump_hashed(m, e->start, e->end);
        return dump_present(m, e->start, e->end, 0);
    }

    v->path = ck_image_string(im, path);
    int same_file = 0;
    if (!ck_endswith(path, " (deleted)")) {
        if (!m->stat_path || ck_strcmp(m->stat_path, path) != 0) {
            m->stat_rc = ck_stat(path, &m->stat_st);
            m->stat_path = path;  /* in the maps text, which outlives the parse */
        }
        same_file = m->stat_rc == 0 && m->stat_st.st_ino == e->ino &&
                    major(m->stat_st.st_dev) == e->dev_major && minor(m->stat_st.st_dev) == e->dev_minor;
    }
    const struct stat *st = &m->stat_st;
    if (!same_file) {
        /* deleted, or replaced on disk since it was mapped */
        if (e->shared && ck_endswith(path, " (deleted)"))
            return ck_dump_deleted_mapping(im, v, e);  /* dump_deleted.c */
        if (e->shared)
            return ck_image_fail(im, "a shared mapping of a file replaced on disk since it was mapped", path, 0);
        v->flags |= CK_VMA_ANON | CK_VMA_DELETED;
        return dump_all_readable(m, e->start, e->end);
    }
    v->flags |= CK_VMA_FILE;
    v->dev = st->st_dev;
    v->ino = st->st_ino;
    v->file_size = (uint64_t)st->st_size;
    v->mtime_ns = (int64_t)st->st_mtim.tv_sec * 1000000000LL + st->st_mtim.tv_nsec;
    if (e->shared)  /* contents live in the file; saved if the job can change them */
        return (e->vmflags & CK_VMF_MAYWRITE) ? ck_save_written_file(im, path, &m->files_bytes) : 0;
    return dump_present(m, e->start, e->end, 1);
}

/* /proc/self/smaps computes every mapping's page counts, which takes tens
 * of milliseconds for gigabytes: the agent has it read (PREMAP) before the
 * process is parked.  The dump then reads /proc/self/maps, which is cheap,
 * and uses the early copy if the mappings are still the same ones (their
 * header lines match one for one) and no advice was given since (below);
 * else it reads smaps again. */
static long premaps_len = -1;

/* Advice and locks given to a whole mapping (madvise, mlock: VmFlags such
 * as dd, wf, dc, lo) leave its header line alone, and the early copy would
 * miss them: the agent reads it a phase before the pause (agent/checkpoint.py
 * ready), while the job runs on.  Every such call made through libc counts
 * here (interpose.c), and a copy read before the latest one is not used.
 * A raw syscall(SYS_madvise) goes unseen, as before. */
static unsigned long advice_calls;  /* so far */
static unsigned long premaps_calls; /* when the early copy began */

void ck_premaps_stale(void) { __atomic_add_fetch(&advice_calls, 1, __ATOMIC_SEQ_CST); }

int ck_premaps_capture(void)
{
    size_t cap;
    char *buf = ck_arena_premaps(&cap);
    premaps_len = -1;
    if (!buf)
        return -1;
    /* before the read: a call made while smaps is read makes the copy stale */
    premaps_calls = __atomic_load_n(&advice_calls, __ATOMIC_SEQ_CST);
    long n = ck_read_file("/proc/self/smaps", buf, cap);
    if (n < 0)
        return (int)n;
    premaps_len = n;
    return 0;
}

static int is_header(const char *s)
{
    return (*s >= '0' && *s <= '9') || (*s >= 'a' && *s <= 'f');
}

/* the smaps text read early, if its mappings are exactly those of maps;
 * the caller may parse it in place (it serves one dump) */
static char *premaps_if_current(const char *maps, long n, long *len)
{
    size_t cap;
    char *sm = ck_arena_premaps(&cap);
    long sl = premaps_len;
    premaps_len = -1;  /* good for one dump */
    if (!sm || sl < 0 || __atomic_load_n(&advice_calls, __ATOMIC_SEQ_CST) != premaps_calls)
        return 0;
    long i = 0, j = 0;
    while (i < n) {
        while (j < sl && !is_header(sm + j)) {  /* skip smaps' field lines */
            while (j < sl && sm[j] != '\n')
                j++;
            j++;
        }
        /* compare one line */
        while (i < n && j < sl && maps[i] == sm[j] && maps[i] != '\n') {
            i++;
            j++;
        }
        if (i >= n || j >= sl || maps[i] != '\n' || sm[j] != '\n')
            return 0;
        i++;
        j++;
    }
    while (j < sl && !is_header(sm + j)) {
        while (j < sl && sm[j] != '\n')
            j++;
        j++;
    }
    if (j < sl)
        return 0;  /* a mapping gone since */
    *len = sl;
    return sm;
}

int ck_dump_memory(struct ck_image *im, uint64_t *pages_bytes, uint64_t *files_bytes, uint64_t *ref_bytes)
{
    struct mem_ctx m;
    ck_memset(&m, 0, sizeof(m));
    m.im = im;
    m.scan_ok = 1;
    m.regions = ck_arena_alloc(REGION_VEC * sizeof(struct ck_page_region));
    m.pm = ck_arena_alloc(PAGEMAP_CHUNK * 8);
    m.bounce = ck_arena_alloc(BOUNCE_SIZE);
    size_t cap = 64u << 20;
    char *maps = ck_arena_alloc(cap);
    if (!m.regions || !m.pm || !m.bounce || !maps)
        return ck_image_fail(im, "cannot allocate checkpoint scratch memory", 0, 0);

    long n = ck_read_file("/proc/self/maps", maps, cap);
    if (n < 0)
        return ck_image_fail(im, "cannot read /proc/self/maps", 0, n);
    long early = 0;
    char *sm = premaps_if_current(maps, n, &early);
    if (sm) {
        maps = sm;  /* parsed in place: the early copy serves this dump only */
        n = early;
    } else {
        n = ck_read_file("/proc/self/smaps", maps, cap);
        if (n < 0)
            return ck_image_fail(im, "cannot read /proc/self/smaps", 0, n);
    }

    /* renamed to pages.img once complete (writeout.c); locked until then,
     * so that the agent can wait for a writer whose parent is gone */
    /* read as well: the writer hashes what the pause wrote (checksum.c) */
    /* made before the pause (image_dir.c), or now */
    m.pages_fd = im->pages_fd >= 0 ? im->pages_fd
                                   : (int)ck_openat(im->dirfd, "pages.img.part", O_RDWR | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
    if (m.pages_fd < 0)
        return ck_image_fail(im, "cannot create pages.img", 0, m.pages_fd);
    if (im->pages_fd < 0)
        ck_image_add_own_fd(im, m.pages_fd);
    im->pages_fd = m.pages_fd;
    long lk = ck_flock(m.pages_fd, LOCK_EX);
    if (lk < 0)
        return ck_image_fail(im, "cannot lock pages.img.part", 0, lk);
    m.mem_fd = (int)ck_open("/proc/self/mem", O_RDONLY | O_CLOEXEC, 0);
    m.pagemap_fd = (int)ck_open("/proc/self/pagemap", O_RDONLY | O_CLOEXEC, 0);
    int rc;
    if (m.mem_fd < 0 || m.pagemap_fd < 0)
        rc = ck_image_fail(im, "cannot open /proc/self/mem or pagemap", 0, m.mem_fd < 0 ? m.mem_fd : m.pagemap_fd);
    else
        rc = ck_parse_maps(maps, (size_t)n, on_mapping, &m);
    if (rc == 0) {
        int w = write_batch(&m);
        if (w < 0)
            rc = ck_image_fail(im, "cannot write pages.img", 0, w);
    }
    if (m.mem_fd >= 0)
        ck_close(m.mem_fd);
    if (m.pagemap_fd >= 0)
        ck_close(m.pagemap_fd);
    *pages_bytes = m.pages_off;
    *files_bytes += m.files_bytes;
    *ref_bytes = m.ref_bytes;
    return rc ? -1 : 0;
}
