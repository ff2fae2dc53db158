/*
 * The image's directory and files, made before the pause.
 *
 * Creating a file is the costly part of a small dump on many filesystems:
 * an inode search on a journal-less ext4, a metadata server's round trip
 * on Lustre or NFS.  None of it needs a parked process.  So the agent
 * makes proc-P in the ready step, while the job still runs, and says
 * PREMAP dir=<it>; the checkpoint thread then opens the directory and
 * creates core.img, pages.img.part and files/ in it (ck_image_dir_prepare).
 * DUMP dir=<the same> takes them (ck_image_dir_take); any other DUMP, the
 * next PREMAP, RESUME and ABORT close what was not taken.
 *
 * Between PREMAP and DUMP the program runs with these descriptors open,
 * high up (CK_IMAGE_DIR_FD and on, as the agent's socket is), where its own
 * numbering does not reach.  One it closed and reused meanwhile (close_range,
 * dup2) is never taken or closed: each must still be the file it was
 * opened as (device and inode).  Nor are they taken by another process (a
 * child forked meanwhile drops its copies at once, ck_image_dir_after_fork)
 * or after the process changed the filesystem ids it creates files with.
 * Staging is an optimisation: where any step fails, nothing is staged and
 * the dump creates its files itself, reporting what goes wrong then.
 */
#include "shim.h"
#include "../common/sys.h"
#include "../common/util.h"

#include <errno.h>
#include <sys/stat.h>

#define CK_IMAGE_DIR_FD 960  /* above the agent's socket (900) and track.c's userfaultfd (950) */
#define STAGED 3             /* the directory, core.img, pages.img.part */

static struct {
    int32_t pid;                  /* the process that staged them; 0: nothing staged */
    uint32_t fsuid, fsgid;        /* the ids it created them with */
    char dir[4096];
    int fd[STAGED];
    uint64_t dev[STAGED], ino[STAGED];
} st;

static void fs_ids(uint32_t *uid, uint32_t *gid)
{
    /* an invalid id changes nothing and returns the current one */
    *uid = (uint32_t)ck_setfsuid(~0u);
    *gid = (uint32_t)ck_sc1(SYS_setfsgid, ~0u);
}

/* fd is still the file it was staged as */
static int still(int i)
{
    struct stat s;
    return st.fd[i] >= 0 && ck_fstat(st.fd[i], &s) == 0 && s.st_dev == st.dev[i] && s.st_ino == st.ino[i];
}

void ck_image_dir_drop(void)
{
    if (st.pid == (int32_t)ck_getpid())
        for (int i = 0; i < STAGED; i++)
            if (still(i))
                ck_close(st.fd[i]);
    st.pid = 0;
}

void ck_image_dir_after_fork(void)
{
    /* the child's copies, closed before the program's code runs in it */
    if (st.pid)
        for (int i = 0; i < STAGED; i++)
            if (st.fd[i] >= 0)
                ck_close(st.fd[i]);
    st.pid = 0;
}

/* fd moved up to CK_IMAGE_DIR_FD and on; -1 (and fd closed) where it cannot be */
static int keep_high(long fd, int i)
{
    if (fd < 0)
        return -1;
    long high = ck_fcntl((int)fd, F_DUPFD_CLOEXEC, CK_IMAGE_DIR_FD);
    ck_close((int)fd);
    struct stat s;
    if (high < 0 || ck_fstat((int)high, &s) < 0) {
        if (high >= 0)
            ck_close((int)high);
        return -1;
    }
    st.fd[i] = (int)high;
    st.dev[i] = s.st_dev;
    st.ino[i] = s.st_ino;
    return 0;
}

void ck_image_dir_prepare(const char *dir)
{
    ck_image_dir_drop();
    if (!dir || ck_strlen(dir) >= sizeof(st.dir))
        return;
    for (int i = 0; i < STAGED; i++)
        st.fd[i] = -1;
    int ok = keep_high(ck_open(dir, O_RDONLY | O_DIRECTORY | O_CLOEXEC, 0), 0) == 0;
    long rc = ok ? ck_sc3(SYS_mkdirat, st.fd[0], "files", 0700) : -1;
    ok = ok && (rc == 0 || rc == -EEXIST);
    ok = ok && keep_high(ck_openat(st.fd[0], "core.img", O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600), 1) == 0;
    ok = ok && keep_high(ck_openat(st.fd[0], "pages.img.part", O_RDWR | O_CREAT | O_TRUNC | O_CLOEXEC, 0600), 2) == 0;
    st.pid = (int32_t)ck_getpid();  /* so that drop closes what was opened */
    if (!ok) {
        ck_image_dir_drop();
        return;
    }
    ck_strlcpy(st.dir, dir, sizeof(st.dir));
    fs_ids(&st.fsuid, &st.fsgid);
}

int ck_image_dir_take(const char *dir, struct ck_image *im)
{
    uint32_t uid, gid;
    fs_ids(&uid, &gid);
    int mine = st.pid == (int32_t)ck_getpid() && dir && !ck_strcmp(dir, st.dir) && uid == st.fsuid && gid == st.fsgid;
    for (int i = 0; mine && i < STAGED; i++)
        mine = still(i);
    if (!mine) {
        ck_image_dir_drop();
        return -1;
    }
    im->dirfd = st.fd[0];
    im->core_fd = st.fd[1];
    im->pages_fd = st.fd[2];
    st.pid = 0;  /* the dump's now: not in the image as staged, nor closed by a drop */
    return 0;
}
