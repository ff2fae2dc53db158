/*
 * Dirty tracking from the moment memory is back (common/track_arm.h).
 *
 * The first checkpoint after a restart used to be a full one: the shim's
 * table of the last image's pages, and its write protection, are not part
 * of any image.  Here the restorer protects the restored private anonymous
 * memory as soon as it is rebuilt, before the process's descriptors,
 * threads or shim run, so that any write from then on (the restorer's own
 * last steps included) is reported as written.  Memory unwritten at the
 * next dump is then exactly what this image's page runs hold, and the shim
 * can refer to them (ADOPT, shim/track.c): the job's first checkpoint after
 * a restart stores only what changed since the one it came from.
 *
 * Best effort: without a userfaultfd (an old kernel, vm.unprivileged_
 * userfaultfd=0), or with a mapping that refuses, the next image copies
 * what is not protected, as it always did.  A lazily filled mapping
 * (restart --lazy) belongs to the pager's userfaultfd and is left out.
 */
#include "restorer.h"
#include "../common/track_arm.h"

/* the descriptor, or -1: for the shim, in its restart record (threads.c) */
int rst_track_arm(const struct rst_image *im)
{
    long uffd = ck_track_uffd_open(rst.maxfd + 16);
    if (uffd < 0)
        return -1;
    if (uffd < rst.maxfd + 16) {  /* not moved above the image's descriptors: they would clash */
        ck_close((int)uffd);
        return -1;
    }
    long pagemap = ck_open("/proc/self/pagemap", O_RDONLY | O_CLOEXEC, 0);
    if (pagemap < 0) {
        ck_close((int)uffd);
        return -1;
    }
    static struct ck_page_region vec[256];
    for (uint32_t i = 0; i < im->nvmas; i++) {
        const struct ck_vma *v = &im->vmas[i];
        if (ck_vma_trackable(v->flags) && !(rst.lazy && rst_vma_lazy(im, v)))
            (void)ck_track_arm_range((int)uffd, (int)pagemap, v->start, v->end, vec, sizeof(vec) / sizeof(vec[0]));
    }
    ck_close((int)pagemap);
    return (int)uffd;
}
