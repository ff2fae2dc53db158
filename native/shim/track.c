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
 *   - a process that forked (the child's mappings lose the registration)
 *     or exec'd (the table below starts empty again); a restored process
 *     takes the image it came from (ck_track_adopt: the restorer
 *     write-protected its memory before anything ran);
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
#include "../common/track_arm.h"

#include <errno.h>
#include <sys/ioctl.h>

#define MAX_RANGES 65536

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
    long fd = ck_track_uffd_open(0);
    if (fd < 0)
        return (int)fd;
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
 * now on (common/track_arm.h).  One not fully protected is left out of
 * the ranges: copied in full next time. */
static void arm_range(int pagemap_fd, uint64_t start, uint64_t end)
{
    static struct ck_page_region regions[256];
    if (ck_track_arm_range(tr.uffd, pagemap_fd, start, end, regions, sizeof(regions) / sizeof(regions[0])) < 0)
        return;
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
        if (ck_vma_trackable(v->flags) && !(v->flags & CK_VMA_TRACKED))
            arm_range(pagemap_fd, v->start, v->end);
    }
    ck_close(pagemap_fd);
}

/* A core.img read into the arena (reset it after use), its sections
 * checked to lie inside the file. */
struct core_file {
    const char *buf;
    const struct ck_header *h;
    const struct ck_section *runs, *sources, *strings, *vmas;
};

static int read_core(const char *core_path, struct core_file *c)
{
    if (ck_arena_setup() < 0)
        return -ENOMEM;
    size_t cap = 64u << 20;
    char *buf = ck_arena_alloc(cap);
    if (!buf)
        return -ENOMEM;
    long n = ck_read_file(core_path, buf, cap);
    if (n < 0)
        return (int)n;
    const struct ck_header *h = (const struct ck_header *)buf;
    if ((size_t)n < sizeof(*h) || h->magic != CK_CORE_MAGIC || h->version != CK_CORE_VERSION ||
        h->file_size != (uint64_t)n || h->nsections > CK_MAX_SECTIONS)
        return -EINVAL;  /* not a core.img of this version */
    ck_memset(c, 0, sizeof(*c));
    c->buf = buf;
    c->h = h;
    for (uint32_t i = 0; i < h->nsections; i++) {
        const struct ck_section *sec = &h->sections[i];
        if (sec->offset > (uint64_t)n || sec->size > (uint64_t)n - sec->offset)
            return -EINVAL;
        if (sec->type == CK_SEC_RUNS)
            c->runs = sec;
        else if (sec->type == CK_SEC_SOURCES)
            c->sources = sec;
        else if (sec->type == CK_SEC_STRINGS)
            c->strings = sec;
        else if (sec->type == CK_SEC_VMAS)
            c->vmas = sec;
    }
    if (!c->runs || c->runs->size != c->runs->count * sizeof(struct ck_page_run) || c->runs->count > tr.cap ||
        c->runs->offset % 8 || (c->vmas && c->vmas->offset % 8))
        return -EINVAL;  /* read in place as the records they hold */
    uint32_t nsrc = c->sources ? c->sources->count : 0;
    if (nsrc > CK_MAX_SOURCES || (nsrc && (!c->strings || c->sources->size != nsrc * sizeof(struct ck_page_source))))
        return -EINVAL;
    const struct ck_page_source *s = nsrc ? (const struct ck_page_source *)(buf + c->sources->offset) : 0;
    for (uint32_t i = 0; i < nsrc; i++)
        if (s[i].path >= c->strings->size)
            return -EINVAL;
    return 0;
}

