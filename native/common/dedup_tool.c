/*
 * ckptd-dedup: which pages of one pages.img another rank's pages.img files
 * hold too, at disk speed (ckptd/image/dedup.py drives it).
 *
 *   ckptd-dedup [--stride N] [--digest] < SPEC
 *
 * SPEC, one item a line:
 *   peer PATH          a pages file of the peer (rank 0): numbered 0, 1, ...
 *   own PATH           the pages file whose pages are looked for (one)
 *   run OFFSET NPAGES  a run of pages the file named last holds itself
 *                      (src 0 in its core.img), OFFSET in bytes
 *
 * Output, one line a match, then a last line:
 *   match OWN_OFFSET PEER PEER_OFFSET NPAGES
 *   digest HEX SIZE     (with --digest, where libxxhash is there)
 *   done INDEXED HASHED MATCHED
 * A match lies within one own run and within one peer run, and says the
 * NPAGES pages at OWN_OFFSET of the own file are byte for byte the pages
 * at PEER_OFFSET of peer file PEER: every page of a match was compared,
 * never taken on its hash.  Matches come in own-run order; INDEXED,
 * HASHED and MATCHED count pages.  The digest is the xxh3-128 of the own
 * file as it will read once every match is punched out (zeros there), SIZE
 * its size: the caller, having punched every hole, records it as the
 * writer's digest (ckptd/image/checksum.py) instead of reading the whole
 * file again to hash it.
 *
 * How: the peer's pages at file offsets that are a multiple of STRIDE
 * pages (default 1: all of them) are hashed into a table (xxh3-64 from the
 * system's libxxhash, as native/shim/checksum.c finds it, else a local
 * hash; the hash only picks a candidate).  The own pages are walked in
 * order; a page is hashed only while no match is going on: a candidate
 * found, compared equal, the match grows backwards over the pages just
 * passed and forwards page by page with memcmp against the peer's next
 * page.  Two identical images thus cost one read of each and one hash of
 * the peer's pages.  With STRIDE > 1 the peer costs 1/STRIDE of the
 * hashing, and a matching stretch of fewer than STRIDE pages may be
 * missed.
 *
 * Any bad input (a run past the end of its file, an unreadable file, a
 * malformed line) exits 2 with "ckptd-dedup: ..." on stderr and no "done"
 * line: the caller then keeps its image as it was.
 */
#include <dlfcn.h>
#include <errno.h>
#include <fcntl.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#define PAGE 4096ULL

static void die(const char *fmt, const char *arg)
{
    fprintf(stderr, "ckptd-dedup: ");
    fprintf(stderr, fmt, arg);
    fprintf(stderr, "\n");
    exit(2);
}

/* ---- the page hash ---- */

typedef uint64_t (*xxh64_fn)(const void *p, size_t n);
static xxh64_fn xxh3_64;

static uint64_t local_hash(const void *p, size_t n)
{
    const uint64_t *w = p;
    uint64_t a = 0x9e3779b97f4a7c15ULL, b = 0xc2b2ae3d27d4eb4fULL, c = 0x165667b19e3779f9ULL,
             d = 0x27d4eb2f165667c5ULL;
    for (size_t i = 0; i + 4 <= n / 8; i += 4) {
        a = (a ^ w[i]) * 0xff51afd7ed558ccdULL;
        b = (b ^ w[i + 1]) * 0xc4ceb9fe1a85ec53ULL;
        c = (c ^ w[i + 2]) * 0xff51afd7ed558ccdULL;
        d = (d ^ w[i + 3]) * 0xc4ceb9fe1a85ec53ULL;
        a ^= a >> 29, b ^= b >> 31, c ^= c >> 29, d ^= d >> 31;
    }
    uint64_t h = a ^ (b << 1 | b >> 63) ^ (c << 2 | c >> 62) ^ (d << 3 | d >> 61);
    h ^= h >> 33;
    h *= 0xff51afd7ed558ccdULL;
    return h ^ (h >> 33);
}

static uint64_t page_hash(const uint8_t *p)
{
    return xxh3_64 ? xxh3_64(p, PAGE) : local_hash(p, PAGE);
}

typedef struct {
    uint64_t low64, high64;
} xxh128;
static struct {
    void *(*create)(void);
    int (*reset)(void *state);
    int (*update)(void *state, const void *p, size_t n);
    xxh128 (*digest)(const void *state);
} x128;

static void load_hash(void)
{
    void *lib = dlopen("libxxhash.so.0", RTLD_NOW | RTLD_LOCAL);
    if (!lib)
        return;
    xxh3_64 = (xxh64_fn)dlsym(lib, "XXH3_64bits");
    *(void **)&x128.create = dlsym(lib, "XXH3_createState");
    *(void **)&x128.reset = dlsym(lib, "XXH3_128bits_reset");
    *(void **)&x128.update = dlsym(lib, "XXH3_128bits_update");
    *(void **)&x128.digest = dlsym(lib, "XXH3_128bits_digest");
}

