/*
 * A rank's writer leaves out the pages rank 0 holds (launch --dedup).
 *
 * Data-parallel ranks hold the same weights.  Comparing after both ranks
 * have written (ckptd-dedup, native/common/dedup_tool.c) writes the copy,
 * keeps it cached, reads it back and punches it out again; and waiting for
 * rank 0 to finish before comparing keeps rank 0's whole image cached: on a
 * VM, fresh page cache costs more than the write.  Here the writer of a
 * rank other than 0 compares while rank 0's writers write, with their pages
 * still in the little page cache they keep behind them, and does not write
 * what they hold:
 *
 *   1. Rank 0's writers (CK_DEDUP_SOURCE) say how far they have written, in
 *      file order, in pages.progress beside their pages (8 bytes: every
 *      byte below is final; ~0 once all is).  At Finalize each other rank's
 *      agent leaves dedup.spec in each of its process directories
 *      (ckptd/image/dedup.py write_spec): rank 0's pages files and the runs
 *      of pages each holds itself ("peer PATH", "run OFFSET NPAGES", runs
 *      in file order), or "none".  The writer (CK_DEDUP_COMPARE) waits for
 *      it, at most SPEC_WAIT_MS: then it writes every page.
 *   2. It maps rank 0's files (pages.img.part while they are written) and,
 *      as their writers move on, hashes every STRIDE-th page they have
 *      written into a table (xxh3-64: the hash only proposes a page).
 *   3. Walking its own runs in file order, it first lets rank 0 get LEAD
 *      bytes ahead of its own offset (or finish), then looks each page up
 *      and compares it byte for byte with rank 0's; a match grows back
 *      over the pages not yet handed to the write (up to STRIDE - 1 lie
 *      before the first page the table has) and forwards, page by page,
 *      with the comparison alone.  A matched stretch is left a hole in
 *      pages.img (zeros in the writer's checksum: the file as it reads) and
 *      recorded in pages.match: "match OWN_OFFSET PEER PEER_OFFSET NPAGES",
 *      as ckptd-dedup answers, then "done INDEXED HASHED MATCHED".
 *   4. The agent turns the matches into references to rank 0's pages (the
 *      SOURCES of core.img) and has the process's shim take them (REBASE).
 *      Where it cannot, it copies the pages from rank 0's files into the
 *      holes: the image is then what it would have been without --dedup.
 *      A writer that wrote every page leaves no pages.match, and the agent
 *      compares afterwards as before.
 *
 * Only bytes rank 0's writer has said are final are read.  A rank 0 page
 * further than LEAD ahead of the same offset in this rank's file is missed
 * (the replicas' layouts differ by far less); so is everything once rank
 * 0's writer has said nothing new for STALL_MS, or is gone unfinished.  A
 * miss costs space, never correctness.  A match lies within one own run
 * and one peer run, so the agent can cut runs at its ends.  The writer is
 * a raw clone: raw system calls, memory from mmap, nothing from libc but
 * the hash found in the constructor.
 */
#include "shim.h"
#include "../common/sys.h"
#include "../common/util.h"

#include <errno.h>
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>

#include <sys/file.h>

#define PAGE CK_PAGE_SIZE
#define SPEC "dedup.spec"
#define MATCHES "pages.match"
#define PROGRESS "pages.progress"
#define SPEC_WAIT_MS (30L * 60 * 1000) /* rank 0's writers: minutes at most for what fits in a node */
#define SPEC_POLL_MS 5
#define SPEC_MAX (64ull << 20)
#define MAX_PEERS CK_MAX_SOURCES
#define LEAD (64ull << 20)  /* rank 0 ahead of this writer's own offset: within the cache it keeps */
#define STALL_MS 30000      /* rank 0 saying nothing new this long: stop waiting for it */
#define PLAIN_BATCH 256     /* pages not held, handed out at most this many at a time */
#define STRIDE 8            /* rank 0's pages hashed: those at file offsets a multiple of this many pages */
#define DONE (~0ull)

/* ---- rank 0's side ---- */

int ck_dedup_progress_open(int dirfd)
{
    int fd = (int)ck_openat(dirfd, PROGRESS, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC | O_NOFOLLOW, 0600);
    return fd < 0 ? -1 : fd;
}

void ck_dedup_progress(int fd, uint64_t upto)
{
    if (fd >= 0)
        (void)ck_pwrite(fd, &upto, sizeof(upto), 0);  /* a hint: a peer that misses it waits for the end */
}

