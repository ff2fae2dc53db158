/*
 * Which pages changed since the last image: the basis of incremental dumps.
 *
 * Soft-dirty bits are not available on the kernels we target, so after a
 * dump the shim write-protects the process's private anonymous memory with
 * an asynchronous userfaultfd (UFFD_FEATURE_WP_ASYNC, Linux 6.7+): the
 * kernel lifts a page's protection itself on the first write, with no
 * handler thread, and PAGEMAP_SCAN reports that page as PAGE_IS_WRITTEN.
 * The next dump asks for the present pages with their written bit and
 * protects the written ones again in the same pass (PM_SCAN_WP_MATCHING),
 * so a checkpoint costs one page-table walk, not one per page.
 *
 * Pages present and not written are taken from where the previous image
 * had them: its own pages.img or one of its sources.  Everything that
 * cannot be vouched for is copied instead:
 *   - a mapping without our registration: new since, or moved by mremap
 *     (which drops a registration without UFFD_FEATURE_EVENT_REMAP);
 *   - a page the previous image does not have;
 *   - a process that forked (the child's mappings lose the registration),
 *     exec'd or was restored (the table below starts empty again);
 *   - a parent other than the image written last (an aborted checkpoint,
 *     a restart from an older one): the agent names the parent it expects.
 *
 * Where the kernel refuses an asynchronous userfaultfd (older than 6.7, or
 * userfaultfd disabled), or with CKPTD_TRACK=hash, the shim keeps a 64-bit
 * hash of every page of the image instead, and the next dump hashes the
 * present pages again: a page whose hash is unchanged is taken from the
 * previous image.  That costs a pass over the memory during the pause
 * (scripts/bench.py --incremental measures both ways).
 *
 * The previous image's page runs (and hashes) live in the top of the
 * scratch arena, which is kept out of every image (CK_VMA_NOCONTENT).
 */
#include "shim.h"
#include "../common/sys.h"
#include "../common/util.h"
#include "../common/maps.h"
#include "pagemap.h"

#include <errno.h>
#include <sys/ioctl.h>

#define CK_UFFD_API 0xAAull
#define CK_UFFD_FEATURE_WP_ASYNC (1ull << 15)
#define CK_UFFD_USER_MODE_ONLY 1
struct ck_uffdio_api {
    uint64_t api, features, ioctls;
};
struct ck_uffdio_range {
    uint64_t start, len;
};
struct ck_uffdio_register {
    struct ck_uffdio_range range;
    uint64_t mode, ioctls;
};
#define CK_UFFDIO_API _IOWR(0xAA, 0x3F, struct ck_uffdio_api)
#define CK_UFFDIO_REGISTER _IOWR(0xAA, 0x00, struct ck_uffdio_register)
#define CK_UFFDIO_REGISTER_MODE_WP 2

#define MAX_RANGES 65536
#define CK_TRACK_HIGH_FD 950

struct range {
    uint64_t start, end;
};

static struct {
    int uffd;                   /* -1: not created (or not possible here) */
    int32_t pid;                /* the process that made the table: a fork starts over */
    int valid;                  /* the table describes the image named below */
    int hashed;                 /* ... with a hash per page (else uffd tracks writes) */
    char ckpt[64];              /* its checkpoint, e.g. "ckpt-4" */
    char self[CK_SOURCE_PATH];  /* its directory, relative to the job's */
    uint64_t pages_size;        /* its pages.img */
    uint32_t nsources;
    char sources[CK_MAX_SOURCES][CK_SOURCE_PATH];
    uint64_t source_size[CK_MAX_SOURCES];
    struct ck_page_run *runs;   /* in the keep region; pad: index of the run's first hash */
    uint64_t nruns, cap;
    uint64_t *hashes;           /* in the keep region: one per page of the runs, in order */
    uint64_t hcap;
    struct range *ranges;       /* what we registered, in the keep region */
    uint64_t nranges;
} tr = {.uffd = -1};

