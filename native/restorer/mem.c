/*
 * The address space: choosing the restorer's hole, clearing everything else,
 * mapping the image back, moving the kernel's vdso/vvar to where the image
 * expects them, and the mm fields (brk, arg/env areas, auxv, exe).
 */
#include "restorer.h"

#include <errno.h>
#include <sys/prctl.h>
#include <sys/shm.h>

#define TASK_TOP 0x7ffffffff000ull
#define HOLE_FIRST 0x200000000ull   /* 8 GiB */
#define HOLE_STEP 0x40000000ull     /* 1 GiB */

#ifndef MAP_FIXED_NOREPLACE
#define MAP_FIXED_NOREPLACE 0x100000
#endif
#ifndef MADV_WIPEONFORK
#define MADV_WIPEONFORK 18
#endif
#ifndef MLOCK_ONFAULT
#define MLOCK_ONFAULT 1
#endif
#ifndef MADV_POPULATE_WRITE
#define MADV_POPULATE_WRITE 23
#endif

/* Runs at least this long get their memory allocated in one call before
 * the read: the kernel fills a range far faster than it takes one fault
 * per page from the copy. */
#define POPULATE_MIN (2ull << 20)

/* A long run is read in pieces of this size, the next piece's read from
 * storage started (readahead: the kernel starts up to its readahead window
 * of it) before this piece's memory is allocated and copied into, so that
 * allocating fresh memory overlaps the disk instead of all the allocation
 * coming first and all the reading after (BENCHMARKS.md, first section). */
#define FILL_PIECE (64ull << 20)

/* Fresh huge pages slower than this (bytes a second) and the rest of a run
 * is filled in 4 KiB pages (fill_run). */
#define HUGE_MIN_RATE (1ull << 30)
#ifndef MADV_NOHUGEPAGE
#define MADV_NOHUGEPAGE 15
#endif

static int overlaps(uint64_t a0, uint64_t a1, uint64_t b0, uint64_t b1) { return a0 < b1 && b0 < a1; }

static const char *special_name(const struct rst_image *im, const struct ck_vma *v)
{
    return (v->flags & CK_VMA_VDSO) ? "[vdso]" : rst_str(im, v->path);
}

/* The image's vdso/vvar block must match this kernel's, piece for piece. */
void rst_check_layout(const struct rst_image *im)
{
    uint64_t img_base = UINT64_MAX, cur_base = UINT64_MAX;
    int nimg = 0;
    for (uint32_t i = 0; i < im->nvmas; i++) {
        const struct ck_vma *v = &im->vmas[i];
        if (v->end > TASK_TOP)
            rst_fail("the image maps memory above the 47-bit user address space; not supported", 0, 0);
        if (v->flags & (CK_VMA_VDSO | CK_VMA_VVAR)) {
            nimg++;
            if (v->start < img_base)
                img_base = v->start;
        }
    }
    for (int j = 0; j < rst.ncur_special; j++)
        if (rst.cur_special[j].start < cur_base)
            cur_base = rst.cur_special[j].start;
    if (nimg != rst.ncur_special)
        rst_fail("this kernel's vdso/vvar layout differs from the checkpointed one; restart on a node with the same kernel", 0, 0);
    for (uint32_t i = 0; i < im->nvmas; i++) {
        const struct ck_vma *v = &im->vmas[i];
        if (!(v->flags & (CK_VMA_VDSO | CK_VMA_VVAR)))
            continue;
        const char *name = special_name(im, v);
        int ok = 0;
        for (int j = 0; j < rst.ncur_special; j++) {
            const struct rst_special *s = &rst.cur_special[j];
            if (ck_strcmp(s->name, name) == 0 && s->end - s->start == v->end - v->start &&
                s->start - cur_base == v->start - img_base)
                ok = 1;
        }
        if (!ok)
            rst_fail("this kernel's vdso/vvar layout differs from the checkpointed one; restart on a node with the same kernel", name, 0);
    }
}

