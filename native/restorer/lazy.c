/*
 * Lazy restore (`ckptctl restart --lazy`): the job runs again before its
 * memory is back.
 *
 * The restorer maps each large private anonymous mapping empty and
 * registers it with a userfaultfd in missing mode (rst_lazy_register).
 * The restored shim names that descriptor in its HELLO; the agent takes a
 * copy (pidfd_getfd), starts `ckptd-restore --serve-lazy IMAGE_DIR --uffd N`
 * (rst_serve_lazy, below) and only then lets the job run.  The pager
 * answers page faults first, from the image, a window around each, and
 * copies everything else in the background in address order.  When every
 * page is in it closes the descriptor, which ends the registration: a page
 * the image never had is then an ordinary zero-filled page again.
 *
 * The job's own changes to its address space arrive as events, and the
 * pager honours them before it copies anything more: pages discarded
 * (MADV_DONTNEED, munmap) are never filled with their old contents
 * afterwards, and pages moved (mremap) are filled where they went.
 *
 * A fork would lose the registration in the child (whose unfilled pages
 * would read as zeros), so the shim holds fork() until the agent says the
 * fill is done (LAZY_DONE), and the agent holds checkpoints the same way.
 */
#include "restorer.h"

#include <errno.h>
#include <linux/userfaultfd.h>
#include <poll.h>
#include <sys/ioctl.h>

void *memmove(void *dst, const void *src, size_t n);  /* libc.c */

/* mappings with less than this to fill are filled at once: the job's code
 * paths, stacks and small heaps are back before it runs, only the bulk
 * (weights, buffers, large heaps) comes on demand */
#define LAZY_MIN (8ull << 20)
#define FAULT_WINDOW (256ull << 10)  /* copied around a faulting page */
#define FILL_CHUNK (1ull << 20)      /* copied at a time in the background */
#define FEATURES (UFFD_FEATURE_EVENT_REMAP | UFFD_FEATURE_EVENT_REMOVE | UFFD_FEATURE_EVENT_UNMAP)

int rst_vma_lazy(const struct rst_image *im, const struct ck_vma *v)
{
    const uint32_t eager = CK_VMA_SHARED | CK_VMA_FILE | CK_VMA_SHMEM | CK_VMA_GROWSDOWN | CK_VMA_STACK |
                           CK_VMA_LOCKED | CK_VMA_NOCONTENT | CK_VMA_DELETED | CK_VMA_VDSO | CK_VMA_VVAR;
    if ((v->flags & eager) || !(v->flags & CK_VMA_ANON) || !(v->prot & PROT_WRITE))
        return 0;
    uint64_t ri = im->proc->restart_info;  /* the restorer writes it last */
    if (ri >= v->start && ri < v->end)
        return 0;
    uint64_t bytes = 0;
    for (uint64_t r = v->first_run; r < v->first_run + v->nruns && r < im->nruns; r++)
        bytes += im->runs[r].npages * CK_PAGE_SIZE;
    return bytes >= LAZY_MIN;
}

/* phase 1: the descriptor, above every one the image will restore */
void rst_lazy_open(void)
{
    long fd = ck_sc1(SYS_userfaultfd, O_CLOEXEC | O_NONBLOCK);
    if (fd < 0)
        rst_fail("cannot create a userfaultfd for a lazy restore (needs CAP_SYS_PTRACE or "
                 "vm.unprivileged_userfaultfd=1); restart without --lazy", 0, fd);
    struct uffdio_api api = {.api = UFFD_API, .features = FEATURES};
    long rc = ck_ioctl((int)fd, UFFDIO_API, &api);
    if (rc < 0)
        rst_fail("this kernel's userfaultfd lacks the events a lazy restore needs; restart without --lazy", 0, rc);
    long high = ck_fcntl((int)fd, F_DUPFD_CLOEXEC, rst.maxfd + 16);
    if (high < 0)
        rst_fail("cannot move a descriptor out of the image's range", 0, high);
    ck_close((int)fd);
    rst.lazy_uffd = (int)high;
}

void rst_lazy_register(const struct ck_vma *v)
{
    struct uffdio_register reg = {
        .range = {.start = v->start, .len = v->end - v->start},
        .mode = UFFDIO_REGISTER_MODE_MISSING,
    };
    long rc = ck_ioctl(rst.lazy_uffd, UFFDIO_REGISTER, &reg);
    if (rc < 0)
        rst_fail("cannot register memory for a lazy restore; restart without --lazy", 0, rc);
}