/* the dump in progress */
static struct {
    int usable;                 /* references to the previous image allowed */
    char ckpt[64];
    char self[CK_SOURCE_PATH];
    uint32_t map[CK_MAX_SOURCES + 1];  /* previous src -> this image's src (0: none yet) */
} cur;

/* the run the last lookup by hash found: pages are asked for in order */
static const struct ck_page_run *hash_run;

void ck_track_forget(void)
{
    /* restored: the descriptor and the registrations did not come back */
    tr.uffd = -1;
    tr.valid = 0;
    tr.nruns = tr.nranges = 0;
}

static int open_uffd(void)
{
    if (tr.uffd >= 0)
        return 0;
    long fd = ck_sc1(SYS_userfaultfd, O_CLOEXEC | O_NONBLOCK);
    if (fd < 0)  /* vm.unprivileged_userfaultfd=0 and no CAP_SYS_PTRACE */
        fd = ck_sc1(SYS_userfaultfd, O_CLOEXEC | O_NONBLOCK | CK_UFFD_USER_MODE_ONLY);
    if (fd < 0)
        return (int)fd;
    struct ck_uffdio_api api = {CK_UFFD_API, CK_UFFD_FEATURE_WP_ASYNC, 0};
    long rc = ck_ioctl((int)fd, CK_UFFDIO_API, &api);
    if (rc < 0) {
        ck_close((int)fd);
        return (int)rc;
    }
    /* keep clear of the low descriptors: the job's own numbering stays as
     * it would be without ckptd (the agent's socket lives up there too) */
    long high = ck_fcntl((int)fd, F_DUPFD_CLOEXEC, CK_TRACK_HIGH_FD);
    if (high >= 0) {
        ck_close((int)fd);
        fd = high;
    }
    tr.uffd = (int)fd;
    tr.pid = (int32_t)ck_getpid();
    return 0;
}

static int ensure_keep(void)
{
    size_t size;
    char *keep = ck_arena_keep(&size);
    if (!keep)
        return -1;
    /* ranges | runs | hashes: half of what is left to each table */
    size_t left = (size - MAX_RANGES * sizeof(struct range)) / 2;
    tr.ranges = (struct range *)keep;
    tr.runs = (struct ck_page_run *)(keep + MAX_RANGES * sizeof(struct range));
    tr.cap = left / sizeof(struct ck_page_run);
    tr.hashes = (uint64_t *)(keep + MAX_RANGES * sizeof(struct range) + left);
    tr.hcap = left / sizeof(uint64_t);
    return 0;
}

static void copy_str(char *to, size_t cap, const char *from)
{
    size_t i = 0;
    for (; from[i] && i + 1 < cap; i++)
        to[i] = from[i];
    to[i] = 0;
}

static int still_ours(int fd)
{
    char path[40], target[64];
    struct ck_buf b;
    ck_buf_init(&b, path, sizeof(path));
    ck_buf_str(&b, "/proc/self/fd/");
    ck_buf_u64(&b, (uint64_t)fd);
    long n = ck_readlink(path, target, sizeof(target) - 1);
    if (n <= 0)
        return 0;
    target[n] = 0;
    return !ck_strcmp(target, "anon_inode:[userfaultfd]");
}

