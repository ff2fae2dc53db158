/*
 * Arming dirty tracking: an asynchronous userfaultfd (UFFD_FEATURE_WP_ASYNC,
 * Linux 6.7+) registered on a process's private anonymous mappings, and
 * their present pages write-protected.  From then on the kernel lifts a
 * page's protection itself on its first write (no handler thread) and
 * PAGEMAP_SCAN reports the page as written.  A page that was never
 * protected reads as written too, so a failure anywhere here only makes
 * the next image copy more, never refer to a page that changed.
 *
 * Two places arm, with the same rules (ck_vma_trackable):
 *   - the shim after each dump, every thread still parked (shim/track.c);
 *   - the restorer, right after it has put a process's memory back and
 *     before anything else writes to it (restorer/track.c): the shim then
 *     takes the restored image's page runs (ADOPT, shim/track.c), and the
 *     first checkpoint after a restart refers to the pages of the one it
 *     came from, as any incremental checkpoint does.
 * Spelled out here because the build machine's kernel headers may predate
 * UFFD_FEATURE_WP_ASYNC.
 */
#ifndef CKPTD_COMMON_TRACK_ARM_H
#define CKPTD_COMMON_TRACK_ARM_H

#include "pagemap.h"
#include "sys.h"
#include "../include/ckptd/image_format.h"

#include <fcntl.h>
#include <stdint.h>

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

/* where the tracking descriptor goes: clear of the job's own numbering (the
 * shim's image files sit above it, from 960: shim/image_dir.c) */
#define CK_TRACK_HIGH_FD 950

/* A mapping whose pages are tracked: private anonymous memory with content
 * of its own in the image (not shared, not the shim's scratch, not a
 * deleted file's, not the vdso). */
static inline int ck_vma_trackable(uint32_t flags)
{
    return (flags & CK_VMA_ANON) && !(flags & (CK_VMA_SHARED | CK_VMA_SHMEM | CK_VMA_NOCONTENT | CK_VMA_DELETED |
                                               CK_VMA_VDSO | CK_VMA_VVAR));
}

/* A new asynchronous write-protect userfaultfd, moved to at least
 * CK_TRACK_HIGH_FD (or to at least `above`, if higher); or -errno. */
static inline long ck_track_uffd_open(int above)
{
    long fd = ck_sc1(SYS_userfaultfd, O_CLOEXEC | O_NONBLOCK);
    if (fd < 0)  /* vm.unprivileged_userfaultfd=0 and no CAP_SYS_PTRACE */
        fd = ck_sc1(SYS_userfaultfd, O_CLOEXEC | O_NONBLOCK | CK_UFFD_USER_MODE_ONLY);
    if (fd < 0)
        return fd;
    struct ck_uffdio_api api = {CK_UFFD_API, CK_UFFD_FEATURE_WP_ASYNC, 0};
    long rc = ck_ioctl((int)fd, CK_UFFDIO_API, &api);
    if (rc < 0) {
        ck_close((int)fd);
        return rc;
    }
    long high = ck_fcntl((int)fd, F_DUPFD_CLOEXEC, above > CK_TRACK_HIGH_FD ? above : CK_TRACK_HIGH_FD);
    if (high >= 0) {
        ck_close((int)fd);
        fd = high;
    }
    return fd;
}

/* Register [start, end) for write protection and protect the pages it has:
 * 0 once every present page is protected.  Only the present pages (a walk
 * with PM_SCAN_WP_MATCHING): UFFDIO_WRITEPROTECT on the whole range would
 * leave uffd-wp markers in its holes, which PAGEMAP_SCAN then reports as
 * swapped pages, and a hole written later is reported written anyway.
 * vec: scratch for the walk's reports. */
static inline long ck_track_arm_range(int uffd, int pagemap_fd, uint64_t start, uint64_t end,
                                      struct ck_page_region *vec, uint64_t vec_len)
{
    struct ck_uffdio_register reg = {{start, end - start}, CK_UFFDIO_REGISTER_MODE_WP, 0};
    long rc = ck_ioctl(uffd, CK_UFFDIO_REGISTER, &reg);
    if (rc < 0)
        return rc;  /* not anonymous memory, or another userfaultfd's (a lazy restore's) */
    struct ck_pm_scan_arg a;
    ck_pm_scan_present(&a, start, end, vec, vec_len, CK_PAGE_IS_PRESENT | CK_PAGE_IS_SWAPPED);
    a.flags = CK_PM_SCAN_WP_MATCHING | CK_PM_SCAN_CHECK_WPASYNC;
    for (;;) {
        rc = ck_ioctl(pagemap_fd, CK_PAGEMAP_SCAN, &a);
        if (rc < 0)
            return rc;  /* what it did not protect reads as written: copied */
        if (a.walk_end >= end)
            return 0;
        a.start = a.walk_end;
    }
}

#endif
