/*
 * inotify descriptors (CK_FD_INOTIFY): their watches, each as the kernel
 * shows it in fdinfo
 *   inotify wd:2 ino:6a1 sdev:800002 mask:fce ignored_mask:0 fhandle-bytes:8
 *           fhandle-type:1 f_handle:a106000000000000
 * (all hex), given a path through its file handle (open_by_handle_at on the
 * file system's mount, which needs CAP_DAC_READ_SEARCH), checked against
 * its inode.  The restore adds them again in wd order and must get the
 * same numbers: the kernel gives out the next number after the highest it
 * ever gave, which fdinfo does not show, so the shim counts it here, in
 * inotify_init1 and inotify_add_watch; a descriptor made without them
 * (a raw system call, or before an exec) is refused.  Events in flight are
 * dropped, as the kernel itself drops them when its queue overflows.
 */
#include "shim.h"
#include "../common/sys.h"
#include "../common/util.h"
#include "../common/maps.h"

#include <errno.h>

#define CK_EXPORT __attribute__((visibility("default")))
#define TRACKED_FDS 4096

/* per descriptor number: the highest wd given out plus one; 0: not made here */
static int32_t next_wd[TRACKED_FDS];

CK_EXPORT int inotify_init1(int flags)
{
    long fd = ck_sc1(SYS_inotify_init1, flags);
    if (fd >= 0 && fd < TRACKED_FDS)
        __atomic_store_n(&next_wd[fd], 1, __ATOMIC_RELEASE);
    return ck_libc_int(fd);
}

CK_EXPORT int inotify_init(void)
{
    return inotify_init1(0);
}

CK_EXPORT int inotify_add_watch(int fd, const char *path, uint32_t mask)
{
    long wd = ck_sc3(SYS_inotify_add_watch, fd, path, mask);
    if (wd > 0 && fd >= 0 && fd < TRACKED_FDS) {
        int32_t now = __atomic_load_n(&next_wd[fd], __ATOMIC_ACQUIRE);
        if (now && wd + 1 > now)
            __atomic_store_n(&next_wd[fd], (int32_t)(wd + 1), __ATOMIC_RELEASE);
    }
    return ck_libc_int(wd);
}

/* a word "key:HEX" of a line */
static uint64_t field(const char *line, const char *key, const char **at)
{
    size_t kl = ck_strlen(key);
    for (const char *p = line; *p && *p != '\n'; p++)
        if (ck_strncmp(p, key, kl) == 0) {
            if (at)
                *at = p + kl;
            return ck_parse_u64(p + kl, 16, 0);
        }
    if (at)
        *at = 0;
    return 0;
}

static int hexval(char c)
{
    return c >= '0' && c <= '9' ? c - '0' : c >= 'a' && c <= 'f' ? c - 'a' + 10 : -1;
}

/* the watched file, opened O_PATH from its handle on a mount of its file
 * system (/proc/self/mountinfo's "MAJOR:MINOR" is sdev), or < 0 */
static long open_handle(uint64_t sdev, const void *handle)
{
    static char mounts[65536];
    long n = ck_read_file("/proc/self/mountinfo", mounts, sizeof(mounts) - 1);
    if (n < 0)
        return n;
    mounts[n] = 0;
    long rc = -ENOENT;
    for (char *line = mounts; *line;) {
        char *end = line;
        while (*end && *end != '\n')
            end++;
        char *next = *end ? end + 1 : end;
        *end = 0;
        /* ID PARENT MAJOR:MINOR ROOT MOUNTPOINT ... */
        const char *p = line;
        for (int i = 0; i < 2 && p; i++) {
            while (*p && *p != ' ')
                p++;
            p = *p ? p + 1 : 0;
        }
        const char *q;
        uint64_t major = p ? ck_parse_u64(p, 10, &q) : 0, minor = 0;
        if (p && *q == ':') {
            minor = ck_parse_u64(q + 1, 10, &q);
            if (major == (sdev >> 20) && minor == (sdev & 0xfffff)) {
                /* the mount point: two words on, cut at its end */
                for (int i = 0; i < 2 && *q; i++) {
                    while (*q == ' ')
                        q++;
                    if (i == 0)
                        while (*q && *q != ' ')
                            q++;
                }
                char mp[1024];
                size_t m = 0;
                while (q[m] && q[m] != ' ' && m + 1 < sizeof(mp)) {
                    mp[m] = q[m];
                    m++;
                }
                mp[m] = 0;
                /* not O_PATH: open_by_handle_at refuses one (EBADF) */
                long mfd = ck_open(mp, O_RDONLY | O_DIRECTORY | O_CLOEXEC, 0);
                if (mfd >= 0) {
                    rc = ck_sc3(SYS_open_by_handle_at, mfd, handle, O_PATH | O_CLOEXEC);
                    ck_close((int)mfd);
                    if (rc >= 0 || rc == -EPERM)
                        return rc;
                }
            }
        }
        line = next;
    }
    return rc;
}