int ck_track_begin(struct ck_image *im, const char *base, const char *self)
{
    ck_memset(&cur, 0, sizeof(cur));
    hash_run = 0;
    if (tr.hashed && tr.pid != (int32_t)ck_getpid())
        tr.valid = 0;  /* a forked child: its own images from the next one on */
    if (tr.uffd >= 0 && tr.pid != (int32_t)ck_getpid()) {
        /* a forked child holds its parent's descriptor, and none of the registrations */
        ck_close(tr.uffd);
        tr.uffd = -1;
        tr.valid = 0;
        tr.nranges = 0;
    }
    if (tr.uffd >= 0 && !still_ours(tr.uffd)) {
        /* the job closed it (closerange, say): its number may be another file now */
        tr.uffd = -1;
        tr.valid = 0;
        tr.nranges = 0;
    }
    if (tr.uffd >= 0)
        ck_image_add_own_fd(im, tr.uffd);
    if (!self || !self[0] || ck_strlen(self) >= CK_SOURCE_PATH)
        return 0;  /* no name for this image: nothing can refer to it later */
    copy_str(cur.self, sizeof(cur.self), self);
    const char *slash = self;
    while (*slash && *slash != '/')
        slash++;
    size_t n = (size_t)(slash - self);
    if (n >= sizeof(cur.ckpt))
        return 0;
    ck_memcpy(cur.ckpt, self, n);
    cur.ckpt[n] = 0;
    cur.usable = tr.valid && (tr.uffd >= 0 || tr.hashed) && base && base[0] && !ck_strcmp(base, tr.ckpt);
    tr.valid = 0;  /* until this dump succeeds: a failed one may have re-armed pages */
    return 0;
}

int ck_track_incremental(void) { return cur.usable; }

int ck_track_armed(void) { return tr.valid; }

/* this dump compares page hashes with the previous image's */
int ck_track_hashing(void) { return cur.usable && tr.hashed; }

static uint64_t rotl64(uint64_t x, int r) { return (x << r) | (x >> (64 - r)); }

#define HP1 0x9E3779B185EBCA87ull
#define HP2 0xC2B2AE3D27D4EB4Full
#define HP3 0x165667B19E3779F9ull
#define HP4 0x85EBCA77C2B2AE63ull

static uint64_t hash_round(uint64_t acc, uint64_t word)
{
    acc += word * HP2;
    return rotl64(acc, 31) * HP1;
}

/* A 64-bit hash of one page: four independent multiply-rotate lanes (the
 * CPU runs them side by side), merged and mixed at the end.  Never 0:
 * that value means "no hash" in the table. */
uint64_t ck_page_hash(const void *page)
{
    const uint64_t *w = page;
    uint64_t a = HP1 + HP2, b = HP2, c = 0, d = (uint64_t)0 - HP1;
    for (unsigned i = 0; i < CK_PAGE_SIZE / 8; i += 4) {
        a = hash_round(a, w[i]);
        b = hash_round(b, w[i + 1]);
        c = hash_round(c, w[i + 2]);
        d = hash_round(d, w[i + 3]);
    }
    uint64_t h = rotl64(a, 1) + rotl64(b, 7) + rotl64(c, 12) + rotl64(d, 18);
    h = (h ^ hash_round(0, a)) * HP1 + HP4;
    h = (h ^ hash_round(0, b)) * HP1 + HP4;
    h = (h ^ hash_round(0, c)) * HP1 + HP4;
    h = (h ^ hash_round(0, d)) * HP1 + HP4;
    h ^= h >> 33;
    h *= HP2;
    h ^= h >> 29;
    h *= HP3;
    h ^= h >> 32;
    return h ? h : 1;
}

/* the previous image's hash of the page at vaddr; 0 if it has none */
int ck_track_prev_hash(uint64_t vaddr, uint64_t *hash)
{
    const struct ck_page_run *r = hash_run;
    if (!r || vaddr < r->vaddr || vaddr >= r->vaddr + r->npages * CK_PAGE_SIZE) {
        uint64_t next;
        r = hash_run = ck_track_lookup(vaddr, &next);
    }
    if (!r || !tr.hashed)
        return 0;
    *hash = tr.hashes[r->pad + (vaddr - r->vaddr) / CK_PAGE_SIZE];
    return *hash != 0;
}

/* registered by us, and still registered (smaps says "uw") */
int ck_track_registered(uint64_t start, uint64_t end, uint32_t vmflags)
{
    if (tr.uffd < 0 || !(vmflags & CK_VMF_UFFD_WP))
        return 0;
    for (uint64_t i = 0; i < tr.nranges; i++)
        if (start >= tr.ranges[i].start && end <= tr.ranges[i].end)
            return 1;
    return 0;
}

