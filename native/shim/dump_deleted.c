/*
 * Deleted files and directories (CK_FD_DELETED): an open file or directory
 * whose name was removed, on any file system but tmpfs (a deleted tmpfs
 * file is shared memory, CK_FD_SHMEM).  A file's contents go to
 * files/deleted-<ino>.data (holes kept); a removed directory is empty.  The
 * restore plan makes each one again once, at its old path or beside it,
 * opens it and removes its name again (native/restorer/plan_deleted.c);
 * every descriptor of it reopens that object with its own flags and offset,
 * and every shared mapping of it maps it again (ck_dump_deleted_mapping).
 */
#include "shim.h"
#include "../common/sys.h"
#include "../common/util.h"
#include "../common/maps.h"

int ck_dump_deleted(struct ck_image *im, struct ck_fd *f, const char *target, const struct stat *st)
{
    int dir = (st->st_mode & S_IFMT) == S_IFDIR;
    if (target[0] != '/')
        return ck_fail_fd(im, f->fd, dir ? "removed directory without a path" : "deleted file without a path", target);
    if (st->st_nlink > 0 && !dir) {
        /* its inode is still reachable by another name: a copy of it would
         * no longer see, nor be seen by, writes through that name */
        return ck_fail_fd(im, f->fd,
                          "deleted name of a file that has other hard links: ckptd would restore a copy, "
                          "not the file they share",
                          target);
    }
    f->type = CK_FD_DELETED;
    f->uid = st->st_uid;
    f->gid = st->st_gid;
    if (dir)
        return 0;
    f->pos = (uint64_t)ck_lseek(f->fd, 0, SEEK_CUR);
    return ck_save_fd_contents(im, f, "files/deleted-");
}

/*
 * MAP_SHARED of a deleted file (on tmpfs it is shared memory, CK_VMA_SHMEM:
 * dump_mem.c): CK_VMA_SHARED|CK_VMA_DELETED, mapped again from the one file
 * the restore plan makes again, so that the processes that shared it share
 * it again.  No pages are saved: its contents live in the file, saved once
 * per image, from a descriptor of it if this process holds one (descriptors
 * are dumped first, ck_dump_deleted above), else through the mapping's
 * /proc/self/map_files link (root, or CAP_CHECKPOINT_RESTORE).
 */
int ck_dump_deleted_mapping(struct ck_image *im, struct ck_vma *v, const struct ck_map_entry *e)
{
    v->flags |= CK_VMA_DELETED;  /* v->path is set */
    for (uint64_t i = 0; i < im->fds.count; i++) {
        const struct ck_fd *f = ck_table_at(&im->fds, i);
        if (f->type != CK_FD_DELETED || f->ino != e->ino ||
            ck_strcmp((const char *)ck_table_at(&im->strings, f->path), e->path) != 0)
            continue;
        v->dev = f->dev;
        v->ino = f->ino;
        v->file_size = f->size;
        v->file_mode = f->mode;
        v->file_uid = f->uid;
        v->file_gid = f->gid;
        return 0;  /* saved with the descriptor */
    }
    char link[64];
    struct ck_buf b;
    ck_buf_init(&b, link, sizeof(link));
    ck_buf_str(&b, "/proc/self/map_files/");
    ck_buf_hex(&b, e->start);
    ck_buf_str(&b, "-");
    ck_buf_hex(&b, e->end);
    long fd = ck_open(link, O_RDONLY | O_CLOEXEC, 0);
    if (fd < 0)
        return ck_image_fail(im,
                             "cannot read a deleted file the job maps shared and holds no descriptor of "
                             "(/proc/self/map_files needs root or CAP_CHECKPOINT_RESTORE)",
                             e->path, fd);
    struct stat st;
    long rc = ck_fstat((int)fd, &st);
    ck_close((int)fd);
    if (rc < 0)
        return ck_image_fail(im, "cannot stat a deleted file the job maps shared", e->path, rc);
    if (st.st_nlink > 0)  /* as for a descriptor, above */
        return ck_image_fail(im,
                             "a shared mapping of a deleted name of a file that has other hard links: ckptd "
                             "would restore a copy, not the file they share",
                             e->path, 0);
    v->dev = st.st_dev;
    v->ino = st.st_ino;
    v->file_size = (uint64_t)st.st_size;
    v->file_mode = st.st_mode;
    v->file_uid = st.st_uid;
    v->file_gid = st.st_gid;
    return ck_save_contents(im, link, st.st_ino, (uint64_t)st.st_size, "files/deleted-");
}
