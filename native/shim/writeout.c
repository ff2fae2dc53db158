/*
 * Writing an image's pages after the job runs again: copy-on-write capture.
 *
 * While every thread is parked, dump_mem.c decides which pages go into
 * pages.img and where (the page runs).  It writes at once only what a forked
 * copy of the process would not see as it is now: shared mappings (the job
 * changes them in place), MADV_DONTFORK and MADV_WIPEONFORK mappings, and
 * private mappings of deleted files.  Then the checkpoint thread forks a
 * writer, a copy of the process whose memory stays as it was at the fork
 * (the kernel copies a page the job writes before the writer has read it),
 * and the job resumes.  The writer fills pages.img.part, renames it to
 * pages.img and exits.
 *
 * The writer is a clone child with exit signal 0: the job's wait() never
 * sees it, and its exit sends no SIGCHLD.  It closes every descriptor but
 * the two it needs, so that it keeps none of the job's files open.  It holds
 * an flock on pages.img.part until it exits, so that the agent can wait for
 * it even after its parent is gone.  The checkpoint thread reaps it on FLUSH,
 * kills it on ABORT or DISCARD, and the shim's destructor waits for it when
 * the process exits, so that an exit right after a checkpoint still leaves
 * a finished image.
 *
 * CKPTD_CAPTURE=sync, or a fork the kernel refuses (memory), writes the same
 * pages during the pause instead; so does an incremental image small next
 * to the memory a fork would have to copy the page tables of.
 */
#include "shim.h"
#include "../common/sys.h"
#include "../common/util.h"

#include <errno.h>
#include <sys/file.h>
#include <sys/prctl.h>
#include <sys/wait.h>

#define BOUNCE_SIZE (1u << 20)

static volatile int writer_pid;      /* 0: none */
static char writer_dir[4096];        /* its image directory, for FLUSH's messages */
static char *bounce;

int ck_vma_written_later(const struct ck_vma *v)
{
    if (v->flags & (CK_VMA_SHARED | CK_VMA_DELETED | CK_VMA_NOCONTENT))
        return 0;
    return !(v->madv & (CK_MADV_DONTFORK | CK_MADV_WIPEONFORK));
}

int ck_pwritev_all(int fd, struct ck_iov *iov, int n, uint64_t off)
{
    int i = 0;
    while (i < n) {
        long w = ck_pwritev(fd, &iov[i], n - i, off);
        if (w == -EINTR)
            continue;
        if (w <= 0)
            return w < 0 ? (int)w : -EIO;
        off += (uint64_t)w;
        /* skip what went out; a partial iovec goes on from where it stopped */
        while (i < n && (size_t)w >= iov[i].len) {
            w -= (long)iov[i].len;
            i++;
        }
        if (i < n && w > 0) {
            iov[i].base = (const char *)iov[i].base + w;
            iov[i].len -= (size_t)w;
        }
    }
    return 0;
}

int ck_copy_unreadable(int fd, int mem_fd, char *buf, uint64_t vaddr, uint64_t len, uint64_t off)
{
    for (uint64_t done = 0; done < len;) {
        size_t n = len - done > BOUNCE_SIZE ? BOUNCE_SIZE : len - done;
        long r = ck_pread(mem_fd, buf, n, vaddr + done);
        if (r == -EINTR)
            continue;
        if (r <= 0)
            return r < 0 ? (int)r : -EIO;
        struct ck_iov one = {buf, (size_t)r};
        int rc = ck_pwritev_all(fd, &one, 1, off + done);
        if (rc < 0)
            return rc;
        done += (uint64_t)r;
    }
    return 0;
}

/* every run this image holds itself, of the mappings left for later */
static int write_later_runs(struct ck_image *im, int fd)
{
    static struct ck_iov iov[CK_IOV_BATCH];
    int n = 0, mem_fd = -1, rc = 0;
    uint64_t first = 0, len = 0;
    for (size_t vi = 0; vi < im->vmas.count && rc == 0; vi++) {
        const struct ck_vma *v = ck_table_at(&im->vmas, vi);
        if (!ck_vma_written_later(v))
            continue;
        for (uint64_t ri = v->first_run; ri < v->first_run + v->nruns && rc == 0; ri++) {
            const struct ck_page_run *r = ck_table_at(&im->runs, ri);
            uint64_t size = r->npages * CK_PAGE_SIZE;
            if (r->src)
                continue;  /* an earlier image's pages */
            if (n && (n == CK_IOV_BATCH || first + len != r->offset || !(v->prot & PROT_READ))) {
                rc = ck_pwritev_all(fd, iov, n, first);
                n = 0;
                len = 0;
            }
            if (rc)
                break;
            if (!(v->prot & PROT_READ)) {
                if (mem_fd < 0)
                    mem_fd = (int)ck_open("/proc/self/mem", O_RDONLY | O_CLOEXEC, 0);
                rc = mem_fd < 0 ? mem_fd : ck_copy_unreadable(fd, mem_fd, bounce, r->vaddr, size, r->offset);
                continue;
            }
            if (!n)
                first = r->offset;
            iov[n].base = (const void *)r->vaddr;
            iov[n].len = size;
            n++;
            len += size;
        }
    }
    if (rc == 0 && n)
        rc = ck_pwritev_all(fd, iov, n, first);
    if (mem_fd >= 0)
        ck_close(mem_fd);
    return rc;
}

