/*
 * The scratch arena: one reserved (MAP_NORESERVE) region from which the
 * checkpoint thread carves its tables.  It is recorded in the image as an
 * empty mapping (CK_VMA_NOCONTENT), so the bookkeeping of a dump never ends
 * up inside the dump, and only the pages actually touched cost memory.
 * Its top parts are not reset between dumps: the previous image's page runs
 * (track.c), smaps read before parking (dump_mem.c), and the staging area
 * where a small incremental image's pages wait between DUMP and FLUSH
 * (writeout.c), kept resident so that copying into it costs no page faults.
 */
#include "shim.h"
#include "../common/sys.h"
#include "../common/util.h"

#include <errno.h>

#define ARENA_SIZE (1344ull << 20)
#define KEEP_SIZE (256ull << 20)   /* what lives from one dump to the next (track.c) */
#define PREMAPS_SIZE (64ull << 20) /* smaps read before parking (dump_mem.c) */
#define STAGE_SIZE (256ull << 20)  /* the top: staged pages (writeout.c) */
#define SCRATCH_END (ARENA_SIZE - KEEP_SIZE - PREMAPS_SIZE - STAGE_SIZE)

static char *arena_base;
static size_t arena_used;

int ck_arena_setup(void)
{
    if (arena_base)
        return 0;
    void *p = ck_mmap(0, ARENA_SIZE, PROT_READ | PROT_WRITE,
                      MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (ck_mmap_failed(p))
        return (int)(long)p;
    /* flags no neighbour of the job's has: the kernel never merges the
     * arena with an adjacent mapping, so it stays recognisable; a child
     * starts with an empty one, which is all it needs */
    long rc = ck_madvise(p, ARENA_SIZE, MADV_WIPEONFORK);
    if (rc == 0)
        rc = ck_madvise(p, ARENA_SIZE, MADV_DONTDUMP);
    if (rc < 0) {
        ck_munmap(p, ARENA_SIZE);
        return (int)rc;
    }
    arena_base = p;
    arena_used = 0;
    return 0;
}

/* The page writer needs the scratch tables and the kept part (track.c);
 * not the early maps copy, read before this dump and spent by it, nor
 * the staging area, which no dump with a writer uses.  Both stay wiped
 * in the writer: their resident pages (megabytes: the staging area is
 * faulted in ahead) cost the fork no page table copies. */
int ck_arena_inherit(int on)
{
    if (!arena_base)
        return -EINVAL;
    return (int)ck_madvise(arena_base, SCRATCH_END + KEEP_SIZE, on ? MADV_KEEPONFORK : MADV_WIPEONFORK);
}

void ck_arena_reset(void)
{
    if (arena_base && arena_used)
        ck_madvise(arena_base, (arena_used + 4095) & ~4095ull, MADV_DONTNEED);
    arena_used = 0;
}

int ck_arena_contains(uint64_t start, uint64_t end)
{
    uint64_t b = (uint64_t)arena_base;
    return arena_base && start >= b && end <= b + ARENA_SIZE;
}

void *ck_arena_alloc(size_t n)
{
    n = (n + 4095) & ~(size_t)4095;
    if (!arena_base || arena_used + n > SCRATCH_END)
        return 0;
    void *p = arena_base + arena_used;
    arena_used += n;
    return p;
}

void *ck_arena_keep(size_t *size)
{
    *size = KEEP_SIZE;
    return arena_base ? arena_base + SCRATCH_END : 0;
}

void *ck_arena_premaps(size_t *size)
{
    *size = PREMAPS_SIZE;
    return arena_base ? arena_base + SCRATCH_END + KEEP_SIZE : 0;
}

void *ck_arena_stage(size_t *size)
{
    *size = STAGE_SIZE;
    return arena_base ? arena_base + ARENA_SIZE - STAGE_SIZE : 0;
}

int ck_table_init(struct ck_table *t, size_t elem, size_t cap)
{
    t->base = ck_arena_alloc(elem * cap);
    t->elem = elem;
    t->count = 0;
    t->cap = t->base ? cap : 0;
    return t->base ? 0 : -1;
}

void *ck_table_push(struct ck_table *t)
{
    if (t->count >= t->cap)
        return 0;
    void *p = t->base + t->count * t->elem;
    ck_memset(p, 0, t->elem);
    t->count++;
    return p;
}

void *ck_table_at(struct ck_table *t, size_t i) { return t->base + i * t->elem; }

/* append bytes to a byte table; returns the offset or UINT64_MAX if full */
uint64_t ck_table_bytes_append(struct ck_table *t, const void *p, size_t n)
{
    if (t->count + n > t->cap)
        return UINT64_MAX;
    uint64_t off = t->count;
    ck_memcpy(t->base + t->count, p, n);
    t->count += n;
    return off;
}