/* the previous image's run holding vaddr, or NULL and *next the address of
 * the next run (runs are sorted by address) */
const struct ck_page_run *ck_track_lookup(uint64_t vaddr, uint64_t *next)
{
    uint64_t lo = 0, hi = tr.nruns;
    while (lo < hi) {
        uint64_t mid = lo + (hi - lo) / 2;
        const struct ck_page_run *r = &tr.runs[mid];
        if (vaddr < r->vaddr)
            hi = mid;
        else if (vaddr >= r->vaddr + r->npages * CK_PAGE_SIZE)
            lo = mid + 1;
        else
            return r;
    }
    *next = lo < tr.nruns ? tr.runs[lo].vaddr : UINT64_MAX;
    return 0;
}

/* this image's source index for a previous run's source; 0 if too many */
uint32_t ck_track_source(struct ck_image *im, uint32_t prev_src)
{
    if (prev_src > tr.nsources)
        return 0;
    if (cur.map[prev_src])
        return cur.map[prev_src];
    if (im->sources.count >= CK_MAX_SOURCES)
        return 0;
    char path[CK_SOURCE_PATH + 16];
    uint64_t size;
    if (prev_src == 0) {
        struct ck_buf b;
        ck_buf_init(&b, path, sizeof(path));
        ck_buf_str(&b, tr.self);
        ck_buf_str(&b, "/pages.img");
        size = tr.pages_size;
    } else {
        copy_str(path, sizeof(path), tr.sources[prev_src - 1]);
        size = tr.source_size[prev_src - 1];
    }
    struct ck_page_source *s = ck_table_push(&im->sources);
    if (!s)
        return 0;
    s->path = ck_image_string(im, path);
    s->size = size;
    cur.map[prev_src] = (uint32_t)im->sources.count;
    return cur.map[prev_src];
}

/* Protect a mapping we copied in full; its written pages are reported from
 * now on.  Only the pages it has are protected (a walk with
 * PM_SCAN_WP_MATCHING): UFFDIO_WRITEPROTECT on the whole range would leave
 * uffd-wp markers in its holes, which PAGEMAP_SCAN reports as swapped pages,
 * and a hole written later is reported written anyway. */
static void arm_range(int pagemap_fd, uint64_t start, uint64_t end)
{
    struct ck_uffdio_register reg = {{start, end - start}, CK_UFFDIO_REGISTER_MODE_WP, 0};
    if (ck_ioctl(tr.uffd, CK_UFFDIO_REGISTER, &reg) < 0)
        return;  /* not anonymous memory (a private file mapping, say): copied every time */
    static struct ck_page_region regions[256];
    struct ck_pm_scan_arg a;
    ck_pm_scan_present(&a, start, end, regions, sizeof(regions) / sizeof(regions[0]),
                       CK_PAGE_IS_PRESENT | CK_PAGE_IS_SWAPPED);
    a.flags = CK_PM_SCAN_WP_MATCHING | CK_PM_SCAN_CHECK_WPASYNC;
    for (;;) {
        if (ck_ioctl(pagemap_fd, CK_PAGEMAP_SCAN, &a) < 0)
            return;  /* left out of the ranges: copied in full next time */
        if (a.walk_end >= end)
            break;
        a.start = a.walk_end;
    }
    if (tr.nranges < MAX_RANGES) {
        tr.ranges[tr.nranges].start = start;
        tr.ranges[tr.nranges].end = end;
        tr.nranges++;
    }
}

static int commit_hashes(struct ck_image *im);
static void commit_protection(struct ck_image *im);

/* The dump succeeded: remember its runs, protect what is not yet protected
 * (or hash what it holds).
 * Every thread is still parked, so no write slips between image and arming. */
