/*
 * Deleted files and directories (CK_FD_DELETED): an open file or directory
 * whose name was removed, on any file system but tmpfs (a deleted tmpfs
 * file is shared memory, CK_FD_SHMEM).  A file's contents go to
 * files/deleted-<ino>.data (holes kept); a removed directory is empty.  The
 * restore plan makes each one again once, at its old path or beside it,
 * opens it and removes its name again (native/restorer/plan_deleted.c);
 * every descriptor of it reopens that object with its own flags and offset.
 */
#include "shim.h"
#include "../common/sys.h"
#include "../common/util.h"

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
