/*
 * Files the job writes roll back with it.
 *
 * The open() family is interposed (interpose.c) to remember every regular
 * file the process opens for writing, even after it is closed again: an
 * appended log that is opened, written and closed at every step must not
 * hold duplicated lines after a restart.  At checkpoint time each such file
 * still present, plus every descriptor open for writing, has its contents
 * copied into the image (files/<index>.data); the agent writes them back
 * before a restore.
 *
 * The table is append-only and lock-free: a parked thread may have been
 * interrupted in the middle of an insert, and the checkpoint thread must
 * still be able to read it.
 */
#include "shim.h"
#include "../common/sys.h"
#include "../common/util.h"

#include <errno.h>

#define TRACK_MAX 4096
#define PATH_POOL (8u << 20)

struct tracked {
    uint32_t ready;        /* set last, with release order */
    uint32_t path_off;
    uint64_t dev;
    uint64_t ino;
};

static struct tracked tracked[TRACK_MAX];
static uint32_t ntracked;
static char *path_pool;
static uint32_t path_pool_used;
static uint32_t track_overflow;

static int skip_path(const char *p)
{
    if (ck_startswith(p, "/dev/shm/"))
        return 0;  /* POSIX shared memory and semaphores are the job's data */
    return ck_startswith(p, "/proc/") || ck_startswith(p, "/sys/") || ck_startswith(p, "/dev/");
}