static int watch_path(struct ck_image *im, struct ck_fd *f, const char *line, struct ck_inotify_watch *w,
                      const char *target)
{
    static char path[4096];
    const char *hex;
    uint64_t sdev = field(line, "sdev:", 0);
    uint64_t bytes = field(line, "fhandle-bytes:", 0);
    uint64_t type = field(line, "fhandle-type:", 0);
    field(line, "f_handle:", &hex);
    struct {
        uint32_t handle_bytes;
        int32_t handle_type;
        unsigned char h[128];
    } fh;
    if (!hex || bytes > sizeof(fh.h))
        return ck_fail_fd(im, f->fd, "inotify watch whose file handle the kernel does not show", target);
    fh.handle_bytes = (uint32_t)bytes;
    fh.handle_type = (int32_t)type;
    for (uint64_t i = 0; i < bytes; i++) {
        int hi = hexval(hex[2 * i]), lo = hi < 0 ? -1 : hexval(hex[2 * i + 1]);
        if (lo < 0)
            return ck_fail_fd(im, f->fd, "inotify watch whose file handle the kernel does not show", target);
        fh.h[i] = (unsigned char)(hi * 16 + lo);
    }
    long hfd = open_handle(sdev, &fh);
    if (hfd == -EPERM)
        return ck_fail_fd(im, f->fd,
                          "inotify watch: finding the watched file's path needs CAP_DAC_READ_SEARCH "
                          "(open_by_handle_at)",
                          target);
    long n = -ENOENT;
    if (hfd >= 0) {
        char link[64];
        struct ck_buf b;
        ck_buf_init(&b, link, sizeof(link));
        ck_buf_str(&b, "/proc/self/fd/");
        ck_buf_u64(&b, (uint64_t)hfd);
        n = ck_readlink(link, path, sizeof(path) - 1);
        ck_close((int)hfd);
    }
    struct stat st;
    if (n > 0)
        path[n] = 0;
    if (n <= 0 || path[0] != '/' || ck_endswith(path, " (deleted)") ||
        ck_sc4(SYS_newfstatat, AT_FDCWD, path, &st, AT_SYMLINK_NOFOLLOW) < 0 ||
        st.st_ino != w->ino)
        return ck_fail_fd(im, f->fd,
                          "inotify watch on a file ckptd finds no path to (removed, or on a file system "
                          "this process cannot reach)",
                          target);
    w->path = ck_image_string(im, path);
    return 0;
}

int ck_dump_inotify(struct ck_image *im, struct ck_fd *f, const char *info, const char *target)
{
    int32_t next = f->fd < TRACKED_FDS ? __atomic_load_n(&next_wd[f->fd], __ATOMIC_ACQUIRE) : 0;
    if (!next)
        return ck_fail_fd(im, f->fd,
                          "inotify descriptor not made by libc's inotify_init in this program: ckptd cannot "
                          "tell the number its next watch would get",
                          target);
    f->type = CK_FD_INOTIFY;
    f->last_wd = next - 1;
    static const char zeros[8];
    if (im->blob.count % 8 && ck_table_bytes_append(&im->blob, zeros, 8 - im->blob.count % 8) == UINT64_MAX)
        return ck_image_fail(im, "too many inotify watches", 0, 0);
    f->watches_off = im->blob.count;  /* aligned: the records are sorted in place below */
    for (const char *p = info; *p;) {
        if (ck_startswith(p, "inotify wd:")) {
            struct ck_inotify_watch w = {0, 0, 0, 0, 0};
            w.wd = (int32_t)field(p, "wd:", 0);
            w.ino = field(p, "ino:", 0);
            w.mask = (uint32_t)field(p, "mask:", 0);
            if (w.wd <= 0 || w.wd > f->last_wd)
                return ck_fail_fd(im, f->fd, "inotify watch numbered past the highest the shim counted", target);
            if (field(p, "ignored_mask:", 0))
                return ck_fail_fd(im, f->fd, "inotify watch with an ignored mask", target);
            if (watch_path(im, f, p, &w, target) < 0)
                return -1;
            if (ck_table_bytes_append(&im->blob, &w, sizeof(w)) == UINT64_MAX)
                return ck_image_fail(im, "too many inotify watches", 0, 0);
            f->nwatches++;
        }
        while (*p && *p != '\n')
            p++;
        if (*p)
            p++;
    }
    /* in wd order, the order the restore adds them in (fdinfo lists the
     * newest first); insertion sort: a program has few */
    struct ck_inotify_watch *ws = (void *)(im->blob.base + f->watches_off);
    for (uint32_t i = 1; i < f->nwatches; i++) {
        struct ck_inotify_watch w = ws[i];
        uint32_t j = i;
        for (; j > 0 && ws[j - 1].wd > w.wd; j--)
            ws[j] = ws[j - 1];
        ws[j] = w;
    }
    return 0;
}