/* ---- the comparing rank's side ---- */

struct peer_run {
    uint32_t file;
    uint64_t offset, npages;
};

enum peer_state { WRITING, FINISHED, GONE };

struct peer {
    const uint8_t *map;
    uint64_t size;          /* mapped: where its last run ends */
    int progress;           /* its pages.progress, -1: none yet (then wait for its end) */
    const char *progress_path;
    int part;               /* its pages.img.part: lockable once its writer is gone */
    const char *final_path; /* pages.img: there once it is complete */
    enum peer_state state;
    uint64_t ready;         /* every byte below this is final */
    uint64_t run, run_end;  /* runs [run, run_end) not all indexed yet */
    uint64_t next;          /* the next page of runs[run] to index */
    uint64_t unmapped;      /* the mapping's pages below are let go */
};

struct slot {
    uint64_t hash;
    uint64_t offset;
    uint64_t run; /* peer run + 1; 0: empty */
};

struct ck_dedup {
    ck_page_hash_fn hash;
    struct peer peers[MAX_PEERS];
    uint32_t npeers;
    struct peer_run *runs;
    uint64_t nruns;
    struct slot *table;
    uint64_t mask;
    uint64_t next_catch_up; /* own offset at which to let rank 0 get ahead again */
    int64_t last_move;      /* when a peer last said something new */
    int out;                /* pages.match */
    char buf[4096];
    struct ck_buf line;
    uint64_t indexed, hashed, matched;
    int64_t started, waited, indexing; /* ns: for the agent's log line */
};

static struct ck_dedup dedup; /* one writer, one image */