uint64_t rst_find_hole(const struct rst_image *im, uint64_t size)
{
    for (uint64_t c = HOLE_FIRST; c + size < TASK_TOP - HOLE_STEP; c += HOLE_STEP) {
        int busy = 0;
        for (uint32_t i = 0; i < im->nvmas && !busy; i++)
            busy = overlaps(c, c + size, im->vmas[i].start, im->vmas[i].end);
        for (int i = 0; i < rst_ncur_maps && !busy; i++)
            busy = overlaps(c, c + size, rst_cur_maps[i].start, rst_cur_maps[i].end);
        if (!busy)
            return c;
    }
    rst_fail("no free address range for the restorer: the image fills the address space", 0, 0);
}

/* move the kernel's vdso/vvar into the hole, keeping their relative layout */
void rst_park_specials(void)
{
    uint64_t base = UINT64_MAX;
    for (int j = 0; j < rst.ncur_special; j++)
        if (rst.cur_special[j].start < base)
            base = rst.cur_special[j].start;
    for (int j = 0; j < rst.ncur_special; j++) {
        struct rst_special *s = &rst.cur_special[j];
        uint64_t len = s->end - s->start;
        uint64_t to = rst.hole_start + rst.park_off + (s->start - base);
        void *r = ck_mremap((void *)s->start, len, len, MREMAP_MAYMOVE | MREMAP_FIXED, (void *)to);
        if (ck_mmap_failed(r))
            rst_fail("cannot move the vdso out of the way", s->name, (long)r);
        s->start = to;
        s->end = to + len;
    }
}

void rst_unmap_all_but_hole(void)
{
    long rc = ck_munmap(0, rst.hole_start);
    if (rc < 0)
        rst_fail("cannot clear the address space below the restorer", 0, rc);
    uint64_t end = rst.hole_start + rst.hole_len;
    rc = ck_munmap((void *)end, TASK_TOP - end);
    if (rc < 0)
        rst_fail("cannot clear the address space above the restorer", 0, rc);
}

static uint64_t piece_at(uint64_t len, uint64_t at) { return len - at < FILL_PIECE ? len - at : FILL_PIECE; }