/* ---- files and runs ---- */

struct file {
    const uint8_t *map;
    uint64_t size;
};

struct run {
    uint32_t file;
    uint64_t offset, npages;
};

struct vec {
    void *p;
    size_t n, cap, elem;
};

static void *vec_push(struct vec *v)
{
    if (v->n == v->cap) {
        v->cap = v->cap ? v->cap * 2 : 64;
        v->p = realloc(v->p, v->cap * v->elem);
        if (!v->p)
            die("%s", "out of memory");
    }
    return (char *)v->p + v->n++ * v->elem;
}

static struct file open_file(const char *path)
{
    struct file f = {NULL, 0};
    int fd = open(path, O_RDONLY | O_CLOEXEC | O_NOFOLLOW);
    struct stat st;
    if (fd < 0 || fstat(fd, &st) < 0)
        die("cannot open %s", path);
    f.size = (uint64_t)st.st_size;
    if (f.size) {
        void *m = mmap(NULL, f.size, PROT_READ, MAP_SHARED, fd, 0);
        if (m == MAP_FAILED)
            die("cannot map %s", path);
        f.map = m;
    }
    close(fd);
    return f;
}

/* ---- the peer's table: hash -> (peer run, offset) ---- */

struct slot {
    uint64_t hash;
    uint64_t offset;
    uint32_t run; /* peer run + 1; 0: empty */
    uint32_t pad;
};

static struct slot *table;
static uint64_t table_mask;

static void table_init(uint64_t entries)
{
    uint64_t n = 1024;
    while (n < entries * 2)
        n <<= 1;
    table = calloc(n, sizeof(*table));
    if (!table)
        die("%s", "out of memory");
    table_mask = n - 1;
}

static void table_add(uint64_t h, uint32_t run, uint64_t offset)
{
    for (uint64_t i = h & table_mask;; i = (i + 1) & table_mask) {
        if (!table[i].run) {
            table[i] = (struct slot){h, offset, run + 1, 0};
            return;
        }
        if (table[i].hash == h && table[i].run)
            return; /* the first page with this hash serves */
    }
}

static const struct slot *table_find(uint64_t h)
{
    for (uint64_t i = h & table_mask; table[i].run; i = (i + 1) & table_mask)
        if (table[i].hash == h)
            return &table[i];
    return NULL;
}

/* ---- input ---- */

static struct vec files = {NULL, 0, 0, sizeof(struct file)};
static struct vec peer_runs = {NULL, 0, 0, sizeof(struct run)};
static struct vec own_runs = {NULL, 0, 0, sizeof(struct run)};

static void read_spec(FILE *in)
{
    char *line = NULL;
    size_t cap = 0;
    ssize_t len;
    int have_own = 0, have_file = 0;
    while ((len = getline(&line, &cap, in)) > 0) {
        if (line[len - 1] == '\n')
            line[--len] = 0;
        if (!strncmp(line, "peer ", 5) || !strncmp(line, "own ", 4)) {
            int own = line[0] == 'o';
            if (have_own)
                die("%s", "the own file must come last, once");
            have_own = own;
            have_file = 1;
            *(struct file *)vec_push(&files) = open_file(line + (own ? 4 : 5));
        } else if (!strncmp(line, "run ", 4)) {
            char *end;
            errno = 0;
            unsigned long long off = strtoull(line + 4, &end, 10);
            unsigned long long np = strtoull(end, &end, 10);
            if (errno || *end || !have_file)
                die("bad run line: %s", line);
            const struct file *f = (struct file *)files.p + files.n - 1;
            if (off % PAGE)
                die("a run is not page aligned: %s", line);
            if (np > f->size / PAGE || off > f->size - np * PAGE)
                die("a run lies past the end of its file (truncated?): %s", line);
            if (!np)
                continue;
            struct run *r = vec_push(have_own ? &own_runs : &peer_runs);
            *r = (struct run){(uint32_t)(files.n - 1), off, np};
        } else if (len) {
            die("bad line: %s", line);
        }
    }
    free(line);
    if (ferror(in))
        die("%s", "cannot read the spec");
    if (!have_own)
        die("%s", "no own file");
}

/* ---- matching ---- */

static uint64_t n_hashed, n_matched;
static struct vec matched = {NULL, 0, 0, sizeof(uint64_t[2])}; /* (own offset, bytes) */

static void emit(uint64_t own_off, uint32_t peer, uint64_t peer_off, uint64_t npages)
{
    if (!npages)
        return;
    uint64_t *m = vec_push(&matched);
    m[0] = own_off, m[1] = npages * PAGE;
    printf("match %llu %u %llu %llu\n", (unsigned long long)own_off, peer, (unsigned long long)peer_off,
           (unsigned long long)npages);
    n_matched += npages;
}