void ck_files_track_fd(int fd)
{
    if (!ck_shim.active)
        return;
    struct stat st;
    if (ck_fstat(fd, &st) < 0 || !S_ISREG(st.st_mode))
        return;
    uint32_t n = __atomic_load_n(&ntracked, __ATOMIC_ACQUIRE);
    for (uint32_t i = 0; i < n && i < TRACK_MAX; i++)
        if (tracked[i].ready && tracked[i].dev == st.st_dev && tracked[i].ino == st.st_ino)
            return;  /* already known */

    char link[64], path[4096];
    struct ck_buf b;
    ck_buf_init(&b, link, sizeof(link));
    ck_buf_str(&b, "/proc/self/fd/");
    ck_buf_u64(&b, (uint64_t)fd);
    long len = ck_readlink(link, path, sizeof(path) - 1);
    if (len <= 0 || path[0] != '/')
        return;
    path[len] = 0;
    if (skip_path(path))
        return;
    for (uint32_t i = 0; i < n && i < TRACK_MAX; i++)
        if (tracked[i].ready && ck_strcmp(path_pool + tracked[i].path_off, path) == 0)
            return;  /* same path, new file (write-then-rename patterns) */

    if (!__atomic_load_n(&path_pool, __ATOMIC_ACQUIRE)) {
        void *p = ck_mmap(0, PATH_POOL, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
        if (ck_mmap_failed(p))
            return;
        char *expected = 0;
        if (!__atomic_compare_exchange_n(&path_pool, &expected, (char *)p, 0, __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE))
            ck_munmap(p, PATH_POOL);
    }
    uint32_t off = __atomic_fetch_add(&path_pool_used, (uint32_t)len + 1, __ATOMIC_ACQ_REL);
    uint32_t idx = __atomic_fetch_add(&ntracked, 1, __ATOMIC_ACQ_REL);
    if (idx >= TRACK_MAX || off + (uint32_t)len + 1 > PATH_POOL) {
        __atomic_store_n(&track_overflow, 1, __ATOMIC_RELEASE);
        return;
    }
    ck_memcpy(path_pool + off, path, (size_t)len + 1);
    tracked[idx].path_off = off;
    tracked[idx].dev = st.st_dev;
    tracked[idx].ino = st.st_ino;
    __atomic_store_n(&tracked[idx].ready, 1, __ATOMIC_RELEASE);
}

static int already_saved(struct ck_image *im, uint64_t dev, uint64_t ino)
{
    for (size_t i = 0; i < im->files.count; i++) {
        struct ck_file *f = ck_table_at(&im->files, i);
        if (f->dev == dev && f->ino == ino)
            return 1;
    }
    return 0;
}

int ck_save_written_file(struct ck_image *im, const char *path, uint64_t *bytes)
{
    struct stat st;
    if (skip_path(path) || ck_stat(path, &st) < 0 || !S_ISREG(st.st_mode))
        return 0;  /* gone or not a regular file: nothing to roll back */
    if (already_saved(im, st.st_dev, st.st_ino))
        return 0;
    struct ck_file *f = ck_table_push(&im->files);
    if (!f)
        return ck_image_fail(im, "too many written files", 0, 0);
    f->index = (uint32_t)(im->files.count - 1);
    f->path = ck_image_string(im, path);
    f->mode = st.st_mode;
    f->dev = st.st_dev;
    f->ino = st.st_ino;
    f->size = (uint64_t)st.st_size;
    f->mtime_ns = (int64_t)st.st_mtim.tv_sec * 1000000000LL + st.st_mtim.tv_nsec;

    char name[64];
    struct ck_buf b;
    ck_buf_init(&b, name, sizeof(name));
    ck_buf_str(&b, "files/");
    ck_buf_u64(&b, f->index);
    ck_buf_str(&b, ".data");
    long in = ck_open(path, O_RDONLY | O_CLOEXEC, 0);
    if (in < 0)
        return ck_image_fail(im, "cannot read a file the job writes", path, in);
    long out = ck_openat(im->dirfd, name, (im->key ? O_RDWR : O_WRONLY) | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
    if (out < 0) {
        ck_close((int)in);
        return ck_image_fail(im, "cannot save a file the job writes", path, out);
    }
    if (im->key) {  /* launch --encrypt: sealed through a buffer, files/N.data.gcm beside it */
        int rc = ck_seal_copy_file(im, (int)in, (int)out, name);
        ck_close((int)in);
        ck_close((int)out);
        if (rc < 0)
            return ck_image_fail(im, "cannot copy a file the job writes", path, rc);
        f->flags |= CK_FILE_CONTENT_SAVED;
        *bytes += f->size;
        return 0;
    }
    /* copy_file_range shares blocks or copies in the kernel, but only
     * within one filesystem (EXDEV otherwise): then sendfile */
    uint64_t left = f->size;
    long rc = 0;
    int same_fs = 1;
    while (left) {
        size_t chunk = left > (1ull << 30) ? (1ull << 30) : left;
        rc = same_fs ? ck_copy_file_range((int)in, (int)out, chunk) : ck_sendfile((int)out, (int)in, chunk);
        if (rc == -EINTR)
            continue;
        if (same_fs && (rc == -EXDEV || rc == -EINVAL || rc == -EOPNOTSUPP || rc == -ENOSYS) && left == f->size) {
            same_fs = 0;
            continue;
        }
        if (rc <= 0)
            break;
        left -= (uint64_t)rc;
    }
    ck_close((int)in);
    ck_close((int)out);
    if (left)
        return ck_image_fail(im, "cannot copy a file the job writes", path, rc < 0 ? rc : -EIO);
    f->flags |= CK_FILE_CONTENT_SAVED;
    *bytes += f->size;
    return 0;
}

int ck_dump_files(struct ck_image *im, uint64_t *bytes)
{
    long rc = ck_sc3(SYS_mkdirat, im->dirfd, "files", 0700);
    if (rc < 0 && rc != -EEXIST)
        return ck_image_fail(im, "cannot create files/ in the image directory", 0, rc);
    if (__atomic_load_n(&track_overflow, __ATOMIC_ACQUIRE))
        return ck_image_fail(im, "the job wrote more files than ckptd can track (4096)", 0, 0);
    /* descriptors open for writing */
    for (size_t i = 0; i < im->fds.count; i++) {
        struct ck_fd *f = ck_table_at(&im->fds, i);
        if (f->type == CK_FD_REG && (f->flags & CK_FDF_WRITTEN))
            if (ck_save_written_file(im, (const char *)ck_table_at(&im->strings, f->path), bytes) < 0)
                return -1;
    }
    /* files written earlier and closed since */
    uint32_t n = __atomic_load_n(&ntracked, __ATOMIC_ACQUIRE);
    for (uint32_t i = 0; i < n && i < TRACK_MAX; i++) {
        if (!__atomic_load_n(&tracked[i].ready, __ATOMIC_ACQUIRE))
            continue;
        if (ck_save_written_file(im, path_pool + tracked[i].path_off, bytes) < 0)
            return -1;
    }
    return 0;
}

int ck_save_shmem_fd(struct ck_image *im, struct ck_fd *f)
{
    return ck_save_fd_contents(im, f, "files/shm-");
}

int ck_save_fd_contents(struct ck_image *im, struct ck_fd *f, const char *prefix)
{
    /* a new open file description, so the job's file offset stays put */
    char link[64];
    struct ck_buf b;
    ck_buf_init(&b, link, sizeof(link));
    ck_buf_str(&b, "/proc/self/fd/");
    ck_buf_u64(&b, (uint64_t)f->fd);
    return ck_save_contents(im, link, f->ino, f->size, prefix);
}

int ck_save_contents(struct ck_image *im, const char *link, uint64_t ino, uint64_t size, const char *prefix)
{
    char name[64];
    struct ck_buf b;
    long rc = ck_sc3(SYS_mkdirat, im->dirfd, "files", 0700);
    if (rc < 0 && rc != -EEXIST)
        return ck_image_fail(im, "cannot create files/ in the image directory", 0, rc);
    ck_buf_init(&b, name, sizeof(name));
    ck_buf_str(&b, prefix);
    ck_buf_u64(&b, ino);
    ck_buf_str(&b, ".data");
    long out = ck_openat(im->dirfd, name, O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0600);
    if (out == -EEXIST)
        return 0;  /* another descriptor or mapping of this process saved it */
    if (out < 0)
        return ck_image_fail(im, "cannot save shared memory the job holds", name, out);
    long in = ck_open(link, O_RDONLY | O_CLOEXEC, 0);
    if (in < 0) {
        ck_close((int)out);
        return ck_image_fail(im, "cannot reopen shared memory the job holds", link, in);
    }
    rc = ck_copy_sparse((int)in, (int)out, size);
    if (rc == 0)
        rc = ck_ftruncate((int)out, (int64_t)size);  /* the hole at the end too */
    ck_close((int)in);
    ck_close((int)out);
    if (rc < 0)
        return ck_image_fail(im, "cannot copy shared memory the job holds", name, rc);
    return 0;
}
