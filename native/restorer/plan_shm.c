/*
 * Shared memory in the restore plan (plan.c has the format): a memfd or a
 * deleted tmpfs file that mappings or descriptors hold is made once as a
 * memfd at its slot and filled with its saved data; each process maps it
 * or reopens it from there (mem.c, fds.c), then gives a descriptor of it
 * its mode and seals back (rst_shm_mode_and_seals, below).
 *   shm SLOT DEV INO SIZE NAME   shmfill SLOT FILE
 */
#include "plan.h"

#ifndef F_ADD_SEALS
#define F_ADD_SEALS 1033
#define F_GET_SEALS 1034
#endif

void op_shm(const struct line *l)
{
    char name[256];
    unhex(l, 5, name, sizeof(name));
    /* the name as the job's memfd had it (empty too); sealable, so
     * that its seals can be added back once it is filled (below) */
    long rc = ck_memfd_create(name, 1 /* MFD_CLOEXEC */ | 2 /* MFD_ALLOW_SEALING */);
    if (rc >= 0) {
        long t = ck_ftruncate((int)rc, (int64_t)num(l, 4));
        if (t < 0)
            rst_fail("cannot size shared memory", name, t);
    }
    to_slot(rc, l, 1, "cannot create shared memory (memfd)");
}

/* copy the data ranges of a saved file into a shared memory object */
void op_shmfill(const struct line *l)
{
    int to = slot_fd(l, 1);
    long in = open_data(l, 2);
    struct stat st;
    long rc = ck_fstat((int)in, &st);
    if (rc < 0)
        rst_fail("cannot stat saved shared memory", 0, rc);
    rc = ck_copy_sparse((int)in, to, (uint64_t)st.st_size);
    if (rc < 0)
        rst_fail("cannot refill shared memory", 0, rc);
    ck_close((int)in);
}

/* ---- in each process that holds it (fds.c) ---- */

/* A memfd's mode, then its seals: last, once this process's mappings of it
 * are filled (rst_map_image ran).  The plan created it with
 * MFD_ALLOW_SEALING; one made without is sealed with F_SEAL_SEAL alone.
 * Several processes holding it each find it done by the first. */
void rst_shm_mode_and_seals(int fd, const struct ck_fd *f, const char *path)
{
    struct stat st;
    long rc = ck_fstat(fd, &st);
    if (rc < 0)
        rst_fail("cannot stat shared memory", path, rc);
    if ((st.st_mode & 07777) != (f->mode & 07777)) {
        rc = ck_sc2(SYS_fchmod, fd, f->mode & 07777);
        if (rc < 0)
            rst_fail("cannot restore the mode of shared memory", path, rc);
    }
    if (!(f->flags & CK_FDF_MEMFD))
        return;
    long now = ck_fcntl(fd, F_GET_SEALS, 0);
    if (now < 0 || (uint32_t)now == f->seals)
        return;  /* EINVAL: not sealable here (a plan that made something else) */
    rc = ck_fcntl(fd, F_ADD_SEALS, (long)(f->seals & ~(uint32_t)now));
    if (rc < 0)
        rst_fail("cannot seal a memfd again (F_ADD_SEALS)", path, rc);
}
