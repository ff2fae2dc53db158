/*
 * Deleted files and directories in the restore plan (plan.c has the
 * format; the shim's side is native/shim/dump_deleted.c): each is made
 * once again at its old path, or at a new name beside it when that path is
 * taken now, filled from its saved contents, given its mode and owner,
 * opened at its slot and removed again, so that nothing but the job can
 * reach it; directories above it that are gone too are made for the
 * moment and removed again.  Every descriptor of it reopens the slot's object through
 * /proc/self/fd with its own flags and offset (fds.c, or a "fileshm" line
 * for a description several processes share).  A working directory that
 * was removed is made the same way by its process (proc.c).
 *   deleted SLOT DEV INO MODE UID GID SIZE PATH FILE   (FILE "-": a directory)
 */
#include "plan.h"

#include <errno.h>

#ifndef AT_REMOVEDIR
#define AT_REMOVEDIR 0x200
#endif

/* the object made at NAME (a file open read-write, or a directory), or -EEXIST */
static long make_at(const char *name, int dir)
{
    if (!dir)
        return ck_open(name, O_RDWR | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0600);
    long rc = ck_mkdir(name, 0700);
    if (rc < 0)
        return rc;
    return ck_open(name, O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC, 0);
}

/* The directories above PATH that are gone (removed with it: rm -rf of a
 * tree a process still works in), made again, empty; their number.  They
 * are removed again, deepest first, once the object is (below). */
static int make_parents(char *path)
{
    int made = 0;
    for (char *p = path + 1; *p; p++) {
        if (*p != '/')
            continue;
        *p = 0;
        long rc = ck_mkdir(path, 0700);
        *p = '/';
        if (rc == 0)
            made++;
        else if (rc != -EEXIST)
            return made;
    }
    return made;
}

static void remove_parents(char *path, int made)
{
    for (char *p = path + ck_strlen(path); made > 0 && p > path; p--) {
        if (*p != '/')
            continue;
        *p = 0;
        /* only those made here: stop at the first that will not go */
        if (ck_sc3(SYS_unlinkat, AT_FDCWD, path, AT_REMOVEDIR) < 0)
            return;
        made--;
    }
}

long rst_recreate_deleted(const char *path, uint32_t mode, uint32_t uid, uint32_t gid, long fill, uint64_t size)
{
    int dir = (mode & S_IFMT) == S_IFDIR, parents = 0;
    char name[1200];
    struct ck_buf b;
    ck_buf_init(&b, name, sizeof(name));
    ck_buf_str(&b, path);
    long fd = make_at(name, dir);
    if (fd == -ENOENT) {
        parents = make_parents(name);
        fd = make_at(name, dir);
    }
    /* its old path is taken now: a unique name in the same directory */
    for (uint64_t n = 1; fd == -EEXIST && n < 1000; n++) {
        ck_buf_init(&b, name, sizeof(name));
        ck_buf_str(&b, path);
        ck_buf_str(&b, ".ckptd-deleted-");
        ck_buf_u64(&b, n);
        fd = make_at(name, dir);
    }
    if (fd < 0)
        rst_fail(dir ? "cannot make a removed directory again" : "cannot make a deleted file again",
                 path, fd);
    long rc = 0;
    if (fill >= 0) {
        rc = ck_copy_sparse((int)fill, (int)fd, size);
        if (rc == 0)
            rc = ck_ftruncate((int)fd, (int64_t)size);  /* the hole at the end too */
        if (rc < 0)
            rst_fail("cannot refill a deleted file", path, rc);
    }
    /* the owner first: chown clears the set-user-ID and set-group-ID bits;
     * only when it differs (a restore without root makes it its own) */
    struct stat st;
    rc = ck_fstat((int)fd, &st);
    if (rc == 0 && (st.st_uid != uid || st.st_gid != gid))
        rc = ck_sc3(SYS_fchown, fd, uid, gid);
    if (rc < 0)
        rst_fail("cannot give a deleted file or directory its owner again", path, rc);
    rc = ck_sc2(SYS_fchmod, fd, mode & 07777);
    if (rc < 0)
        rst_fail("cannot give a deleted file or directory its mode again", path, rc);
    rc = ck_sc3(SYS_unlinkat, AT_FDCWD, name, dir ? AT_REMOVEDIR : 0);
    if (rc < 0)
        rst_fail("cannot remove a deleted file or directory again", name, rc);
    remove_parents(name, parents);
    return fd;
}

void op_deleted(const struct line *l)
{
    char path[1200];
    unhex(l, 8, path, sizeof(path));
    int dir = ((uint32_t)num(l, 4) & S_IFMT) == S_IFDIR;
    long fill = dir ? -1 : open_data(l, 9);
    long fd = rst_recreate_deleted(path, (uint32_t)num(l, 4), (uint32_t)num(l, 5), (uint32_t)num(l, 6), fill,
                                   num(l, 7));
    if (fill >= 0)
        ck_close((int)fill);
    to_slot(fd, l, 1, "cannot make a deleted file again");
}