static void match_run(const struct file *own, const struct run *r)
{
    const struct run *peers = peer_runs.p;
    const struct file *fs = files.p;
    uint64_t free_from = 0; /* pages of this run before it are in a match already */
    uint64_t i = 0;
    while (i < r->npages) {
        const uint8_t *page = own->map + r->offset + i * PAGE;
        n_hashed++;
        const struct slot *s = table_find(page_hash(page));
        if (!s) {
            i++;
            continue;
        }
        const struct run *pr = &peers[s->run - 1];
        const uint8_t *pm = fs[pr->file].map;
        if (memcmp(page, pm + s->offset, PAGE)) {
            i++;
            continue;
        }
        /* backwards over the pages passed, within both runs */
        uint64_t back = 0;
        while (i - back > free_from && s->offset - back * PAGE > pr->offset &&
               !memcmp(own->map + r->offset + (i - back - 1) * PAGE, pm + s->offset - (back + 1) * PAGE, PAGE))
            back++;
        /* forwards, page by page */
        uint64_t fwd = 1, peer_end = pr->offset + pr->npages * PAGE;
        while (i + fwd < r->npages && s->offset + fwd * PAGE < peer_end &&
               !memcmp(own->map + r->offset + (i + fwd) * PAGE, pm + s->offset + fwd * PAGE, PAGE))
            fwd++;
        emit(r->offset + (i - back) * PAGE, pr->file, s->offset - back * PAGE, back + fwd);
        i += fwd;
        free_from = i;
    }
}

static int by_offset(const void *a, const void *b)
{
    uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;
    return x < y ? -1 : x > y;
}

/* "digest HEX SIZE": the own file with its matches read as zeros */
static void digest(const struct file *own)
{
    static const uint8_t zeros[1 << 16];
    void *st = x128.create && x128.reset && x128.update && x128.digest ? x128.create() : NULL;
    if (!st || x128.reset(st))
        return; /* no digest: the caller hashes the file */
    qsort(matched.p, matched.n, sizeof(uint64_t[2]), by_offset);
    const uint64_t(*m)[2] = matched.p;
    uint64_t at = 0;
    int bad = 0;
    for (size_t k = 0; k <= matched.n; k++) {
        uint64_t hole = k < matched.n ? m[k][0] : own->size, len = k < matched.n ? m[k][1] : 0;
        if (hole < at)
            die("%s", "overlapping matches"); /* cannot happen: each own page is looked at once */
        if (hole > at)
            bad |= x128.update(st, own->map + at, hole - at);
        for (uint64_t z = 0; z < len; z += sizeof(zeros))
            bad |= x128.update(st, zeros, len - z < sizeof(zeros) ? len - z : sizeof(zeros));
        at = hole + len;
    }
    if (bad)
        return;
    xxh128 h = x128.digest(st);
    printf("digest %016llx%016llx %llu\n", (unsigned long long)h.high64, (unsigned long long)h.low64,
           (unsigned long long)own->size);
}

int main(int argc, char **argv)
{
    uint64_t stride = 1;
    int want_digest = 0;
    for (int a = 1; a < argc; a++) {
        if (!strcmp(argv[a], "--digest")) {
            want_digest = 1;
        } else if (!strcmp(argv[a], "--stride") && a + 1 < argc) {
            char *end;
            stride = strtoull(argv[++a], &end, 10);
            if (*end || !stride)
                die("bad stride: %s", argv[a]);
        } else {
            die("%s", "usage: ckptd-dedup [--stride N] [--digest] < SPEC");
        }
    }
    load_hash();
    read_spec(stdin);
    const struct file *fs = files.p;
    const struct run *pr = peer_runs.p;
    uint64_t entries = 0;
    for (size_t k = 0; k < peer_runs.n; k++)
        entries += pr[k].npages / stride + 1;
    table_init(entries);
    uint64_t indexed = 0;
    for (size_t k = 0; k < peer_runs.n; k++) {
        const struct file *f = &fs[pr[k].file];
        uint64_t first = (pr[k].offset / PAGE + stride - 1) / stride * stride * PAGE;
        for (uint64_t off = first; off < pr[k].offset + pr[k].npages * PAGE; off += stride * PAGE) {
            table_add(page_hash(f->map + off), (uint32_t)k, off);
            indexed++;
        }
    }
    const struct file *own = &fs[files.n - 1];
    const struct run *or = own_runs.p;
    for (size_t k = 0; k < own_runs.n; k++)
        match_run(own, &or[k]);
    if (want_digest)
        digest(own);
    printf("done %llu %llu %llu\n", (unsigned long long)indexed, (unsigned long long)n_hashed,
           (unsigned long long)n_matched);
    if (fflush(stdout) || ferror(stdout))
        die("%s", "cannot write the matches");
    return 0;
}
