/*
 * Memory state checked from inside across checkpoint, kill -9 and restart
 * (tests/test_exact_memory.py, issue 18).  argv: STEPS CASE
 *
 *   reshape    many small mappings reshaped by mremap (grown, shrunk,
 *              moved) and mprotect (split, merged), private anonymous and
 *              private file-backed, written before and after; reshaped
 *              again between two checkpoints and after the restart
 *   memfd      memfd contents: MAP_SHARED at two overlapping offsets,
 *              MAP_PRIVATE (copied-on-write pages and pages that still
 *              show the file), write() and pwrite(); one memfd reachable
 *              only through its mapping; changes between two checkpoints
 *              and after the restart
 *   memfd_meta a memfd's name, mode (fchmod) and seals
 *   madvise    every advice smaps shows in VmFlags, on parts of mappings
 *   membarrier membarrier registrations
 *   mprotect   shared file mappings whose maximum protection (VmFlags mw)
 *              allows, or forbids, mprotect(PROT_WRITE) later
 *
 * argv[3], if given, is a file whose appearance (instead of step 10) has
 * the program change its memory between the checkpoints: it removes the
 * file once done, which tells the test to take the second one.  The
 * changes after the restart come at step 45.
 *
 * Every page's contents are checked against a model at every step.
 */
#define _GNU_SOURCE
#include "state_check.h"

#include <fcntl.h>
#include <linux/membarrier.h>
#include <stdint.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#define PG 4096
#define AFTER_RESTART 45

static const char *trigger;

/* time for the changes between two checkpoints (once) */
static int between_checkpoints(int step)
{
    static int done;
    if (done)
        return 0;
    if (trigger ? access(trigger, F_OK) != 0 : step != 10)
        return 0;
    done = 1;
    if (trigger)
        unlink(trigger);
    return 1;
}
#define MAXPG 2048
#define MAXREG 128

static int memfd_fd = -1;

static void seed_page(uint8_t *p, uint32_t seed)
{
    uint64_t *w = (uint64_t *)p;
    for (int i = 0; i < PG / 8; i++)
        w[i] = seed ? (uint64_t)seed * 0x9E3779B97F4A7C15ull + (uint64_t)i : 0;
}

static int page_is(const uint8_t *p, uint32_t seed)
{
    const uint64_t *w = (const uint64_t *)p;
    for (int i = 0; i < PG / 8; i++)
        if (w[i] != (seed ? (uint64_t)seed * 0x9E3779B97F4A7C15ull + (uint64_t)i : 0))
            return 0;
    return 1;
}

/* ---- a model of each region: its address and the seed of every page ---- */

struct region {
    uint8_t *addr;
    int npages;
    int fd;          /* private file mapping: the file; else -1 */
    long fpage;      /* its first page in the file */
    uint32_t seed[MAXPG];
    int prot[MAXPG];
};

static struct region regs[MAXREG];
static int nregs;
static int mem_fd;
static uint8_t *hole, *hole_next;
static uint32_t next_seed = 1000;

/* the file's pages: page k holds seed 50000 + k */
static uint32_t file_seed(long k) { return 50000 + (uint32_t)k; }