/* ---- the pager ---- */

/* what is still to be copied: [start, end) from src, an address in the
 * pager's read-only mapping of a memory image; sorted, disjoint */
struct pending {
    uint64_t start, end, src;
};

static struct {
    int uffd;
    struct pending *p;
    uint64_t n, cap, head;  /* p[head..n) are left */
    uint64_t filled, faults, zeroed, events;
} lz;

static void reserve(uint64_t more)
{
    if (lz.n + more <= lz.cap)
        return;
    uint64_t cap = (lz.n + more) * 2 + 1024;
    void *p = lz.p ? ck_mremap(lz.p, lz.cap * sizeof(*lz.p), cap * sizeof(*lz.p), MREMAP_MAYMOVE, 0)
                   : ck_mmap(0, cap * sizeof(*lz.p), PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (ck_mmap_failed(p))
        rst_fail("out of memory in the lazy-restore pager", 0, (long)p);
    lz.p = p;
    lz.cap = cap;
}

static void insert_at(uint64_t i, struct pending e)
{
    reserve(1);
    memmove(&lz.p[i + 1], &lz.p[i], (lz.n - i) * sizeof(*lz.p));
    lz.p[i] = e;
    lz.n++;
}

static void remove_at(uint64_t i)
{
    memmove(&lz.p[i], &lz.p[i + 1], (lz.n - i - 1) * sizeof(*lz.p));
    lz.n--;
}

/* the first pending entry that ends after addr */
static uint64_t lower_bound(uint64_t addr)
{
    uint64_t lo = lz.head, hi = lz.n;
    while (lo < hi) {
        uint64_t mid = lo + (hi - lo) / 2;
        if (lz.p[mid].end <= addr)
            lo = mid + 1;
        else
            hi = mid;
    }
    return lo;
}

/* [a, b) will not be filled: discarded or unmapped by the job.  The parts
 * cut out are appended to out (when given) for a move. */
static uint64_t cut(uint64_t a, uint64_t b, struct pending *out, uint64_t out_cap)
{
    uint64_t nout = 0;
    for (uint64_t i = lower_bound(a); i < lz.n && lz.p[i].start < b;) {
        struct pending *e = &lz.p[i];
        uint64_t s = e->start > a ? e->start : a, t = e->end < b ? e->end : b;
        if (out && nout == out_cap)
            return nout;  /* the caller comes back for the rest */
        if (out)
            out[nout++] = (struct pending){s, t, e->src + (s - e->start)};
        if (s > e->start && t < e->end) {  /* the middle: split in two */
            struct pending right = {t, e->end, e->src + (t - e->start)};
            e->end = s;
            insert_at(i + 1, right);
            return nout;
        }
        if (s > e->start) {
            e->end = s;
            i++;
        } else if (t < e->end) {
            e->src += t - e->start;
            e->start = t;
            i++;
        } else {
            remove_at(i);
        }
    }
    return nout;
}

static void add(struct pending e)
{
    uint64_t i = lower_bound(e.start);
    insert_at(i, e);
}

/* mremap moved [from, from+len) to `to`: so do the pages still to come */
static void move(uint64_t from, uint64_t to, uint64_t len)
{
    static struct pending moved[4096];
    for (;;) {
        uint64_t n = cut(from, from + len, moved, sizeof(moved) / sizeof(moved[0]));
        for (uint64_t i = 0; i < n; i++) {
            moved[i].start = moved[i].start - from + to;
            moved[i].end = moved[i].end - from + to;
            add(moved[i]);
        }
        if (n < sizeof(moved) / sizeof(moved[0]))
            return;
        /* more pieces than fit at once: the rest are still at from, after what moved */
        uint64_t done = moved[n - 1].end - to;
        from += done;
        to += done;
        len -= done;
    }
}

static void handle_event(const struct uffd_msg *m)
{
    lz.events++;
    switch (m->event) {
    case UFFD_EVENT_REMOVE:
    case UFFD_EVENT_UNMAP:
        cut(m->arg.remove.start, m->arg.remove.end, 0, 0);
        break;
    case UFFD_EVENT_REMAP:
        cut(m->arg.remap.to, m->arg.remap.to + m->arg.remap.len, 0, 0);
        move(m->arg.remap.from, m->arg.remap.to, m->arg.remap.len);
        break;
    default:
        break;
    }
}

static void finish(void)
{
    char line[160];
    struct ck_buf b;
    ck_buf_init(&b, line, sizeof(line));
    ck_buf_str(&b, "filled=");
    ck_buf_u64(&b, lz.filled);
    ck_buf_str(&b, " faults=");
    ck_buf_u64(&b, lz.faults);
    ck_buf_str(&b, " zeroed_bytes=");
    ck_buf_u64(&b, lz.zeroed);
    ck_buf_str(&b, " events=");
    ck_buf_u64(&b, lz.events);
    ck_buf_char(&b, '\n');
    ck_write(1, b.data, b.len);
    ck_close(lz.uffd);  /* ends the registration: holes fault in as zeros */
    ck_exit_group(0);
}

static long now_ms(void)
{
    struct timespec ts;
    ck_clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

static long image_byte_again(uint64_t src, uint32_t *source);
static void image_unreadable(uint32_t source, long rc) __attribute__((noreturn));

/* how often one copy is tried again after an EFAULT whose byte then reads
 * (storage that failed for a moment, its page now in the page cache) */
#define COPY_RETRIES 3
/* how long a byte of the image is read again before the pager gives up */
#define BYTE_AGAIN_MS 10000

/* [dst, dst+len) filled: UFFDIO_COPY from src, straight from the page
 * cache (no copy through a buffer), or with src 0 UFFDIO_ZEROPAGE.
 * 0: done (filled, or no longer ours to fill: a page already there, a
 * mapping the job split or unmapped, which is then gone over page by
 * page); -EAGAIN: the address space is changing, read the events first. */
static long fill(uint64_t dst, uint64_t len, uint64_t src)
{
    uint64_t done = 0;
    int retries = 0;
    while (done < len) {
        long rc;
        int64_t got;
        if (src) {
            struct uffdio_copy c = {.dst = dst + done, .src = src + done, .len = len - done};
            rc = ck_ioctl(lz.uffd, UFFDIO_COPY, &c);
            got = c.copy;
        } else {
            struct uffdio_zeropage z = {.range = {.start = dst + done, .len = len - done}};
            rc = ck_ioctl(lz.uffd, UFFDIO_ZEROPAGE, &z);
            got = z.zeropage;
        }
        if (got > 0) {
            done += (uint64_t)got;
            *(src ? &lz.filled : &lz.zeroed) += (uint64_t)got;
        }
        if (rc == 0)
            break;
        if (rc == -EAGAIN || rc == -EINTR) {
            if (got > 0)
                continue;
            return -EAGAIN;
        }
        if (rc == -ESRCH)
            finish();  /* the process is gone: nothing left to fill */
        if (rc == -EFAULT && src) {  /* the image's page could not be read in from storage */
            uint32_t source;
            long r = image_byte_again(src + done, &source);
            if (r == 1 && retries++ < COPY_RETRIES)
                continue;  /* it reads now: the storage is back */
            image_unreadable(source, r);
        }
        if (rc != -EEXIST && rc != -ENOENT && rc != -EINVAL)
            rst_fail("cannot fill memory for a lazy restore", 0, rc);
        if (rc != -EEXIST && len - done > CK_PAGE_SIZE) {
            long r = fill(dst + done, CK_PAGE_SIZE, src ? src + done : 0);
            if (r < 0)
                return r;
        }
        done += CK_PAGE_SIZE;  /* filled just now, or needs nothing */
    }
    return 0;
}

/* Encrypted images (launch --encrypt) cannot be copied from the page cache:
 * each is an anonymous region of the pager's instead, the chunks a copy
 * needs are decrypted into it (read, tag checked) just before, and given
 * back right after. */
static struct {
    uint64_t base[CK_MAX_SOURCES + 1], size[CK_MAX_SOURCES + 1];
    int fd[CK_MAX_SOURCES + 1];  /* the image each mapping is of (image_byte_again) */
    uint32_t n;
} clear;

/* A copy from a memory image's mapping failed with EFAULT: storage that
 * returns EIO, or that went away, under a page not yet read in.  A read of
 * that very byte says which (the copy only says EFAULT), and is tried again
 * for some 10 s (50 ms, doubling, then every second): storage that comes
 * back by itself (a network filesystem's server, a retried I/O) costs the
 * job a wait, not its run.  Bounded by time, not by a count of reads: one
 * read of the byte can be several reads of the storage (readahead), or
 * none.  1 once the byte reads; else the last read's error.  *source: the
 * image it is in. */
static long image_byte_again(uint64_t src, uint32_t *source)
{
    uint32_t i = 0;
    while (i < clear.n && !(src >= clear.base[i] && src < clear.base[i] + clear.size[i]))
        i++;
    *source = i;
    if (i == clear.n)
        return -EFAULT;
    char byte;
    long rc = ck_pread(clear.fd[i], &byte, 1, src - clear.base[i]);
    long until = now_ms() + BYTE_AGAIN_MS;
    for (long wait_ms = 50; rc != 1 && now_ms() < until; wait_ms = wait_ms < 500 ? wait_ms * 2 : 1000) {
        ck_nanosleep_ms(wait_ms);
        rc = ck_pread(clear.fd[i], &byte, 1, src - clear.base[i]);
    }
    return rc;
}

/* The job cannot run on without that page: fail, naming the image and the
 * error the read of its byte got (rc). */
static void image_unreadable(uint32_t i, long rc)
{
    char what[1200];
    struct ck_buf b;
    ck_buf_init(&b, what, sizeof(what));
    ck_buf_str(&b, "cannot read the memory image ");
    ck_buf_str(&b, rst.image_dir);
    ck_buf_str(&b, i ? "'s source (an earlier checkpoint's pages.img)" : "/pages.img");
    ck_buf_str(&b, " for a lazy restore; its storage failed");
    ck_buf_char(&b, 0);
    rst_fail(what, 0, rc < 0 ? rc : -EFAULT);
}

static long fill_from(uint64_t dst, uint64_t len, uint64_t src)
{
    if (!rst.sealed || !src)
        return fill(dst, len, src);
    uint32_t i = 0;
    while (i < clear.n && !(src >= clear.base[i] && src < clear.base[i] + clear.size[i]))
        i++;
    if (i == clear.n)
        rst_fail("lazy restore: a page run outside its memory image", 0, 0);
    uint64_t from = (src - clear.base[i]) & ~(uint64_t)(CK_GCM_CHUNK - 1);
    uint64_t to = (src - clear.base[i] + len + CK_GCM_CHUNK - 1) & ~(uint64_t)(CK_GCM_CHUNK - 1);
    if (to > clear.size[i])
        to = clear.size[i];
    rst_seal_read(i, (void *)(clear.base[i] + from), to - from, from);
    long rc = fill(dst, len, src);
    ck_madvise((void *)(clear.base[i] + from), to - from, MADV_DONTNEED);
    return rc;
}

/* -EAGAIN: try again after the events */
static long serve_fault(uint64_t addr)
{
    addr &= ~(CK_PAGE_SIZE - 1);
    uint64_t i = lower_bound(addr);
    if (i < lz.n && lz.p[i].start <= addr) {
        const struct pending *e = &lz.p[i];
        uint64_t w = addr & ~(FAULT_WINDOW - 1);
        uint64_t s = w > e->start ? w : e->start, t = w + FAULT_WINDOW < e->end ? w + FAULT_WINDOW : e->end;
        long rc = fill_from(s, t - s, e->src + (s - e->start));
        if (rc < 0)
            return rc;
    } else {
        /* a page the image does not have, or one the job discarded: zeros,
         * up to the window's edge or the next page still to be filled */
        uint64_t w = addr & ~(FAULT_WINDOW - 1), t = w + FAULT_WINDOW;
        uint64_t s = i > lz.head && lz.p[i - 1].end > w ? lz.p[i - 1].end : w;
        if (i < lz.n && lz.p[i].start < t)
            t = lz.p[i].start;
        long rc = fill(s, t - s, 0);
        if (rc == -EAGAIN)
            return rc;
    }
    /* a fault raced with the copy that made the page present */
    struct uffdio_range r = {.start = addr, .len = CK_PAGE_SIZE};
    ck_ioctl(lz.uffd, UFFDIO_WAKE, &r);
    return 0;
}

static uint64_t queue[512];
static uint64_t nqueue;

/* read what the kernel has: events are applied, faults queued */
static void drain(int wait)
{
    static struct uffd_msg msgs[64];
    if (wait) {
        struct pollfd pfd = {.fd = lz.uffd, .events = POLLIN};
        long rc = ck_sc3(SYS_poll, &pfd, 1, -1);
        if (rc < 0 && rc != -EINTR)
            rst_fail("cannot wait for page faults", 0, rc);
    }
    for (;;) {
        long n = ck_read(lz.uffd, msgs, sizeof(msgs));
        if (n == -EAGAIN || n == -EINTR)
            return;
        if (n < 0)
            rst_fail("cannot read the userfaultfd", 0, n);
        for (long k = 0; k < n / (long)sizeof(msgs[0]); k++) {
            if (msgs[k].event != UFFD_EVENT_PAGEFAULT)
                handle_event(&msgs[k]);
            else if (nqueue < sizeof(queue) / sizeof(queue[0]))
                queue[nqueue++] = msgs[k].arg.pagefault.address;
            /* a full queue: that thread faults again, or the background copy wakes it */
        }
        if (n < (long)sizeof(msgs))
            return;
    }
}

void rst_serve_lazy(void)
{
    long next_fill = 0;
    char path[1200];
    struct ck_buf b;
    struct rst_image im;
    lz.uffd = rst.lazy_uffd;
    ck_buf_init(&b, path, sizeof(path));
    ck_buf_str(&b, rst.image_dir);
    ck_buf_str(&b, "/core.img");
    uint8_t *core = rst_read_file(path, &rst.core_size);
    rst_parse_image(&im, core, rst.core_size);
    rst_open_pages(&im);  /* sizes checked */
    if (rst.sealed) {
        uint8_t *area = ck_mmap(0, rst_seal_space(), PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
        if (ck_mmap_failed(area))
            rst_fail("out of memory", 0, (long)area);
        rst_seal_load(area);
    }
    uint64_t maps[CK_MAX_SOURCES + 1];
    for (uint64_t i = 0; i <= im.nsources; i++) {
        uint64_t size = i ? im.sources[i - 1].size : im.hdr->pages_size;
        int fd = i ? rst.source_fd[i - 1] : rst.pages_fd;
        void *m = !size       ? 0
                  : rst.sealed ? ck_mmap(0, size, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0)
                               : ck_mmap(0, size, PROT_READ, MAP_SHARED, fd, 0);
        clear.base[i] = (uint64_t)m;
        clear.size[i] = size;
        clear.fd[i] = fd;
        clear.n = (uint32_t)i + 1;
        if (ck_mmap_failed(m))
            rst_fail("cannot map a memory image for the lazy restore", 0, (long)m);
        maps[i] = (uint64_t)m;
    }

    /* the same choice the restorer made: rst_vma_lazy */
    for (uint32_t i = 0; i < im.nvmas; i++) {
        const struct ck_vma *v = &im.vmas[i];
        if (!rst_vma_lazy(&im, v))
            continue;
        for (uint64_t r = v->first_run; r < v->first_run + v->nruns; r++) {
            const struct ck_page_run *run = &im.runs[r];
            uint64_t base = run->src ? maps[run->src] : maps[0];
            reserve(1);
            lz.p[lz.n++] = (struct pending){run->vaddr, run->vaddr + run->npages * CK_PAGE_SIZE, base + run->offset};
        }
    }

    for (;;) {
        drain(0);
        for (uint64_t k = 0; k < nqueue;) {
            if (serve_fault(queue[k]) == -EAGAIN) {
                drain(0);
                continue;
            }
            lz.faults++;
            queue[k] = queue[--nqueue];
        }
        if (lz.head == lz.n) {
            if (!nqueue)
                finish();
            drain(1);
            continue;
        }
        long wait = rst.fill_delay_ms ? next_fill - now_ms() : 0;
        if (wait > 0) {  /* --fill-delay-ms: faults and events are served meanwhile */
            struct pollfd pfd = {.fd = lz.uffd, .events = POLLIN};
            ck_sc3(SYS_poll, &pfd, 1, wait);
            continue;
        }
        /* the background copy takes the lowest entry, front first, and
         * moves head past it when it is done (no memmove of the rest);
         * events are read only between copies, so it cannot change meanwhile */
        struct pending *e = &lz.p[lz.head];
        uint64_t len = e->end - e->start < FILL_CHUNK ? e->end - e->start : FILL_CHUNK;
        /* the next chunk is read from storage while this one is copied */
        uint64_t rest = e->end - e->start - len;
        if (rest && !rst.sealed)
            ck_madvise((void *)(e->src + len), rest < FILL_CHUNK ? rest : FILL_CHUNK, MADV_WILLNEED);
        if (fill_from(e->start, len, e->src) == 0) {
            e->start += len;
            e->src += len;
            if (e->start == e->end)
                lz.head++;
            if (rst.fill_delay_ms)
                next_fill = now_ms() + rst.fill_delay_ms;
        }
    }
}