__attribute__((noreturn)) static void writer_main(struct ck_image *im)
{
    ck_prctl(PR_SET_NAME, (unsigned long)"ckptd-writer", 0, 0, 0);
    /* keep only pages.img.part (as 0) and the image directory (as 1) */
    if (ck_dup3(im->pages_fd, 0, 0) < 0 || ck_dup3(im->dirfd, 1, 0) < 0)
        ck_exit_group(EBADF);
    ck_close_range(2, ~0u);
    int rc = write_later_runs(im, 0);
    if (rc == 0)
        rc = (int)ck_renameat(1, "pages.img.part", "pages.img");
    ck_exit_group(rc < 0 ? -rc : 0);
}

/* Forking costs the pause about 20 ms per GiB of memory mapped with 4 KiB
 * pages (the kernel copies each page table entry; huge pages are nearly
 * free), writing about 1 ms per MiB.  An incremental image of a big
 * process that changed little is written faster than it is forked. */
static int cheaper_to_write_now(struct ck_image *im)
{
    uint64_t mapped = 0, to_write = 0;
    for (size_t vi = 0; vi < im->vmas.count; vi++) {
        const struct ck_vma *v = ck_table_at(&im->vmas, vi);
        if (!ck_vma_written_later(v))
            continue;
        for (uint64_t ri = v->first_run; ri < v->first_run + v->nruns; ri++) {
            const struct ck_page_run *r = ck_table_at(&im->runs, ri);
            mapped += r->npages * CK_PAGE_SIZE;
            if (!r->src)
                to_write += r->npages * CK_PAGE_SIZE;
        }
    }
    return to_write * 50 < mapped;
}

int ck_writeout_start(struct ck_image *im, const char *dir)
{
    bounce = ck_arena_alloc(BOUNCE_SIZE);  /* the arena starts over after every dump */
    if (!bounce)
        return ck_image_fail(im, "cannot allocate checkpoint scratch memory", 0, 0);
    if (ck_shim.capture_sync == 0 && !cheaper_to_write_now(im)) {
        /* the writer needs the tables in the arena, which children
         * otherwise get wiped (arena.c) */
        long pid = -1;
        if (ck_arena_inherit(1) == 0) {
            pid = ck_clone_quiet();
            if (pid == 0)
                writer_main(im);
        }
        ck_arena_inherit(0);
        if (pid > 0) {
            ck_strlcpy(writer_dir, dir, sizeof(writer_dir));
            writer_pid = (int)pid;
            return 0;
        }
        /* no fork (memory, a process limit): write them now instead */
    }
    int rc = write_later_runs(im, im->pages_fd);
    if (rc < 0)
        return ck_image_fail(im, "cannot write pages.img", 0, rc);
    rc = (int)ck_renameat(im->dirfd, "pages.img.part", "pages.img");
    if (rc < 0)
        return ck_image_fail(im, "cannot rename pages.img.part", 0, rc);
    return 0;
}

static int reap(int pid, int *status)
{
    for (;;) {
        long r = ck_wait4(pid, status, __WCLONE);
        if (r != -EINTR)
            return (int)r;
    }
}

int ck_writeout_flush(char *err, size_t errcap)
{
    int pid = writer_pid;
    if (pid <= 0)
        return 1;  /* nothing being written */
    int status = 0;
    long r = reap(pid, &status);
    writer_pid = 0;
    struct ck_buf b;
    ck_buf_init(&b, err, errcap);
    if (r == pid) {
        if (WIFEXITED(status) && WEXITSTATUS(status) == 0)
            return 0;
        if (WIFEXITED(status))
            ck_buf_error(&b, "the writer of pages.img failed", writer_dir, -WEXITSTATUS(status));
        else
            ck_buf_error(&b, "the writer of pages.img was killed", writer_dir, 0);
        return -1;
    }
    /* reaped by the destructor meanwhile: the rename tells */
    int dfd = (int)ck_open(writer_dir, O_RDONLY | O_DIRECTORY | O_CLOEXEC, 0);
    int ok = dfd >= 0 && ck_faccessat(dfd, "pages.img") == 0;
    if (dfd >= 0)
        ck_close(dfd);
    if (ok)
        return 0;
    ck_buf_error(&b, "pages.img was not finished", writer_dir, 0);
    return -1;
}

void ck_writeout_discard(void)
{
    int pid = writer_pid;
    if (pid <= 0)
        return;
    int status;
    ck_kill(pid, SIGKILL);
    reap(pid, &status);
    writer_pid = 0;
}

/* a normal exit right after a checkpoint waits until the image is written */
__attribute__((destructor)) static void wait_for_writer(void)
{
    int pid = writer_pid, status;
    if (pid > 0)
        reap(pid, &status);
}