static uint64_t now_ns(void)
{
    struct timespec ts;
    if (ck_clock_gettime(CLOCK_MONOTONIC, &ts) < 0)
        return 0;
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

/*
 * Memory the job advised MADV_HUGEPAGE is filled in huge pages, as the job
 * had it, while they come cheap.  On a VM whose host takes freed memory
 * back (free page reporting) fresh huge pages were faulted in at
 * 0.27-0.51 GB/s here where fresh 4 KiB pages came at 1.3-2.2 GB/s
 * (BENCHMARKS.md, first section), and which kind a piece gets depends on
 * how much memory was freed how recently.  So each piece of such a run is
 * timed; once one is slower than HUGE_MIN_RATE, the rest of the run is
 * marked MADV_NOHUGEPAGE and filled in 4 KiB pages (`small`), and map_one
 * gives the mapping its advice back after the fill.  The job's mappings
 * and advice are then as it had them; only what backs them differs: 4 KiB
 * pages until khugepaged collapses them, so the next checkpoints' writers
 * fork slower (about 20 ms a GiB) until then.
 */
static struct {
    int huge;                /* the run's mapping is advised MADV_HUGEPAGE */
    volatile uint32_t small; /* the rest of the run goes to 4 KiB pages */
} thp;

/* piece c of the run of len bytes at addr: its memory allocated */
static void populate_piece(uint64_t addr, uint64_t len, uint32_t c)
{
    uint64_t at = (uint64_t)c * FILL_PIECE, n = piece_at(len, at);
    int timed = thp.huge && !__atomic_load_n(&thp.small, __ATOMIC_ACQUIRE);
    uint64_t t0 = timed ? now_ns() : 0;
    (void)ck_madvise((void *)(addr + at), n, MADV_POPULATE_WRITE);  /* best effort: 5.14+ */
    if (!t0 || now_ns() - t0 <= n * 1000000000ull / HUGE_MIN_RATE || at + n >= len)
        return;
    if (!__atomic_exchange_n(&thp.small, 1, __ATOMIC_ACQ_REL))
        (void)ck_madvise((void *)(addr + at + n), len - at - n, MADV_NOHUGEPAGE);  /* best effort */
}

/*
 * A second thread allocates a long run's memory alongside the main thread.
 * On this VM fresh memory the host has taken back (free page reporting)
 * is faulted in page by page at about 0.5 GB/s per core, and two cores
 * fault it in at about twice that (BENCHMARKS.md, first section).  Pieces
 * are claimed in order from `claim`: the helper takes the next unclaimed
 * one, populates it, then publishes how far it got in `hdone` (it finishes
 * each piece before it claims the next, so every piece it claimed below
 * hdone is done).  The main thread does every read, in order; before it
 * reads a piece it populates it itself if it is still unclaimed, and if the
 * helper has it and is not done, populates the next unclaimed ones until
 * it is (populated()).  The helper only allocates (best effort, as
 * before): every byte is still read by the main thread, and a failed read
 * fails the restore as before.
 *
 * Its thread id is one of this process's own threads' (clone3 set_tid), not
 * yet recreated: a fresh id could be one another process of the job needs
 * for its threads at that moment.  Its stack is the spare thread-stack slot
 * in the hole (there is one more slot than threads to recreate).  It is gone,
 * id released, before fill_run returns.
 */
struct fill_helper {
    volatile uint64_t addr, len;
    volatile uint32_t npieces;
    volatile uint32_t claim;   /* next unclaimed piece */
    volatile uint32_t hdone;   /* futex: the helper's pieces below this are populated */
    volatile uint32_t alive;   /* futex: the helper's thread id until it has exited (CLONE_CHILD_CLEARTID) */
    int32_t tid;               /* the id it borrows, or 0: no helper */
    uint32_t stack_slot;
    int chosen;
};
static struct fill_helper helper;
static uint32_t mine[64], mine_head, mine_tail;  /* pieces ahead the main thread populated itself */

struct rst_fill_clone_args {
    uint64_t flags, pidfd, child_tid, parent_tid, exit_signal;
    uint64_t stack, stack_size, tls, set_tid, set_tid_size, cgroup;
};

__attribute__((noreturn)) static void helper_entry(const struct ck_thread *unused)
{
    (void)unused;
    for (;;) {
        uint32_t c = __atomic_load_n(&helper.claim, __ATOMIC_ACQUIRE);
        if (c >= helper.npieces)
            break;
        if (!__atomic_compare_exchange_n(&helper.claim, &c, c + 1, 0, __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE))
            continue;
        populate_piece(helper.addr, helper.len, c);
        __atomic_store_n(&helper.hdone, c + 1, __ATOMIC_RELEASE);
        ck_futex_wake_all(&helper.hdone);
    }
    ck_exit_thread(0);
}

/* the thread id and stack the helper borrows: once per restore */
static void helper_choose(const struct rst_image *im)
{
    if (helper.chosen)
        return;
    helper.chosen = 1;
    for (uint32_t i = 0; i < im->nthreads && !helper.tid; i++)
        if (!(im->threads[i].flags & CK_THREAD_MAIN) && im->threads[i].tid > 0)
            helper.tid = im->threads[i].tid;
    helper.stack_slot = im->nthreads - 1;  /* rst_restore_threads uses slots 0 .. nthreads-2 */
}

/* start the helper on the run of len bytes at addr; 0: none, populate alone */
static int helper_start(uint64_t addr, uint64_t len, uint32_t npieces)
{
    helper.addr = addr;
    helper.len = len;
    helper.npieces = npieces;
    helper.claim = 0;
    helper.hdone = 0;
    mine_head = mine_tail = 0;
    if (!helper.tid)
        return 0;
    helper.alive = (uint32_t)helper.tid;
    struct rst_fill_clone_args a;
    int64_t tid = helper.tid;
    ck_memset(&a, 0, sizeof(a));
    a.flags = CLONE_VM | CLONE_FS | CLONE_FILES | CLONE_SIGHAND | CLONE_THREAD | CLONE_SYSVSEM | CLONE_CHILD_CLEARTID;
    a.child_tid = (uint64_t)&helper.alive;
    a.stack = rst.hole_start + rst.stacks_off + RST_MAIN_STACK + (uint64_t)helper.stack_slot * RST_THREAD_STACK;
    a.stack_size = RST_THREAD_STACK;
    a.set_tid = (uint64_t)&tid;
    a.set_tid_size = 1;
    long rc = rst_clone3_thread(&a, sizeof(a), helper_entry, 0);
    if (rc < 0) {
        helper.alive = 0;
        helper.tid = 0;  /* not again this restore: populate alone, as before */
        return 0;
    }
    return 1;
}

/* wait until the helper has exited and its thread id is free again */
static void helper_finish(void)
{
    for (;;) {
        uint32_t t = __atomic_load_n(&helper.alive, __ATOMIC_ACQUIRE);
        if (!t)
            break;
        ck_futex(&helper.alive, FUTEX_WAIT, t, 0);  /* the kernel's clear-tid wake is not private */
    }
    /* the clear-tid wake comes before the exiting thread is released */
    while (ck_tgkill((int)ck_getpid(), helper.tid, 0) != -ESRCH)
        ck_sched_yield();
}

/* The main thread, before it reads piece i with the helper running: piece i
 * populated.  It takes i itself if unclaimed; if the helper has it, it
 * populates the next unclaimed pieces meanwhile (remembered in `mine`, in
 * order) rather than wait, so that both threads allocate. */

static void populated(uint64_t addr, uint64_t len, uint32_t i)
{
    if (mine_head != mine_tail && mine[mine_head % 64] == i) {
        mine_head++;
        return;
    }
    for (;;) {
        uint32_t h = __atomic_load_n(&helper.hdone, __ATOMIC_ACQUIRE);
        uint32_t c = __atomic_load_n(&helper.claim, __ATOMIC_ACQUIRE);
        if (c == i) {
            if (__atomic_compare_exchange_n(&helper.claim, &c, i + 1, 0, __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE)) {
                populate_piece(addr, len, i);
                return;
            }
            continue;
        }
        /* c > i: the helper claimed i (every piece of ours is in `mine`) */
        if (h > i)
            return;
        if (c < helper.npieces && mine_tail - mine_head < 64) {
            if (__atomic_compare_exchange_n(&helper.claim, &c, c + 1, 0, __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE)) {
                populate_piece(addr, len, c);
                mine[mine_tail++ % 64] = c;
            }
            continue;
        }
        ck_futex_wait(&helper.hdone, h, -1);
    }
}

#ifndef POSIX_FADV_DONTNEED
#define POSIX_FADV_DONTNEED 4
#endif

/* len bytes at offset off of fd into memory at addr (FILL_PIECE).  own: fd
 * is this process's own pages.img (a run with src 0), and each piece is
 * dropped from the page cache once copied.  The agent's checksum reads every
 * image alongside its restorer and ahead of it (check_pending in
 * ckptd/image/manifest.py), so the pages the cache gives back are the ones
 * its next read takes, still backed: the restore needs fresh memory for the
 * process and the agent's lead, not also for a page cache as large as the
 * image, and on this VM fresh memory is the restart's largest cost
 * (BENCHMARKS.md, first section).  A reader that comes later after all (the
 * agent when behind; rank 1's restorer reading rank 0's pages under --dedup)
 * reads the piece from storage again: slower, the same bytes.  Returns
 * whether the run went to 4 KiB pages (populate_piece). */
static int fill_run(int fd, uint64_t addr, uint64_t len, uint64_t off, int populate, int own, int huge)
{
    uint32_t npieces = (uint32_t)((len + FILL_PIECE - 1) / FILL_PIECE);
    thp.huge = huge;
    thp.small = 0;
    int helped = populate && npieces > 1 && helper_start(addr, len, npieces);
    if (len > FILL_PIECE)
        (void)ck_sc3(SYS_readahead, fd, off, FILL_PIECE);  /* best effort, as each one below */
    uint32_t i = 0;
    for (uint64_t at = 0; at < len; at += FILL_PIECE, i++) {
        uint64_t n = piece_at(len, at);
        if (at + n < len)
            (void)ck_sc3(SYS_readahead, fd, off + at + n, piece_at(len, at + n));
        if (populate && !helped)
            populate_piece(addr, len, i);
        else if (populate)
            populated(addr, len, i);
        rst_pread_all(fd, (void *)(addr + at), n, off + at, "cannot read pages.img (truncated?)");
        if (own)
            (void)ck_sc6(SYS_fadvise64, fd, (long)(off + at), (long)n, POSIX_FADV_DONTNEED, 0, 0);  /* best effort */
    }
    if (helped)
        helper_finish();
    return (int)thp.small;
}

/* returns whether a run went to 4 KiB pages: the mapping's advice is then
 * to be given back */
static int fill_pages(const struct rst_image *im, const struct ck_vma *v)
{
    int small = 0;
    for (uint64_t r = v->first_run; r < v->first_run + v->nruns; r++) {
        const struct ck_page_run *run = &im->runs[r];
        uint64_t len = run->npages * CK_PAGE_SIZE;
        if (run->vaddr < v->start || run->vaddr + len > v->end)
            rst_fail("corrupt image: page run outside its mapping", 0, 0);
        int fd = run->src ? rst.source_fd[run->src - 1] : rst.pages_fd;
        helper_choose(im);
        /* not a private file or memfd mapping: its other pages must stay the file's */
        int populate = len >= POPULATE_MIN && !(v->flags & (CK_VMA_FILE | CK_VMA_SHMEM));
        if (rst.sealed) {  /* encrypted: whole chunks read, checked and decrypted */
            if (populate)
                (void)ck_madvise((void *)run->vaddr, len, MADV_POPULATE_WRITE);  /* best effort: 5.14+ */
            rst_seal_read(run->src, (void *)run->vaddr, len, run->offset);
        } else {
            small |= fill_run(fd, run->vaddr, len, run->offset, populate, !run->src, (v->madv & CK_MADV_HUGEPAGE) != 0);
        }
    }
    return small;
}

static void replay_advice(const struct ck_vma *v)
{
    static const struct {
        uint32_t bit;
        int advice;
    } table[] = {
        {CK_MADV_HUGEPAGE, MADV_HUGEPAGE}, {CK_MADV_NOHUGEPAGE, MADV_NOHUGEPAGE},
        {CK_MADV_DONTFORK, MADV_DONTFORK}, {CK_MADV_WIPEONFORK, MADV_WIPEONFORK},
        {CK_MADV_DONTDUMP, MADV_DONTDUMP}, {CK_MADV_MERGEABLE, MADV_MERGEABLE},
        {CK_MADV_RANDOM, MADV_RANDOM}, {CK_MADV_SEQUENTIAL, MADV_SEQUENTIAL},
    };
    for (unsigned i = 0; i < sizeof(table) / sizeof(table[0]); i++)
        if (v->madv & table[i].bit)
            ck_madvise((void *)v->start, v->end - v->start, table[i].advice);
}

static void fail_at(const char *what, const struct ck_vma *v, long rc) __attribute__((noreturn));
static void fail_at(const char *what, const struct ck_vma *v, long rc)
{
    char where[32];
    struct ck_buf b;
    ck_buf_init(&b, where, sizeof(where));
    ck_buf_str(&b, "0x");
    ck_buf_hex(&b, v->start);
    rst_fail(what, where, rc);
}

/* A shared mapping without VM_MAYWRITE ("mw": mapped from a descriptor
 * open read-only, or from a memfd sealed against writing) must not become
 * writable with mprotect: map it from a read-only open file description of
 * the same object.  Returns the descriptor, or fd itself. */
static long read_only_twin(long fd, const char *path)
{
    char link[40];
    struct ck_buf b;
    ck_buf_init(&b, link, sizeof(link));
    ck_buf_str(&b, "/proc/self/fd/");
    ck_buf_u64(&b, (uint64_t)fd);
    long ro = ck_open(link, O_RDONLY | O_CLOEXEC, 0);
    if (ro < 0)
        rst_fail("cannot reopen shared memory read-only", path, ro);
    ck_close((int)fd);
    return ro;
}

static void lock_again(const struct ck_vma *v)
{
    uint64_t len = v->end - v->start;
    if ((v->flags & CK_VMA_LOCKED) && (v->madv & CK_MADV_LOCKONFAULT))
        ck_sc3(SYS_mlock2, v->start, len, MLOCK_ONFAULT);  /* best effort: RLIMIT_MEMLOCK may refuse */
    else if (v->flags & CK_VMA_LOCKED)
        ck_sc2(SYS_mlock, v->start, len);
}

/* A System V shared memory attachment: the plan made the segment again
 * under its old id (plan_sysv.c), filled; shmat puts it back at its
 * address, read-only if it was attached so (no VM_MAYWRITE).  A mapping
 * that is only part of its attachment (the rest unmapped, or split by
 * mprotect) is attached anywhere and that part moved into place, keeping
 * its offset, so that shmdt() of the attach address finds it as before. */
static void attach_sysv(const struct rst_image *im, const struct ck_vma *v)
{
    uint64_t len = v->end - v->start;
    long id = (long)v->ino;
    int flags = (v->flags & CK_VMA_MAYWRITE) ? 0 : SHM_RDONLY;
    if (v->prot & PROT_EXEC)
        flags |= SHM_EXEC;
    struct shmid_ds ds;
    long rc = ck_sc3(SYS_shmctl, id, IPC_STAT, &ds);
    if (rc < 0)
        rst_fail("the restore made no System V shared memory segment for an attachment", rst_str(im, v->path), rc);
    uint64_t whole = (ds.shm_segsz + CK_PAGE_SIZE - 1) & ~(uint64_t)(CK_PAGE_SIZE - 1);
    if (v->pgoff + len > whole)
        fail_at("corrupt image: a System V attachment larger than its segment", v, 0);
    if (v->pgoff == 0 && len == whole) {
        rc = ck_sc3(SYS_shmat, id, v->start, flags);
        if (rc < 0 && rc > -4096)
            fail_at("cannot attach System V shared memory back at its address", v, rc);
    } else {
        long base = ck_sc3(SYS_shmat, id, 0, flags);
        if (base < 0 && base > -4096)
            fail_at("cannot attach System V shared memory", v, base);
        rc = ck_sc5(SYS_mremap, base + (long)v->pgoff, len, len, MREMAP_MAYMOVE | MREMAP_FIXED, v->start);
        if (rc < 0 && rc > -4096)
            fail_at("cannot move System V shared memory back to its address", v, rc);
        if (v->pgoff)
            ck_munmap((void *)base, v->pgoff);
        if (v->pgoff + len < whole)
            ck_munmap((void *)(base + (long)(v->pgoff + len)), whole - v->pgoff - len);
    }
    int now = PROT_READ | ((flags & SHM_RDONLY) ? 0 : PROT_WRITE) | ((flags & SHM_EXEC) ? PROT_EXEC : 0);
    if (now != (int)v->prot) {
        rc = ck_mprotect((void *)v->start, len, (int)v->prot);
        if (rc < 0)
            rst_fail("cannot restore memory protection", 0, rc);
    }
    replay_advice(v);
    lock_again(v);
}

static void map_one(const struct rst_image *im, const struct ck_vma *v)
{
    if (v->flags & CK_VMA_SYSV) {
        attach_sysv(im, v);
        return;
    }
    uint64_t len = v->end - v->start;
    int prot = (int)v->prot;
    int shared = (v->flags & CK_VMA_SHARED) != 0;
    int maywrite = !shared || (v->flags & CK_VMA_MAYWRITE) || (v->prot & PROT_WRITE);
    /* to fill, writable; final protection below.  A shared object that
     * may not be written is filled through a mapping of its own first */
    int fill_first = v->nruns && !maywrite && (v->flags & CK_VMA_SHMEM);
    if (v->nruns && !fill_first)
        prot |= PROT_READ | PROT_WRITE;
    int flags = MAP_FIXED_NOREPLACE;
    flags |= (v->flags & CK_VMA_SHARED) ? MAP_SHARED : MAP_PRIVATE;
    if (v->flags & CK_VMA_GROWSDOWN)
        flags |= MAP_GROWSDOWN;
    if (v->flags & (CK_VMA_NORESERVE | CK_VMA_NOCONTENT))
        flags |= MAP_NORESERVE;
    long fd = -1;
    uint64_t pgoff = 0;
    /* a shared mapping of a deleted file: the file plan_deleted.c made again */
    int deleted = shared && (v->flags & CK_VMA_DELETED);
    if ((v->flags & CK_VMA_SHMEM) || deleted) {
        /* the object the plan made once for every process that maps it */
        fd = rst_slot_for(deleted ? RST_KEY_DELETED : RST_KEY_SHM, v->dev, v->ino);
        if (fd < 0)
            rst_fail("the restore plan has no shared memory object for a mapping", rst_str(im, v->path), 0);
        fd = ck_fcntl((int)fd, F_DUPFD_CLOEXEC, 0);
        if (fd < 0)
            rst_fail("cannot take a shared memory object", rst_str(im, v->path), fd);
        pgoff = v->pgoff;
    } else if (v->flags & CK_VMA_FILE) {
        const char *path = rst_str(im, v->path);
        int acc = (shared && maywrite) ? O_RDWR : O_RDONLY;
        fd = ck_open(path, acc | O_CLOEXEC, 0);
        if (fd < 0)
            rst_fail("cannot open a mapped file", path, fd);
        pgoff = v->pgoff;
    } else {
        flags |= MAP_ANONYMOUS;
    }
    if (fill_first) {
        void *t = ck_mmap((void *)v->start, len, PROT_READ | PROT_WRITE, flags, (int)fd, (int64_t)pgoff);
        if (ck_mmap_failed(t) || (uint64_t)t != v->start)
            fail_at("cannot map memory back at its address", v, ck_mmap_failed(t) ? (long)t : -EEXIST);
        fill_pages(im, v);
        ck_munmap(t, len);
    }
    if (((v->flags & CK_VMA_SHMEM) || deleted) && !maywrite)
        fd = read_only_twin(fd, rst_str(im, v->path));
    void *p = ck_mmap((void *)v->start, len, prot, flags, (int)fd, (int64_t)pgoff);
    if (fd >= 0)
        ck_close((int)fd);
    if (ck_mmap_failed(p) || (uint64_t)p != v->start)
        fail_at("cannot map memory back at its address", v, ck_mmap_failed(p) ? (long)p : -EEXIST);
    /* before the fill: memory advised MADV_HUGEPAGE is then filled in huge
     * pages, as the job had it (fewer faults now, a cheap fork for the
     * next checkpoint's writer), while they come cheap (populate_piece) */
    replay_advice(v);
    if (fill_first)
        ;  /* filled above */
    else if (rst.lazy_uffd >= 0 && rst_vma_lazy(im, v))
        rst_lazy_register(v);  /* the pager fills it once the job runs */
    else if (fill_pages(im, v))
        replay_advice(v);  /* MADV_HUGEPAGE back where the fill went to 4 KiB pages */
    if (prot != (int)v->prot) {
        long rc = ck_mprotect((void *)v->start, len, (int)v->prot);
        if (rc < 0)
            rst_fail("cannot restore memory protection", 0, rc);
    }
    lock_again(v);
}

void rst_map_image(const struct rst_image *im)
{
    for (uint32_t i = 0; i < im->nvmas; i++) {
        const struct ck_vma *v = &im->vmas[i];
        if (v->flags & (CK_VMA_VDSO | CK_VMA_VVAR))
            continue;
        map_one(im, v);
    }
}

void rst_place_specials(const struct rst_image *im)
{
    for (uint32_t i = 0; i < im->nvmas; i++) {
        const struct ck_vma *v = &im->vmas[i];
        if (!(v->flags & (CK_VMA_VDSO | CK_VMA_VVAR)))
            continue;
        const char *name = special_name(im, v);
        for (int j = 0; j < rst.ncur_special; j++) {
            struct rst_special *s = &rst.cur_special[j];
            if (ck_strcmp(s->name, name) != 0)
                continue;
            uint64_t len = s->end - s->start;
            void *r = ck_mremap((void *)s->start, len, len, MREMAP_MAYMOVE | MREMAP_FIXED, (void *)v->start);
            if (ck_mmap_failed(r))
                rst_fail("cannot move the vdso to its checkpointed address", name, (long)r);
        }
    }
}

struct ck_prctl_mm_map {
    uint64_t start_code, end_code, start_data, end_data, start_brk, brk, start_stack;
    uint64_t arg_start, arg_end, env_start, env_end;
    uint64_t *auxv;
    uint32_t auxv_size;
    uint32_t exe_fd;
};

void rst_set_mm(const struct rst_image *im)
{
    const struct ck_proc *p = im->proc;
    struct ck_prctl_mm_map m;
    ck_memset(&m, 0, sizeof(m));
    m.start_code = p->start_code;
    m.end_code = p->end_code;
    m.start_data = p->start_data;
    m.end_data = p->end_data;
    m.start_brk = p->start_brk;
    m.brk = p->brk;
    m.start_stack = p->start_stack;
    m.arg_start = p->arg_start;
    m.arg_end = p->arg_end;
    m.env_start = p->env_start;
    m.env_end = p->env_end;
    m.auxv = im->auxv_size ? (uint64_t *)im->auxv : 0;
    m.auxv_size = (uint32_t)im->auxv_size;
    long exe = ck_open(rst_str(im, p->exe), O_RDONLY | O_CLOEXEC, 0);
    m.exe_fd = exe >= 0 ? (uint32_t)exe : (uint32_t)-1;
    long rc = ck_prctl(PR_SET_MM, PR_SET_MM_MAP, (unsigned long)&m, sizeof(m), 0);
    if (rc == -EPERM && exe >= 0) {
        /* no CAP_CHECKPOINT_RESTORE: keep the restorer as /proc/self/exe */
        rst_note("cannot set /proc/self/exe back to the program", rst_str(im, p->exe), rc);
        m.exe_fd = (uint32_t)-1;
        rc = ck_prctl(PR_SET_MM, PR_SET_MM_MAP, (unsigned long)&m, sizeof(m), 0);
    }
    if (exe >= 0)
        ck_close((int)exe);
    if (rc < 0)
        rst_fail("cannot restore the process's brk/argv/environment/auxv fields (PR_SET_MM_MAP)", 0, rc);
    /* membarrier registrations belong to the mm too: each REGISTER command
     * the process had issued (MEMBARRIER_CMD_GET_REGISTRATIONS' bits) */
    for (uint64_t cmd = 1; cmd <= 256; cmd <<= 1) {
        if (!(p->membarrier & cmd))
            continue;
        rc = ck_sc3(SYS_membarrier, cmd, 0, 0);
        if (rc < 0)
            rst_fail("cannot register for membarrier() again", 0, rc);
    }
}