/* the core's runs and sources into the table (its page hashes, if any, are the caller's) */
static void take_runs(const struct core_file *c)
{
    const struct ck_page_run *r = (const struct ck_page_run *)(c->buf + c->runs->offset);
    ck_memcpy(tr.runs, r, c->runs->count * sizeof(struct ck_page_run));
    tr.nruns = c->runs->count;
    uint64_t first = 0;
    for (uint64_t i = 0; i < tr.nruns; i++) {
        tr.runs[i].pad = tr.hashed ? (uint32_t)first : 0;
        first += tr.runs[i].npages;
    }
    uint32_t nsrc = c->sources ? c->sources->count : 0;
    const struct ck_page_source *s = nsrc ? (const struct ck_page_source *)(c->buf + c->sources->offset) : 0;
    const char *str = c->buf + (c->strings ? c->strings->offset : 0);
    for (uint32_t i = 0; i < nsrc; i++) {
        size_t left = c->strings->size - s[i].path, k = 0;
        char *to = tr.sources[i];
        for (; k < left && k + 1 < CK_SOURCE_PATH && str[s[i].path + k]; k++)
            to[k] = str[s[i].path + k];
        to[k] = 0;
        tr.source_size[i] = s[i].size;
    }
    tr.nsources = nsrc;
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
    struct core_file c;
    int rc = read_core(core_path, &c);
    if (rc == 0) {
        const struct ck_page_run *r = (const struct ck_page_run *)(c.buf + c.runs->offset);
        uint64_t pages = 0, before = 0;
        for (uint64_t i = 0; i < c.runs->count; i++)
            pages += r[i].npages;
        for (uint64_t i = 0; i < tr.nruns; i++)
            before += tr.runs[i].npages;
        if (pages == before)
            take_runs(&c);
        else
            rc = -EINVAL;  /* not the same pages: keep what we have */
    }
    ck_arena_reset();
    return rc;
}

/* Restored: the restorer's write protection (track_uffd, or -1), armed on
 * the restored memory before anything ran (restorer/track.c).  The table
 * is empty until the agent names the image (ck_track_adopt). */
void ck_track_restored(int track_uffd)
{
    ck_track_forget();
    if (track_uffd < 0)
        return;
    if (ck_shim.track_mode == CK_TRACK_OFF || ck_shim.track_mode == CK_TRACK_HASH || !still_ours(track_uffd)) {
        ck_close(track_uffd);  /* not this process's way of tracking (CKPTD_TRACK) */
        return;
    }
    tr.uffd = track_uffd;
    tr.pid = (int32_t)ck_getpid();
}

/* The image this process was restored from (core_path; self: its name
 * relative to the job's directory, "ckpt-N[/rank-R]/proc-P"), taken as if
 * this process had just written it: its page runs and sources, and its
 * trackable mappings, which the restorer protected before anything ran.
 * A page unwritten since then holds what the image's runs hold, so the
 * next image, with this one as its base, refers to it (an incremental
 * one); every page written since, by the restorer's last steps, the shim
 * or the job, reads as written and is copied.  Parked: nothing runs. */
int ck_track_adopt(const char *core_path, const char *self)
{
    if (tr.uffd < 0 || tr.valid || tr.pid != (int32_t)ck_getpid())
        return -ESTALE;  /* no protection from the restorer, or a table already */
    if (!self || !self[0] || ck_strlen(self) >= CK_SOURCE_PATH || ensure_keep() < 0)
        return -EINVAL;
    const char *slash = self;
    while (*slash && *slash != '/')
        slash++;
    if (!*slash || (size_t)(slash - self) >= sizeof(tr.ckpt))
        return -EINVAL;
    struct core_file c;
    int rc = read_core(core_path, &c);
    if (rc == 0 && (!c.vmas || c.vmas->size != c.vmas->count * sizeof(struct ck_vma)))
        rc = -EINVAL;
    if (rc == 0) {
        tr.hashed = 0;
        take_runs(&c);
        /* the ranges the restorer registered; mappings the kernel merged
         * since count as one (ck_track_registered asks for containment) */
        const struct ck_vma *v = (const struct ck_vma *)(c.buf + c.vmas->offset);
        tr.nranges = 0;
        for (uint64_t i = 0; i < c.vmas->count; i++) {
            if (!ck_vma_trackable(v[i].flags))
                continue;
            if (tr.nranges && tr.ranges[tr.nranges - 1].end == v[i].start)
                tr.ranges[tr.nranges - 1].end = v[i].end;
            else if (tr.nranges < MAX_RANGES) {
                tr.ranges[tr.nranges].start = v[i].start;
                tr.ranges[tr.nranges].end = v[i].end;
                tr.nranges++;
            }
        }
        ck_memcpy(tr.ckpt, self, (size_t)(slash - self));
        tr.ckpt[slash - self] = 0;
        copy_str(tr.self, sizeof(tr.self), self);
        tr.pages_size = c.h->pages_size;
        tr.valid = 1;
    }
    ck_arena_reset();
    return rc;
}