static void *map_anon(uint64_t len)
{
    void *p = ck_mmap(0, len, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    return ck_mmap_failed(p) ? 0 : p;
}

static int64_t now_ms(void) { return ck_now_ns(CLOCK_MONOTONIC) / 1000000; }

static int differs(const uint8_t *a, const uint8_t *b)
{
    const uint64_t *x = (const uint64_t *)a, *y = (const uint64_t *)b;
    for (int i = 0; i < (int)(PAGE / 8); i += 8) {
        uint64_t d = 0;
        for (int k = 0; k < 8; k++)
            d |= x[i + k] ^ y[i + k];
        if (d)
            return 1;
    }
    return 0;
}

static void table_add(struct ck_dedup *dd, uint64_t h, uint64_t run, uint64_t offset)
{
    for (uint64_t i = h & dd->mask;; i = (i + 1) & dd->mask) {
        if (!dd->table[i].run) {
            dd->table[i] = (struct slot){h, offset, run + 1};
            return;
        }
        if (dd->table[i].hash == h)
            return; /* the first page with this hash serves */
    }
}

static const struct slot *table_find(const struct ck_dedup *dd, uint64_t h)
{
    for (uint64_t i = h & dd->mask; dd->table[i].run; i = (i + 1) & dd->mask)
        if (dd->table[i].hash == h)
            return &dd->table[i];
    return 0;
}

/* hash every page of p's runs below p->ready not hashed yet */
static void index_ready(struct ck_dedup *dd, struct peer *p)
{
    for (; p->run < p->run_end; p->run++) {
        const struct peer_run *r = &dd->runs[p->run];
        uint64_t end = r->offset + r->npages * PAGE;
        if (p->next < r->offset)
            p->next = r->offset;
        for (; p->next < end && p->next + PAGE <= p->ready; p->next += PAGE) {
            if ((p->next / PAGE) % STRIDE)
                continue;
            table_add(dd, dd->hash(p->map + p->next, PAGE), p->run, p->next);
            dd->indexed++;
        }
        if (p->next < end)
            return;
    }
}

/* what p's writer has said since; 1 if anything new */
static int refresh(struct peer *p)
{
    uint64_t said = 0, before = p->ready;
    if (p->progress < 0) {  /* its writer had not started yet when the list came */
        int fd = (int)ck_open(p->progress_path, O_RDONLY | O_CLOEXEC | O_NOFOLLOW, 0);
        p->progress = fd < 0 ? -1 : fd;
    }
    if (p->progress >= 0 && ck_pread(p->progress, &said, sizeof(said), 0) == sizeof(said))
        p->ready = said == DONE ? p->size : said < p->size ? said : p->size;
    if (said == DONE) {
        p->state = FINISHED;
    } else if (ck_flock(p->part, LOCK_SH | LOCK_NB) == 0) {  /* its writer is gone */
        (void)ck_flock(p->part, LOCK_UN);
        if (p->progress >= 0 && ck_pread(p->progress, &said, sizeof(said), 0) == sizeof(said) && said == DONE)
            p->state = FINISHED;
        else
            p->state = ck_faccessat(AT_FDCWD, p->final_path) == 0 ? FINISHED : GONE;
        if (p->state == FINISHED)
            p->ready = p->size;
    }
    return p->ready != before || p->state != WRITING;
}

/* Let go of what lies well behind: rank 0's writer drops its pages from the
 * page cache DROP_BEHIND after writing them (writeout.c), which it cannot
 * while they are mapped here; fresh page cache is what costs on a VM.  A
 * page looked at again is read again. */
static void let_go(struct peer *p, uint64_t below)
{
    below &= ~(PAGE - 1);
    if (below > p->size)
        below = p->size & ~(PAGE - 1);
    if (below <= p->unmapped)
        return;
    (void)ck_madvise((void *)(p->map + p->unmapped), below - p->unmapped, MADV_DONTNEED);
    p->unmapped = below;
}

/* index what rank 0 has written, waiting until each of its writers is past
 * `want` (or done, or silent for STALL_MS) */
static void catch_up_now(struct ck_dedup *dd, uint64_t want)
{
    for (uint32_t k = 0; k < dd->npeers && want > 2 * LEAD; k++)
        let_go(&dd->peers[k], want - 2 * LEAD);
    for (;;) {
        int waiting = 0;
        for (uint32_t k = 0; k < dd->npeers; k++) {
            struct peer *p = &dd->peers[k];
            if (p->state == WRITING && refresh(p))
                dd->last_move = now_ms();
            index_ready(dd, p);
            waiting |= p->state == WRITING && p->ready < (want < p->size ? want : p->size);
        }
        if (!waiting)
            return;
        if (now_ms() - dd->last_move > STALL_MS) {
            for (uint32_t k = 0; k < dd->npeers; k++)
                if (dd->peers[k].state == WRITING)
                    dd->peers[k].state = GONE; /* what it said it wrote still counts */
            return;
        }
        int64_t t = ck_now_ns(CLOCK_MONOTONIC);
        ck_nanosleep_ms(1);
        dd->waited += ck_now_ns(CLOCK_MONOTONIC) - t;
    }
}

/* the same, timed */
static void catch_up(struct ck_dedup *dd, uint64_t want)
{
    int64_t t0 = ck_now_ns(CLOCK_MONOTONIC);
    catch_up_now(dd, want);
    dd->indexing += ck_now_ns(CLOCK_MONOTONIC) - t0;
}

static int open_spec(int dirfd)
{
    for (long waited = 0; waited < SPEC_WAIT_MS; waited += SPEC_POLL_MS) {
        int fd = (int)ck_openat(dirfd, SPEC, O_RDONLY | O_CLOEXEC | O_NOFOLLOW, 0);
        if (fd != -ENOENT)
            return fd;
        ck_nanosleep_ms(SPEC_POLL_MS);
    }
    return -ETIMEDOUT;
}

/* the spec, whole and terminated, in memory of its own; NULL on any error */
static char *read_spec(int dirfd)
{
    int fd = open_spec(dirfd);
    struct stat st;
    if (fd < 0)
        return 0;
    char *text = 0;
    if (ck_fstat(fd, &st) == 0 && st.st_size > 0 && (uint64_t)st.st_size < SPEC_MAX &&
        (text = map_anon((uint64_t)st.st_size + 1))) {
        for (uint64_t got = 0; got < (uint64_t)st.st_size;) {
            long n = ck_read(fd, text + got, (uint64_t)st.st_size - got);
            if (n == -EINTR)
                continue;
            if (n <= 0) {
                text = 0;
                break;
            }
            got += (uint64_t)n;
        }
    }
    ck_close(fd);
    return text;
}

/* "PATH.part" (or "DIR/pages.progress") beside PATH, in its own memory */
static char *beside(const char *path, const char *suffix, int replace_name)
{
    size_t n = ck_strlen(path), cut = n;
    if (replace_name)
        while (cut > 0 && path[cut - 1] != '/')
            cut--;
    char *out = map_anon(cut + ck_strlen(suffix) + 1);
    if (out) {
        ck_memcpy(out, path, cut);
        ck_memcpy(out + cut, suffix, ck_strlen(suffix) + 1);
    }
    return out;
}

/* rank 0's pages file at path: finished (pages.img), or still being
 * written (pages.img.part, its writer's pages.progress); -1 on failure */
static int open_peer(struct peer *p, const char *path)
{
    char *part = beside(path, ".part", 0), *progress = beside(path, PROGRESS, 1);
    if (!part || !progress)
        return -1;
    p->final_path = path;
    p->progress_path = progress;
    p->progress = -1;
    for (int attempt = 0; attempt < 2; attempt++) {
        int fd = (int)ck_open(path, O_RDONLY | O_CLOEXEC | O_NOFOLLOW, 0);
        if (fd >= 0) {
            p->part = fd;
            p->state = FINISHED;
            return 0;
        }
        /* its progress is opened after this (refresh): a writer that
         * finishes in between still leaves ~0 there (or its lock free and
         * pages.img named) */
        fd = (int)ck_open(part, O_RDONLY | O_CLOEXEC | O_NOFOLLOW, 0);
        if (fd >= 0) {
            p->part = fd;
            p->state = WRITING;
            return 0;
        }
    }
    return -1; /* neither: renamed between the two, twice, or not there */
}

/* the spec's files mapped and its runs listed; 0, or -1: do not deduplicate */
static int parse_spec(struct ck_dedup *dd, char *text)
{
    uint64_t lines = 1, pages = 0;
    for (const char *c = text; *c; c++)
        lines += *c == '\n';
    dd->runs = map_anon(lines * sizeof(struct peer_run));
    if (!dd->runs)
        return -1;
    for (char *at = text; *at;) {
        char *line = at;
        while (*at && *at != '\n')
            at++;
        if (*at)
            *at++ = 0;
        struct peer *p = dd->npeers ? &dd->peers[dd->npeers - 1] : 0;
        if (ck_startswith(line, "peer ")) {
            if (dd->npeers == MAX_PEERS || open_peer(&dd->peers[dd->npeers], line + 5) < 0)
                return -1;
            dd->peers[dd->npeers].run = dd->peers[dd->npeers].run_end = dd->nruns;
            dd->npeers++;
        } else if (ck_startswith(line, "run ")) {
            const char *end;
            uint64_t off = ck_parse_u64(line + 4, 10, &end);
            uint64_t n = ck_parse_u64(ck_skip_spaces(end), 10, &end);
            if (!p || *end || off % PAGE || off < p->size || n > (~0ull - off) / PAGE)
                return -1; /* runs in file order, page aligned */
            if (n)
                dd->runs[dd->nruns++] = (struct peer_run){dd->npeers - 1, off, n};
            p->run_end = dd->nruns;
            p->size = off + n * PAGE;
            pages += n;
        } else if (*line) {
            return -1; /* "none", or anything else */
        }
    }
    for (uint32_t k = 0; k < dd->npeers; k++) {
        struct peer *p = &dd->peers[k];
        struct stat st;
        if (!p->size || ck_fstat(p->part, &st) < 0 || (p->state == FINISHED && (uint64_t)st.st_size < p->size))
            return -1; /* finished shorter than its runs (truncated?): no deduplication */
        void *m = ck_mmap(0, p->size, PROT_READ, MAP_SHARED, p->part, 0);
        if (ck_mmap_failed(m))
            return -1;
        p->map = m;
        p->ready = p->state == FINISHED ? p->size : 0;
    }
    if (!pages)
        return -1;
    uint64_t slots = 1024; /* twice the pages hashed: one in STRIDE of each run, and its first */
    while (slots < (pages / STRIDE + dd->nruns) * 2)
        slots <<= 1;
    dd->table = map_anon(slots * sizeof(struct slot));
    if (!dd->table)
        return -1;
    dd->mask = slots - 1;
    dd->last_move = now_ms();
    return 0;
}

static int flush_line(struct ck_dedup *dd)
{
    for (size_t done = 0; done < dd->line.len;) {
        long n = ck_write(dd->out, dd->line.data + done, dd->line.len - done);
        if (n == -EINTR)
            continue;
        if (n <= 0)
            return n < 0 ? (int)n : -EIO;
        done += (size_t)n;
    }
    ck_buf_init(&dd->line, dd->buf, sizeof(dd->buf));
    return 0;
}

static int record(struct ck_dedup *dd, const char *word, const uint64_t *v, int n)
{
    if (dd->line.len > sizeof(dd->buf) - 128) {
        int rc = flush_line(dd);
        if (rc)
            return rc;
    }
    ck_buf_str(&dd->line, word);
    for (int i = 0; i < n; i++) {
        ck_buf_char(&dd->line, ' ');
        ck_buf_u64(&dd->line, v[i]);
    }
    ck_buf_char(&dd->line, '\n');
    return 0;
}

struct ck_dedup *ck_dedup_begin(int dirfd)
{
    struct ck_dedup *dd = &dedup;
    dd->hash = ck_checksum_page_hash();
    if (!dd->hash)
        return 0;
    char *text = read_spec(dirfd);
    if (!text || parse_spec(dd, text) < 0)
        return 0; /* what it mapped and opened goes with the writer */
    dd->out = (int)ck_openat(dirfd, MATCHES, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC | O_NOFOLLOW, 0600);
    if (dd->out < 0)
        return 0;
    ck_buf_init(&dd->line, dd->buf, sizeof(dd->buf));
    dd->started = ck_now_ns(CLOCK_MONOTONIC);
    return dd;
}

int ck_dedup_run(struct ck_dedup *dd, uint64_t off, const char *mem, uint64_t npages, ck_dedup_out_fn out, void *ctx)
{
    const uint8_t *own = (const uint8_t *)mem;
    uint64_t i = 0, plain = 0; /* pages [plain, i) are not held and not handed out yet */
    int rc = 0;
    while (i < npages && rc == 0) {
        uint64_t at = off + i * PAGE;
        if (at >= dd->next_catch_up) {
            catch_up(dd, at + LEAD);
            dd->next_catch_up = at + LEAD / 4;
        }
        const uint8_t *page = own + i * PAGE;
        dd->hashed++;
        const struct slot *s = table_find(dd, dd->hash(page, PAGE));
        const struct peer_run *pr = s ? &dd->runs[s->run - 1] : 0;
        const struct peer *p = pr ? &dd->peers[pr->file] : 0;
        if (!s || differs(page, p->map + s->offset)) {
            i++;
            if (i - plain == PLAIN_BATCH) {
                rc = out(ctx, off + plain * PAGE, mem + plain * PAGE, (i - plain) * PAGE, 0);
                plain = i;
            }
            continue;
        }
        /* backwards over the pages not handed out yet (a stretch begins up
         * to STRIDE - 1 pages before the first page rank 0's table has),
         * then forwards, page by page, within the peer's run and what it
         * has written */
        uint64_t back = 0;
        while (i - back > plain && s->offset - back * PAGE > pr->offset &&
               !differs(page - (back + 1) * PAGE, p->map + s->offset - (back + 1) * PAGE))
            back++;
        uint64_t fwd = 1, peer_end = pr->offset + pr->npages * PAGE;
        if (peer_end > p->ready)
            peer_end = p->ready;
        while (i + fwd < npages && s->offset + fwd * PAGE < peer_end &&
               !differs(page + fwd * PAGE, p->map + s->offset + fwd * PAGE))
            fwd++;
        uint64_t first = i - back;
        if (first > plain)
            rc = out(ctx, off + plain * PAGE, mem + plain * PAGE, (first - plain) * PAGE, 0);
        uint64_t m[4] = {off + first * PAGE, pr->file, s->offset - back * PAGE, back + fwd};
        if (rc == 0)
            rc = record(dd, "match", m, 4);
        if (rc == 0)
            rc = out(ctx, off + first * PAGE, mem + first * PAGE, (back + fwd) * PAGE, 1);
        dd->matched += back + fwd;
        i += fwd;
        plain = i;
    }
    if (rc == 0 && npages > plain)
        rc = out(ctx, off + plain * PAGE, mem + plain * PAGE, (npages - plain) * PAGE, 0);
    return rc;
}

int ck_dedup_end(struct ck_dedup *dd)
{
    /* and, for the agent's log: milliseconds in all, waiting for rank 0,
     * and hashing its pages (waits included) */
    uint64_t counts[6] = {dd->indexed, dd->hashed, dd->matched,
                          (uint64_t)(ck_now_ns(CLOCK_MONOTONIC) - dd->started) / 1000000,
                          (uint64_t)dd->waited / 1000000, (uint64_t)dd->indexing / 1000000};
    int rc = record(dd, "done", counts, 6);
    if (rc == 0)
        rc = flush_line(dd);
    if (rc == 0)
        rc = (int)ck_fsync(dd->out);
    ck_close(dd->out);
    return rc;
}