static struct region *reg_anon(int npages)
{
    struct region *r = &regs[nregs++];
    r->addr = mmap(0, (size_t)npages * PG, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    CHECK(r->addr != MAP_FAILED, "mmap");
    r->npages = npages;
    r->fd = -1;
    for (int i = 0; i < npages; i++) {
        r->seed[i] = 0;
        r->prot[i] = PROT_READ | PROT_WRITE;
    }
    return r;
}

static struct region *reg_file(int fd, long fpage, int npages)
{
    struct region *r = &regs[nregs++];
    r->addr = mmap(0, (size_t)npages * PG, PROT_READ | PROT_WRITE, MAP_PRIVATE, fd, fpage * PG);
    CHECK(r->addr != MAP_FAILED, "mmap file");
    r->npages = npages;
    r->fd = fd;
    r->fpage = fpage;
    for (int i = 0; i < npages; i++) {
        r->seed[i] = file_seed(fpage + i);
        r->prot[i] = PROT_READ | PROT_WRITE;
    }
    return r;
}

static void reg_write(struct region *r, int page)
{
    CHECK(r->prot[page] & PROT_WRITE, "model: write to a read-only page");
    r->seed[page] = next_seed++;
    seed_page(r->addr + (size_t)page * PG, r->seed[page]);
}

static void reg_fill(struct region *r, int from, int to)
{
    for (int i = from; i < to; i++)
        reg_write(r, i);
}

static void reg_prot(struct region *r, int from, int n, int prot)
{
    CHECK(mprotect(r->addr + (size_t)from * PG, (size_t)n * PG, prot) == 0, "mprotect");
    for (int i = from; i < from + n; i++)
        r->prot[i] = prot;
}

static uint8_t *hole_take(int npages)
{
    uint8_t *p = hole_next;
    hole_next += (size_t)(npages + 1) * PG;  /* a guard page between */
    return p;
}

/* grow or shrink (maybe moving), or move to `to` */
static void reg_remap(struct region *r, int npages, uint8_t *to)
{
    int flags = MREMAP_MAYMOVE | (to ? MREMAP_FIXED : 0);
    void *p = mremap(r->addr, (size_t)r->npages * PG, (size_t)npages * PG, flags, to);
    CHECK(p != MAP_FAILED, "mremap");
    for (int i = r->npages; i < npages; i++) {
        r->seed[i] = r->fd >= 0 ? file_seed(r->fpage + i) : 0;
        r->prot[i] = r->prot[r->npages - 1];
    }
    r->addr = p;
    r->npages = npages;
}

static void check_regions(void)
{
    static uint8_t buf[PG];
    /* opened each time: the check holds no descriptor of its own across a checkpoint */
    mem_fd = open("/proc/self/mem", O_RDONLY | O_CLOEXEC);
    CHECK(mem_fd >= 0, "open /proc/self/mem");
    for (int k = 0; k < nregs; k++) {
        struct region *r = &regs[k];
        for (int i = 0; i < r->npages; i++) {
            const uint8_t *p = r->addr + (size_t)i * PG;
            if (!(r->prot[i] & PROT_READ)) {
                CHECK(pread(mem_fd, buf, PG, (off_t)(uintptr_t)p) == PG, "read a PROT_NONE page");
                p = buf;
            }
            CHECK(page_is(p, r->seed[i]), "region %d page %d (%p): not seed %u", k, i, (void *)p, r->seed[i]);
        }
    }
    close(mem_fd);
}

static void reshape_setup(void)
{
    hole = mmap(0, 16384 * PG, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    CHECK(hole != MAP_FAILED, "mmap hole");
    hole_next = hole + PG;
}

static int file_fd = -1;
static char file_path[64];
#define NG 6

static void reshape_initial(void)
{
    reshape_setup();
    char *path = file_path;
    snprintf(file_path, sizeof(file_path), "/var/tmp/ckptd-exact-memory-XXXXXX");
    file_fd = mkstemp(path);
    CHECK(file_fd >= 0, "mkstemp");
    static uint8_t page[PG];
    for (long k = 0; k < 64; k++) {
        seed_page(page, file_seed(k));
        CHECK(write(file_fd, page, PG) == PG, "write file");
    }
    for (int g = 0; g < NG; g++) {
        struct region *a = reg_anon(8);  /* grown, maybe moved */
        reg_fill(a, 0, 8);
        reg_remap(a, 16, 0);
        reg_fill(a, 8, 12);
        struct region *b = reg_anon(16);  /* shrunk */
        reg_fill(b, 0, 16);
        reg_remap(b, 6, 0);
        struct region *c = reg_anon(6);  /* moved into the hole */
        reg_fill(c, 0, 6);
        reg_remap(c, 6, hole_take(6));
        struct region *d = reg_anon(12);  /* split by protection */
        reg_fill(d, 0, 12);
        reg_prot(d, 3, 3, PROT_READ);
        reg_prot(d, 6, 2, PROT_NONE);
        reg_prot(d, 8, 1, PROT_READ | PROT_EXEC);
        reg_write(d, 0);
        reg_write(d, 10);
        struct region *e = reg_anon(10);  /* split, then merged again */
        reg_fill(e, 0, 10);
        reg_prot(e, 2, 3, PROT_READ);
        reg_prot(e, 2, 3, PROT_READ | PROT_WRITE);
        reg_write(e, 3);
        struct region *f = reg_file(file_fd, 4 + g, 8);  /* private file mapping */
        reg_write(f, 1);
        reg_write(f, 2);
        reg_remap(f, 12, 0);
        reg_write(f, 10);
        reg_prot(f, 5, 2, PROT_READ);
        reg_prot(f, 2, 1, PROT_NONE);
    }
    close(file_fd);  /* the mappings keep the file; removed when done */
    /* 8 MiB, 2 MiB aligned: transparent huge pages where the system allows */
    uint8_t *big = mmap(0, 10 << 20, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    CHECK(big != MAP_FAILED, "mmap");
    uint8_t *aligned = (uint8_t *)(((uintptr_t)big + (2 << 20) - 1) & ~(uintptr_t)((2 << 20) - 1));
    if (aligned > big)
        munmap(big, (size_t)(aligned - big));
    munmap(aligned + (8 << 20), (size_t)(big + (10 << 20) - aligned - (8 << 20)));
    madvise(aligned, 8 << 20, MADV_HUGEPAGE);
    struct region *h = &regs[nregs++];
    h->addr = aligned;
    h->npages = 2048;
    h->fd = -1;
    for (int i = 0; i < 2048; i++)
        h->prot[i] = PROT_READ | PROT_WRITE;
    reg_fill(h, 0, 1536);  /* the last 2 MiB left untouched */
}

static void reshape_big(void);

/* between the two checkpoints of the incremental test (3 and 13) */
static void reshape_again(void)
{
    for (int g = 0; g < NG; g++) {
        struct region *a = &regs[g * 6], *b = a + 1, *c = a + 2, *d = a + 3, *e = a + 4, *f = a + 5;
        uint8_t *old_a = a->addr;
        reg_remap(a, 16, hole_take(16));  /* moved, pages and all */
        reg_write(a, 0);
        reg_remap(c, 6, old_a);           /* another mapping's pages where a was */
        reg_remap(b, 12, 0);              /* grown back */
        reg_write(b, 7);
        reg_prot(d, 6, 2, PROT_READ | PROT_WRITE);
        reg_write(d, 6);
        reg_prot(d, 3, 3, PROT_READ | PROT_WRITE);
        CHECK(madvise(e->addr + 5 * PG, 2 * PG, MADV_DONTNEED) == 0, "madvise");
        e->seed[5] = e->seed[6] = 0;
        reg_remap(f, 12, hole_take(12));
        reg_write(f, 3);
        reg_prot(f, 2, 1, PROT_READ | PROT_WRITE);
    }
    reshape_big();
}

/* the huge-page region, between the checkpoints: pieces cut out of it */
static void reshape_big(void)
{
    struct region *h = &regs[NG * 6];
    /* the middle 1 MiB moved out (the huge pages around it are split) */
    struct region *m = &regs[nregs++];
    *m = (struct region){.addr = h->addr + 700 * PG, .npages = 256, .fd = -1};
    for (int i = 0; i < 256; i++) {
        m->seed[i] = h->seed[700 + i];
        m->prot[i] = PROT_READ | PROT_WRITE;
    }
    reg_remap(m, 256, hole_take(256));
    reg_write(m, 3);
    struct region *tail = &regs[nregs++];  /* what is left after the hole */
    *tail = (struct region){.addr = h->addr + 956 * PG, .npages = 2048 - 956, .fd = -1};
    for (int i = 0; i < tail->npages; i++) {
        tail->seed[i] = h->seed[956 + i];
        tail->prot[i] = h->prot[956 + i];
    }
    h->npages = 700;
    reg_prot(h, 100, 3, PROT_READ);
    reg_write(h, 99);
    reg_write(tail, 1000);  /* in the untouched 2 MiB */
    reg_prot(tail, 10, 500, PROT_NONE);
}

/* after the restart: the restored mappings can be reshaped like any */
static void reshape_after(void)
{
    for (int g = 0; g < NG; g++) {
        struct region *a = &regs[g * 6], *d = a + 3, *f = a + 5;
        reg_prot(d, 8, 1, PROT_READ | PROT_WRITE);
        reg_write(d, 8);
        reg_remap(a, 20, 0);
        reg_write(a, 19);
        reg_prot(f, 5, 2, PROT_READ | PROT_WRITE);
        reg_write(f, 6);
    }
}

static void check_reshape(int step)
{
    if (between_checkpoints(step))
        reshape_again();
    if (step == AFTER_RESTART)
        reshape_after();
    check_regions();
}

/* ---- memfd ---- */

static uint8_t *s1, *s2, *p1, *lone;
static uint32_t mfile[32];  /* the memfd's pages */
static uint32_t p1_cow[8];  /* p1's copied pages (0: shows the file) */
static uint32_t lone_seed[8];

static void mfd_pwrite(int page)
{
    static uint8_t buf[PG];
    mfile[page] = next_seed++;
    seed_page(buf, mfile[page]);
    CHECK(pwrite(memfd_fd, buf, PG, (off_t)page * PG) == PG, "pwrite memfd");
}

static void memfd_initial(void)
{
    memfd_fd = memfd_create("ckptd memfd", MFD_CLOEXEC);
    CHECK(memfd_fd >= 0, "memfd_create");
    CHECK(ftruncate(memfd_fd, 32 * PG) == 0, "ftruncate");
    for (int k = 0; k < 8; k++)
        mfd_pwrite(k);
    s1 = mmap(0, 16 * PG, PROT_READ | PROT_WRITE, MAP_SHARED, memfd_fd, 0);
    s2 = mmap(0, 16 * PG, PROT_READ | PROT_WRITE, MAP_SHARED, memfd_fd, 8 * PG);
    p1 = mmap(0, 8 * PG, PROT_READ | PROT_WRITE, MAP_PRIVATE, memfd_fd, 4 * PG);
    CHECK(s1 != MAP_FAILED && s2 != MAP_FAILED && p1 != MAP_FAILED, "mmap memfd");
    for (int k = 8; k < 12; k++) {  /* through the first mapping */
        mfile[k] = next_seed++;
        seed_page(s1 + k * PG, mfile[k]);
    }
    mfile[20] = next_seed++;  /* through the second */
    seed_page(s2 + 12 * PG, mfile[20]);
    p1_cow[0] = next_seed++;  /* copied on write: file page 4 is not this */
    seed_page(p1, p1_cow[0]);
    p1_cow[5] = next_seed++;
    seed_page(p1 + 5 * PG, p1_cow[5]);
    CHECK(mprotect(p1 + 6 * PG, 2 * PG, PROT_READ) == 0, "mprotect");
    if (lseek(memfd_fd, 2 * PG, SEEK_SET) < 0)
        CHECK(0, "lseek");
    /* a memfd reachable only through its mapping */
    int fd2 = memfd_create("lone", MFD_CLOEXEC);
    CHECK(fd2 >= 0 && ftruncate(fd2, 8 * PG) == 0, "memfd 2");
    lone = mmap(0, 8 * PG, PROT_READ | PROT_WRITE, MAP_SHARED, fd2, 0);
    CHECK(lone != MAP_FAILED, "mmap lone");
    close(fd2);
    for (int k = 0; k < 8; k += 2) {
        lone_seed[k] = next_seed++;
        seed_page(lone + k * PG, lone_seed[k]);
    }
}

static void check_memfd(int step)
{
    static uint8_t buf[PG];
    if (between_checkpoints(step)) {
        mfd_pwrite(1);
        mfile[3] = next_seed++;
        seed_page(s1 + 3 * PG, mfile[3]);
        p1_cow[2] = next_seed++;  /* file page 6 */
        seed_page(p1 + 2 * PG, p1_cow[2]);
        lone_seed[1] = next_seed++;
        seed_page(lone + PG, lone_seed[1]);
    }
    if (step == AFTER_RESTART) {  /* after the restart: the file changes under the mappings */
        mfd_pwrite(5);   /* p1 page 1 still shows the file */
        mfd_pwrite(9);   /* p1 page 5 is its own copy: not this */
        mfd_pwrite(10);  /* p1 page 6, read-only: shows the file */
        mfile[14] = next_seed++;
        seed_page(s2 + 6 * PG, mfile[14]);
    }
    struct stat st;
    CHECK(fstat(memfd_fd, &st) == 0 && st.st_size == 32 * PG, "memfd size %ld", (long)st.st_size);
    CHECK(lseek(memfd_fd, 0, SEEK_CUR) == 2 * PG, "memfd offset");
    for (int k = 0; k < 32; k++) {
        CHECK(pread(memfd_fd, buf, PG, (off_t)k * PG) == PG, "pread memfd");
        CHECK(page_is(buf, mfile[k]), "memfd page %d (read)", k);
    }
    for (int k = 0; k < 16; k++) {
        CHECK(page_is(s1 + k * PG, mfile[k]), "shared mapping 1 page %d", k);
        CHECK(page_is(s2 + k * PG, mfile[8 + k]), "shared mapping 2 page %d", k);
    }
    for (int k = 0; k < 8; k++)
        CHECK(page_is(p1 + k * PG, p1_cow[k] ? p1_cow[k] : mfile[4 + k]), "private mapping page %d", k);
    for (int k = 0; k < 8; k++)
        CHECK(page_is(lone + k * PG, lone_seed[k]), "lone memfd page %d", k);
}

/* ---- memfd name, mode, seals ---- */

static int meta_fd, noseal_fd, wseal_fd;
static uint8_t *wseal_map;

static void memfd_meta_initial(void)
{
    meta_fd = memfd_create("meta name", MFD_ALLOW_SEALING | MFD_CLOEXEC);
    noseal_fd = memfd_create("", 0);
    wseal_fd = memfd_create("wseal", MFD_ALLOW_SEALING);
    CHECK(meta_fd >= 0 && noseal_fd >= 0 && wseal_fd >= 0, "memfd_create");
    CHECK(ftruncate(meta_fd, 3 * PG) == 0 && ftruncate(wseal_fd, 2 * PG) == 0, "ftruncate");
    CHECK(fchmod(meta_fd, 0640) == 0 && fchmod(noseal_fd, 0600) == 0, "fchmod");
    CHECK(fcntl(meta_fd, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW) == 0, "F_ADD_SEALS");
    static uint8_t page[PG];
    seed_page(page, 77);
    CHECK(pwrite(wseal_fd, page, PG, PG) == PG, "pwrite");
    CHECK(fcntl(wseal_fd, F_ADD_SEALS, F_SEAL_WRITE | F_SEAL_SEAL) == 0, "F_ADD_SEALS write");
    /* mapped after the seal: the kernel takes the right to write away (no "mw") */
    wseal_map = mmap(0, 2 * PG, PROT_READ, MAP_SHARED, wseal_fd, 0);
    CHECK(wseal_map != MAP_FAILED, "mmap");
}

static void check_name(int fd, const char *want)
{
    char path[64], target[256];
    snprintf(path, sizeof(path), "/proc/self/fd/%d", fd);
    ssize_t n = readlink(path, target, sizeof(target) - 1);
    CHECK(n > 0, "readlink");
    target[n] = 0;
    CHECK(!strcmp(target, want), "memfd %d is \"%s\", not \"%s\"", fd, target, want);
}

static void check_memfd_meta(int step)
{
    (void)step;
    struct stat st;
    CHECK(fstat(meta_fd, &st) == 0 && (st.st_mode & 07777) == 0640, "mode %o", st.st_mode & 07777);
    CHECK(fstat(noseal_fd, &st) == 0 && (st.st_mode & 07777) == 0600, "mode %o", st.st_mode & 07777);
    CHECK(fcntl(meta_fd, F_GET_SEALS) == (F_SEAL_SHRINK | F_SEAL_GROW), "seals %d", fcntl(meta_fd, F_GET_SEALS));
    CHECK(fcntl(noseal_fd, F_GET_SEALS) == F_SEAL_SEAL, "seals %d", fcntl(noseal_fd, F_GET_SEALS));
    CHECK(fcntl(wseal_fd, F_GET_SEALS) == (F_SEAL_WRITE | F_SEAL_SEAL), "seals %d", fcntl(wseal_fd, F_GET_SEALS));
    CHECK(fcntl(meta_fd, F_GETFD) == FD_CLOEXEC && fcntl(wseal_fd, F_GETFD) == 0, "close-on-exec");
    check_name(meta_fd, "/memfd:meta name (deleted)");
    check_name(noseal_fd, "/memfd: (deleted)");
    check_name(wseal_fd, "/memfd:wseal (deleted)");
    CHECK(ftruncate(meta_fd, 4 * PG) < 0 && errno == EPERM, "F_SEAL_GROW lost");
    CHECK(ftruncate(meta_fd, 3 * PG) == 0, "same size");
    CHECK(page_is(wseal_map + PG, 77) && page_is(wseal_map, 0), "sealed memfd contents");
    static uint8_t page[PG];
    CHECK(pwrite(wseal_fd, page, PG, 0) < 0 && errno == EPERM, "F_SEAL_WRITE lost");
    CHECK(mprotect(wseal_map, PG, PROT_READ | PROT_WRITE) < 0 && errno == EACCES, "sealed mapping may write");
}

/* ---- madvise ---- */

struct advised {
    const char *flag;  /* VmFlags mnemonic */
    int advice;        /* -1: mlock, -2: mlock2(MLOCK_ONFAULT) */
    uint8_t *addr;
    size_t len;
};

static struct advised adv[] = {
    {"hg", MADV_HUGEPAGE, 0, 0},   {"nh", MADV_NOHUGEPAGE, 0, 0}, {"dc", MADV_DONTFORK, 0, 0},
    {"wf", MADV_WIPEONFORK, 0, 0}, {"dd", MADV_DONTDUMP, 0, 0},   {"mg", MADV_MERGEABLE, 0, 0},
    {"rr", MADV_RANDOM, 0, 0},     {"sr", MADV_SEQUENTIAL, 0, 0}, {"lo", -1, 0, 0},
    {"lf", -2, 0, 0},
};
#define NADV (int)(sizeof(adv) / sizeof(adv[0]))
static uint8_t *adv_area;

static void madvise_initial(void)
{
    /* one area, 8 pages per advice, advised on pages 2..5: every advice
     * splits its part in three */
    adv_area = mmap(0, (size_t)NADV * 8 * PG, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    CHECK(adv_area != MAP_FAILED, "mmap");
    for (int i = 0; i < NADV * 8; i++)
        seed_page(adv_area + (size_t)i * PG, 300 + (uint32_t)i);
    for (int i = 0; i < NADV; i++) {
        adv[i].addr = adv_area + (size_t)i * 8 * PG + 2 * PG;
        adv[i].len = 4 * PG;
        if (i > 0)  /* keep neighbours from merging: a guard page of other protection */
            CHECK(mprotect(adv_area + (size_t)i * 8 * PG, PG, PROT_READ) == 0, "mprotect");
        int rc = adv[i].advice == -1   ? mlock(adv[i].addr, adv[i].len)
                 : adv[i].advice == -2 ? mlock2(adv[i].addr, adv[i].len, MLOCK_ONFAULT)
                                       : madvise(adv[i].addr, adv[i].len, adv[i].advice);
        CHECK(rc == 0, "advice %s", adv[i].flag);
    }
}

/* the VmFlags of the mapping at addr, and its range */
static int vmflags_at(const uint8_t *addr, char *flags, size_t cap, uintptr_t *start, uintptr_t *end)
{
    FILE *f = fopen("/proc/self/smaps", "r");
    CHECK(f, "open smaps");
    char line[512];
    int found = 0;
    uintptr_t s = 0, e = 0;
    while (fgets(line, sizeof(line), f)) {
        uintptr_t a, b;
        if (sscanf(line, "%lx-%lx ", &a, &b) == 2 && strchr(line, '-') < strchr(line, ' ')) {
            s = a;
            e = b;
            continue;
        }
        if (!strncmp(line, "VmFlags:", 8) && (uintptr_t)addr >= s && (uintptr_t)addr < e) {
            snprintf(flags, cap, "%s", line + 8);
            *start = s;
            *end = e;
            found = 1;
            break;
        }
    }
    fclose(f);
    return found;
}

static int has_flag(const char *flags, const char *f)
{
    for (const char *p = flags; (p = strstr(p, f)); p += 2)
        if ((p == flags || p[-1] == ' ') && (p[2] == ' ' || p[2] == '\n' || !p[2]))
            return 1;
    return 0;
}

static void check_madvise(int step)
{
    (void)step;
    char flags[512];
    uintptr_t s, e;
    for (int i = 0; i < NADV; i++) {
        CHECK(vmflags_at(adv[i].addr, flags, sizeof(flags), &s, &e), "no mapping");
        CHECK(s == (uintptr_t)adv[i].addr && e == (uintptr_t)adv[i].addr + adv[i].len,
              "%s: the advised range is %lx-%lx, not %p+%zu", adv[i].flag, s, e, adv[i].addr, adv[i].len);
        CHECK(has_flag(flags, adv[i].flag), "advice %s lost: VmFlags%s", adv[i].flag, flags);
        CHECK(vmflags_at(adv[i].addr - PG, flags, sizeof(flags), &s, &e), "no mapping");
        CHECK(!has_flag(flags, adv[i].flag), "advice %s before its range", adv[i].flag);
        CHECK(vmflags_at(adv[i].addr + adv[i].len, flags, sizeof(flags), &s, &e), "no mapping");
        CHECK(!has_flag(flags, adv[i].flag), "advice %s after its range", adv[i].flag);
    }
    for (int i = 0; i < NADV * 8; i++)
        CHECK(page_is(adv_area + (size_t)i * PG, 300 + (uint32_t)i), "advised page %d", i);
}

/* ---- membarrier ---- */

static long membarrier(int cmd, unsigned flags) { return syscall(SYS_membarrier, cmd, flags, 0); }

#ifndef MEMBARRIER_CMD_GET_REGISTRATIONS
#define MEMBARRIER_CMD_GET_REGISTRATIONS (1 << 9)
#endif

static long want_reg;

static void membarrier_initial(void)
{
    CHECK(membarrier(MEMBARRIER_CMD_REGISTER_PRIVATE_EXPEDITED, 0) == 0, "register private expedited");
    CHECK(membarrier(MEMBARRIER_CMD_REGISTER_GLOBAL_EXPEDITED, 0) == 0, "register global expedited");
    want_reg = membarrier(MEMBARRIER_CMD_GET_REGISTRATIONS, 0);
    CHECK(want_reg > 0, "get registrations");
}

static void check_membarrier(int step)
{
    (void)step;
    long got = membarrier(MEMBARRIER_CMD_GET_REGISTRATIONS, 0);
    CHECK(got == want_reg, "registrations %lx, not %lx", got, want_reg);
    CHECK(membarrier(MEMBARRIER_CMD_PRIVATE_EXPEDITED, 0) == 0, "private expedited barrier");
}

/* ---- mprotect and the maximum protection ---- */

static uint8_t *rw_map, *ro_map;

static void mprotect_initial(void)
{
    char *path = file_path;
    snprintf(file_path, sizeof(file_path), "/var/tmp/ckptd-exact-mprotect-XXXXXX");
    int fd = mkstemp(path);
    CHECK(fd >= 0, "mkstemp");
    static uint8_t page[PG];
    seed_page(page, 91);
    CHECK(pwrite(fd, page, PG, 0) == PG && pwrite(fd, page, PG, PG) == PG, "write");
    /* shared, read-only for now, from a descriptor open for writing: may write later */
    rw_map = mmap(0, 2 * PG, PROT_READ, MAP_SHARED, fd, 0);
    int ro = open(path, O_RDONLY | O_CLOEXEC);
    /* shared from a read-only descriptor: may never write */
    ro_map = mmap(0, 2 * PG, PROT_READ, MAP_SHARED, ro, 0);
    CHECK(rw_map != MAP_FAILED && ro_map != MAP_FAILED, "mmap");
    close(fd);
    close(ro);
}

static void check_mprotect(int step)
{
    if (step == AFTER_RESTART) {
        CHECK(mprotect(rw_map, PG, PROT_READ | PROT_WRITE) == 0, "mprotect(PROT_WRITE) on a shared mapping");
        seed_page(rw_map, 92);
        CHECK(mprotect(rw_map, PG, PROT_READ) == 0, "mprotect back");
    }
    CHECK(mprotect(ro_map, PG, PROT_READ | PROT_WRITE) < 0 && errno == EACCES, "a read-only file mapping may write");
    CHECK(page_is(rw_map, step >= AFTER_RESTART ? 92 : 91) && page_is(rw_map + PG, 91), "shared file contents");
    CHECK(page_is(ro_map, step >= AFTER_RESTART ? 92 : 91), "the same file through another mapping");
}

int main(int argc, char **argv)
{
    int steps = steps_of(argc, argv);
    const char *which = argc > 2 ? argv[2] : "reshape";
    trigger = argc > 3 ? argv[3] : 0;
    if (!strcmp(which, "reshape")) {
        reshape_initial();
        int rc = run_steps(steps, check_reshape);
        unlink(file_path);
        return rc;
    }
    if (!strcmp(which, "memfd")) {
        memfd_initial();
        return run_steps(steps, check_memfd);
    }
    if (!strcmp(which, "memfd_meta")) {
        memfd_meta_initial();
        return run_steps(steps, check_memfd_meta);
    }
    if (!strcmp(which, "madvise")) {
        madvise_initial();
        return run_steps(steps, check_madvise);
    }
    if (!strcmp(which, "membarrier")) {
        membarrier_initial();
        return run_steps(steps, check_membarrier);
    }
    if (!strcmp(which, "mprotect")) {
        mprotect_initial();
        int rc = run_steps(steps, check_mprotect);
        unlink(file_path);
        return rc;
    }
    printf("unknown case %s\n", which);
    return 2;
}
