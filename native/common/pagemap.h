/*
 * The PAGEMAP_SCAN ioctl on /proc/self/pagemap (Linux 6.7+), spelled out
 * here because the build machine's kernel headers may predate it.  Used to
 * find the pages worth saving (dump_mem.c) and, with PM_SCAN_WP_MATCHING,
 * to write-protect them for dirty tracking (common/track_arm.h: the shim's
 * track.c after a dump, the restorer's track.c after a restore).
 */
#ifndef CKPTD_COMMON_PAGEMAP_H
#define CKPTD_COMMON_PAGEMAP_H

#include <stdint.h>
#include <sys/ioctl.h>

struct ck_pm_scan_arg {
    uint64_t size, flags, start, end, walk_end, vec, vec_len, max_pages;
    uint64_t category_inverted, category_mask, category_anyof_mask, return_mask;
};
struct ck_page_region {
    uint64_t start, end, categories;
};
#define CK_PAGEMAP_SCAN _IOWR('f', 16, struct ck_pm_scan_arg)

#define CK_PM_SCAN_WP_MATCHING (1ull << 0)  /* write-protect the pages reported */
#define CK_PM_SCAN_CHECK_WPASYNC (1ull << 1) /* fail unless registered for async write-protect */

#define CK_PAGE_IS_WRITTEN (1ull << 1)
#define CK_PAGE_IS_FILE (1ull << 2)
#define CK_PAGE_IS_PRESENT (1ull << 3)
#define CK_PAGE_IS_SWAPPED (1ull << 4)
#define CK_PAGE_IS_PFNZERO (1ull << 5)

/* A walk over [start, end) reporting, into vec, the pages present or
 * swapped out other than the shared zero page, with the `report`
 * categories; the caller adds to it (more pages left out, flags). */
static inline void ck_pm_scan_present(struct ck_pm_scan_arg *a, uint64_t start, uint64_t end,
                                      struct ck_page_region *vec, uint64_t vec_len, uint64_t report)
{
    *a = (struct ck_pm_scan_arg){0};
    a->size = sizeof(*a);
    a->start = start;
    a->end = end;
    a->vec = (uint64_t)vec;
    a->vec_len = vec_len;
    a->category_inverted = CK_PAGE_IS_PFNZERO;
    a->category_mask = CK_PAGE_IS_PFNZERO;
    a->category_anyof_mask = CK_PAGE_IS_PRESENT | CK_PAGE_IS_SWAPPED;
    a->return_mask = report;
}

#endif