void ck_track_commit(struct ck_image *im, uint64_t pages_size)
{
    int mode = ck_shim.track_mode;
    if (!cur.self[0] || mode == CK_TRACK_OFF || ensure_keep() < 0)
        return;
    if (im->runs.count > tr.cap || im->sources.count > CK_MAX_SOURCES)
        return;
    int hashed = mode == CK_TRACK_HASH;
    if (!hashed && open_uffd() < 0) {
        if (mode == CK_TRACK_UFFD)
            return;  /* asked for write protection only: full images from now on */
        hashed = 1;  /* the kernel refuses it: hash the pages instead */
    }
    if (hashed) {
        if (commit_hashes(im) < 0)
            return;
    } else {
        commit_protection(im);
    }
    tr.hashed = hashed;
    tr.pid = (int32_t)ck_getpid();
    ck_memcpy(tr.runs, ck_table_at(&im->runs, 0), im->runs.count * sizeof(struct ck_page_run));
    tr.nruns = im->runs.count;
    uint64_t first = 0;
    for (uint64_t i = 0; i < tr.nruns; i++) {  /* the hash index of each run's first page */
        tr.runs[i].pad = hashed ? (uint32_t)first : 0;
        first += tr.runs[i].npages;
    }
    tr.nsources = (uint32_t)im->sources.count;
    for (uint32_t i = 0; i < tr.nsources; i++) {
        const struct ck_page_source *s = ck_table_at(&im->sources, i);
        copy_str(tr.sources[i], CK_SOURCE_PATH, (const char *)im->strings.base + s->path);
        tr.source_size[i] = s->size;
    }
    copy_str(tr.ckpt, sizeof(tr.ckpt), cur.ckpt);
    copy_str(tr.self, sizeof(tr.self), cur.self);
    tr.pages_size = pages_size;
    tr.valid = 1;
}

/* Hash every page of the image's runs, in run order.  Every thread is still
 * parked, so memory is what the image holds.  A page of an unreadable
 * mapping gets no hash (it is copied every time). */
static int commit_hashes(struct ck_image *im)
{
    uint64_t k = 0;
    for (uint64_t i = 0; i < im->vmas.count; i++) {
        const struct ck_vma *v = ck_table_at(&im->vmas, i);
        for (uint64_t r = v->first_run; r < v->first_run + v->nruns; r++) {
            const struct ck_page_run *run = ck_table_at(&im->runs, r);
            if (k + run->npages > tr.hcap || k + run->npages > UINT32_MAX)
                return -1;  /* too big to track: full images */
            for (uint64_t p = 0; p < run->npages; p++)
                tr.hashes[k++] = (v->prot & PROT_READ) ? ck_page_hash((const void *)(run->vaddr + p * CK_PAGE_SIZE)) : 0;
        }
    }
    tr.nranges = 0;
    return 0;
}

/* Write-protect what is not yet protected (see the top of this file). */
static void commit_protection(struct ck_image *im)
{
    /* registrations that no longer match a mapping are dropped; the ones
     * still in place ("uw") were re-protected page by page by the scan */
    uint64_t kept = 0;
    for (uint64_t i = 0; i < im->vmas.count; i++) {
        const struct ck_vma *v = ck_table_at(&im->vmas, i);
        if (v->flags & CK_VMA_TRACKED) {
            tr.ranges[kept].start = v->start;
            tr.ranges[kept].end = v->end;
            kept++;
        }
    }
    tr.nranges = kept;
    int pagemap_fd = (int)ck_open("/proc/self/pagemap", O_RDONLY | O_CLOEXEC, 0);
    if (pagemap_fd < 0)
        return;
    for (uint64_t i = 0; i < im->vmas.count; i++) {
        const struct ck_vma *v = ck_table_at(&im->vmas, i);
        uint32_t f = v->flags;
        if ((f & CK_VMA_ANON) && !(f & (CK_VMA_SHARED | CK_VMA_SHMEM | CK_VMA_NOCONTENT | CK_VMA_DELETED |
                                        CK_VMA_VDSO | CK_VMA_VVAR | CK_VMA_TRACKED)))
            arm_range(pagemap_fd, v->start, v->end);
    }
    ck_close(pagemap_fd);
}

