/*
 * inotify descriptors (the shim's side is native/shim/dump_inotify.c): a
 * new instance, its watches added again by path in wd order, each with the
 * number it had.  The kernel numbers a new watch one past the highest it
 * ever gave out, so a number no watch holds any more is given to a
 * placeholder watch and taken back, and so is every number up to the
 * highest the program had, so that its next watch gets the number it would
 * have got.  A placeholder's removal queues an IN_IGNORED event, and a
 * watched file may change meanwhile: the queue is drained before the
 * program runs (events in flight are dropped, as the kernel drops them when
 * its queue overflows).
 */
#include "restorer.h"

#include <errno.h>

#define IN_DONT_FOLLOW_ 0x02000000u
#define IN_ATTRIB_ 0x00000004u

/* a directory none of the watches is on, for the placeholders */
static const char *placeholder(const struct ck_inotify_watch *ws, uint32_t n)
{
    static const char candidates[][8] = {"/", "/proc", "/dev", "/sys", "/tmp"};  /* no pointers: no relocations */
    for (size_t c = 0; c < sizeof(candidates) / sizeof(candidates[0]); c++) {
        struct stat st;
        if (ck_stat(candidates[c], &st) < 0)
            continue;
        uint32_t i = 0;
        while (i < n && ws[i].ino != st.st_ino)
            i++;
        if (i == n)
            return candidates[c];
    }
    rst_fail("cannot number inotify watches again: every placeholder directory is watched", 0, 0);
}

/* give wd out once, to nothing the program sees */
static void skip_wd(int fd, const char *dummy, int32_t wd)
{
    long got = ck_sc3(SYS_inotify_add_watch, fd, dummy, IN_ATTRIB_ | IN_DONT_FOLLOW_);
    if (got != wd)
        rst_fail("cannot number inotify watches again (the kernel gave another number)", dummy, got < 0 ? got : 0);
    ck_sc2(SYS_inotify_rm_watch, fd, got);
}

int rst_make_inotify(const struct rst_image *im, const struct ck_fd *f)
{
    uint64_t size = (uint64_t)f->nwatches * sizeof(struct ck_inotify_watch);
    if (f->watches_off > im->blob_size || size > im->blob_size - f->watches_off || f->watches_off % 8)
        rst_fail("corrupt image: inotify watches are outside BLOB", 0, 0);
    const struct ck_inotify_watch *ws = (const void *)(im->blob + f->watches_off);
    long fd = ck_sc1(SYS_inotify_init1, O_NONBLOCK | O_CLOEXEC);
    if (fd < 0)
        rst_fail("cannot create an inotify instance", 0, fd);
    const char *dummy = placeholder(ws, f->nwatches);
    int32_t next = 1;
    for (uint32_t i = 0; i < f->nwatches; i++) {
        const char *path = rst_str(im, ws[i].path);
        if (ws[i].wd < next)
            rst_fail("corrupt image: inotify watches out of order", path, 0);
        while (next < ws[i].wd)
            skip_wd((int)fd, dummy, next++);
        /* the path names the watched inode itself: not what it may point to */
        long wd = ck_sc3(SYS_inotify_add_watch, fd, path, ws[i].mask | IN_DONT_FOLLOW_);
        if (wd < 0)
            rst_fail("cannot watch a file with inotify again (is it gone?)", path, wd);
        if (wd != ws[i].wd)
            rst_fail("cannot give an inotify watch its number again (two watches on one file now?)", path, 0);
        struct stat st;
        if (ck_sc4(SYS_newfstatat, AT_FDCWD, path, &st, AT_SYMLINK_NOFOLLOW) < 0 || st.st_ino != ws[i].ino)
            rst_fail("an inotify watch's path leads to another file now", path, 0);
        next++;
    }
    while (next <= f->last_wd)
        skip_wd((int)fd, dummy, next++);
    /* the placeholders' IN_IGNORED events, and whatever came meanwhile */
    static char drain[4096];
    while (ck_read((int)fd, drain, sizeof(drain)) > 0)
        ;
    return (int)fd;
}
