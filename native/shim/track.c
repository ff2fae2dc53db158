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
 * The previous image's page runs live in the top of the scratch arena,
 * which is kept out of every image (CK_VMA_NOCONTENT).
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
    int32_t pid;                /* the process that created it: a fork starts over */
    int valid;                  /* the table describes the image named below */
    char ckpt[64];              /* its checkpoint, e.g. "ckpt-4" */
    char self[CK_SOURCE_PATH];  /* its directory, relative to the job's */
    uint64_t pages_size;        /* its pages.img */
    uint32_t nsources;
    char sources[CK_MAX_SOURCES][CK_SOURCE_PATH];
    uint64_t source_size[CK_MAX_SOURCES];
    struct ck_page_run *runs;   /* in the keep region */
    uint64_t nruns, cap;
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
    tr.ranges = (struct range *)keep;
    tr.runs = (struct ck_page_run *)(keep + MAX_RANGES * sizeof(struct range));
    tr.cap = (size - MAX_RANGES * sizeof(struct range)) / sizeof(struct ck_page_run);
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
    cur.usable = tr.valid && tr.uffd >= 0 && base && base[0] && !ck_strcmp(base, tr.ckpt);
    tr.valid = 0;  /* until this dump succeeds: a failed one may have re-armed pages */
    return 0;
}

int ck_track_incremental(void) { return cur.usable; }

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

/* The dump succeeded: remember its runs, protect what is not yet protected.
 * Every thread is still parked, so no write slips between image and arming. */
void ck_track_commit(struct ck_image *im, uint64_t pages_size)
{
    if (!cur.self[0] || ensure_keep() < 0 || open_uffd() < 0)
        return;
    if (im->runs.count > tr.cap || im->sources.count > CK_MAX_SOURCES)
        return;
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
    ck_memcpy(tr.runs, ck_table_at(&im->runs, 0), im->runs.count * sizeof(struct ck_page_run));
    tr.nruns = im->runs.count;
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