/* The agent rewrote this process's last image after the dump (pages that
 * another rank's image holds alike now point there, and their copies here
 * are gone): take its runs and sources from the rewritten core.img, so
 * that the next image points where the pages are now.  Same pages in the
 * same order, so page hashes stay valid. */
int ck_track_rebase(const char *core_path, const char *self)
{
    if (!tr.valid || !self || ck_strcmp(self, tr.self) != 0)
        return -ESTALE;  /* not the image the table describes: nothing to do */
    if (ck_arena_setup() < 0)
        return -ENOMEM;
    size_t cap = 64u << 20;
    char *buf = ck_arena_alloc(cap);
    if (!buf)
        return -ENOMEM;
    long n = ck_read_file(core_path, buf, cap);
    int rc = -EINVAL;
    const struct ck_header *h = (const struct ck_header *)buf;
    if (n < 0) {
        rc = (int)n;
        goto out;
    }
    if ((size_t)n < sizeof(*h) || h->magic != CK_CORE_MAGIC || h->version != CK_CORE_VERSION ||
        h->file_size != (uint64_t)n || h->nsections > CK_MAX_SECTIONS)
        goto out;
    const struct ck_section *runs = 0, *sources = 0, *strings = 0;
    for (uint32_t i = 0; i < h->nsections; i++) {
        const struct ck_section *sec = &h->sections[i];
        if (sec->offset > (uint64_t)n || sec->size > (uint64_t)n - sec->offset)
            goto out;
        if (sec->type == CK_SEC_RUNS)
            runs = sec;
        else if (sec->type == CK_SEC_SOURCES)
            sources = sec;
        else if (sec->type == CK_SEC_STRINGS)
            strings = sec;
    }
    if (!runs || runs->size != runs->count * sizeof(struct ck_page_run) || runs->count > tr.cap ||
        runs->offset % 8)
        goto out;
    uint32_t nsrc = sources ? sources->count : 0;
    if (nsrc > CK_MAX_SOURCES || (nsrc && (!strings || sources->size != nsrc * sizeof(struct ck_page_source))))
        goto out;
    const struct ck_page_run *r = (const struct ck_page_run *)(buf + runs->offset);
    uint64_t pages = 0, before = 0;
    for (uint64_t i = 0; i < runs->count; i++)
        pages += r[i].npages;
    for (uint64_t i = 0; i < tr.nruns; i++)
        before += tr.runs[i].npages;
    if (pages != before)
        goto out;  /* not the same pages: keep what we have */
    const struct ck_page_source *s = nsrc ? (const struct ck_page_source *)(buf + sources->offset) : 0;
    for (uint32_t i = 0; i < nsrc; i++)
        if (s[i].path >= strings->size)
            goto out;
    ck_memcpy(tr.runs, r, runs->count * sizeof(struct ck_page_run));
    tr.nruns = runs->count;
    uint64_t first = 0;
    for (uint64_t i = 0; i < tr.nruns; i++) {
        tr.runs[i].pad = tr.hashed ? (uint32_t)first : 0;
        first += tr.runs[i].npages;
    }
    const char *str = buf + (strings ? strings->offset : 0);
    for (uint32_t i = 0; i < nsrc; i++) {
        size_t left = strings->size - s[i].path, k = 0;
        char *to = tr.sources[i];
        for (; k < left && k + 1 < CK_SOURCE_PATH && str[s[i].path + k]; k++)
            to[k] = str[s[i].path + k];
        to[k] = 0;
        tr.source_size[i] = s[i].size;
    }
    tr.nsources = nsrc;
    rc = 0;
out:
    ck_arena_reset();
    return rc;
}
