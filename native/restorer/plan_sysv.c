/*
 * System V IPC in the restore plan (plan.c has the format): the objects of
 * the job's IPC namespace (saved once for the job by the agent,
 * agent/sysv_ipc.py), made again in the restore's fresh IPC namespace
 * (ckptd-init makes one for a root job) under their old ids, by writing
 * /proc/sys/kernel/{shm,sem,msg}_next_id just before each is created, then
 * given their owner and mode and filled.  Each process attaches its shared
 * memory segments again at their addresses itself (mem.c: the ids are kept,
 * so no slot is needed).
 *   sysvshm ID KEY MODE UID GID SIZE FILE          FILE: the segment's bytes
 *   sysvsem ID KEY MODE UID GID NSEMS FILE [UNDO]  FILE: NSEMS uint16 values;
 *                                                  UNDO: hex (uint32 semnum,
 *                                                  int32 add) pairs: the sum of
 *                                                  every process's SEM_UNDO
 *                                                  adjustment, taken back by
 *                                                  each (restorer/semundo.c)
 *   sysvmsg ID KEY MODE UID GID QBYTES COUNT FILE  FILE: COUNT records, each
 *                                                  int64 type, uint64 length,
 *                                                  the bytes padded to 8
 */
#include "plan.h"

#include <errno.h>

#include <sys/ipc.h>
#include <sys/msg.h>
#include <sys/sem.h>
#include <sys/shm.h>

#ifndef SHM_LOCK
#define SHM_LOCK 11
#endif

/* the next object of this kind made in this namespace gets id `id` */
static void next_id(const char *kind, uint64_t id)
{
    char path[48], text[24];
    struct ck_buf b;
    ck_buf_init(&b, path, sizeof(path));
    ck_buf_str(&b, "/proc/sys/kernel/");
    ck_buf_str(&b, kind);
    ck_buf_str(&b, "_next_id");
    ck_buf_init(&b, text, sizeof(text));
    ck_buf_u64(&b, id);
    long fd = ck_open(path, O_WRONLY | O_CLOEXEC, 0);
    if (fd < 0)
        rst_fail("cannot choose the id of a System V IPC object", path, fd);
    long rc = ck_write((int)fd, text, b.len);
    ck_close((int)fd);
    if (rc != (long)b.len)
        rst_fail("cannot choose the id of a System V IPC object", path, rc < 0 ? rc : -EIO);
}

static void check_id(long got, const struct line *l, const char *what)
{
    if (got < 0)
        rst_fail(what, l->tok[1], got);
    if ((uint64_t)got != num(l, 1))
        rst_fail("a System V IPC object did not get its old id (not a fresh IPC namespace?)", l->tok[1], got);
}

static void set_perm(struct ipc_perm *p, const struct line *l)
{
    p->uid = (uid_t)num(l, 4);
    p->gid = (gid_t)num(l, 5);
    p->mode = (unsigned short)(num(l, 3) & 0777);
}

/* the key: IPC_PRIVATE (0) makes a new object each time; any other must be new */
static int create_flags(const struct line *l)
{
    return (int)(num(l, 3) & 0777) | (num(l, 2) ? IPC_CREAT | IPC_EXCL : 0);
}

void op_sysvshm(const struct line *l)
{
    uint64_t size = num(l, 6);
    next_id("shm", num(l, 1));
    long id = ck_sc3(SYS_shmget, (int)num(l, 2), size, create_flags(l));
    check_id(id, l, "cannot create a System V shared memory segment");
    struct shmid_ds ds = {0};
    set_perm(&ds.shm_perm, l);
    long rc = ck_sc3(SYS_shmctl, id, IPC_SET, &ds);
    if (rc < 0)
        rst_fail("cannot set the owner and mode of a System V shared memory segment", l->tok[1], rc);
    if (num(l, 3) & SHM_LOCKED) {
        rc = ck_sc3(SYS_shmctl, id, SHM_LOCK, 0);
        if (rc < 0)
            rst_fail("cannot lock a System V shared memory segment again (SHM_LOCK)", l->tok[1], rc);
    }
    long at = ck_sc3(SYS_shmat, id, 0, 0);
    if (at < 0 && at > -4096)
        rst_fail("cannot attach a System V shared memory segment to fill it", l->tok[1], at);
    long in = open_data(l, 7);
    rst_pread_all((int)in, (void *)at, size, 0, "saved System V shared memory is truncated");
    ck_close((int)in);
    ck_sc1(SYS_shmdt, at);
}

void op_sysvsem(const struct line *l)
{
    uint64_t nsems = num(l, 6);
    if (!nsems || nsems * sizeof(unsigned short) > BOUNCE)
        rst_fail("corrupt restore plan: a System V semaphore set's size", l->tok[6], 0);
    next_id("sem", num(l, 1));
    long id = ck_sc3(SYS_semget, (int)num(l, 2), nsems, create_flags(l));
    check_id(id, l, "cannot create a System V semaphore set");
    struct semid_ds ds = {0};
    set_perm(&ds.sem_perm, l);
    long rc = ck_sc4(SYS_semctl, id, 0, IPC_SET, &ds);
    if (rc < 0)
        rst_fail("cannot set the owner and mode of a System V semaphore set", l->tok[1], rc);
    long in = open_data(l, 7);
    rst_pread_all((int)in, bounce, nsems * sizeof(unsigned short), 0, "saved System V semaphores are truncated");
    ck_close((int)in);
    if (l->ntok > 8) {
        static int32_t undo[2 * 4096 + 1];
        size_t n = unhex(l, 8, (char *)undo, sizeof(undo)) / 8;
        unsigned short *v = (unsigned short *)bounce;
        for (size_t i = 0; i < n; i++) {
            int64_t to = (int64_t)v[(uint32_t)undo[2 * i] % nsems] + undo[2 * i + 1];
            if ((uint32_t)undo[2 * i] >= nsems || to < 0 || to > 32767)
                rst_fail("corrupt restore plan: a System V semaphore's undo adjustments", l->tok[1], 0);
            v[undo[2 * i]] = (unsigned short)to;
        }
    }
    rc = ck_sc4(SYS_semctl, id, 0, SETALL, bounce);
    if (rc < 0)
        rst_fail("cannot set the values of a System V semaphore set", l->tok[1], rc);
}

void op_sysvmsg(const struct line *l)
{
    next_id("msg", num(l, 1));
    long id = ck_sc2(SYS_msgget, (int)num(l, 2), create_flags(l));
    check_id(id, l, "cannot create a System V message queue");
    struct msqid_ds ds = {0};
    set_perm(&ds.msg_perm, l);
    ds.msg_qbytes = num(l, 6);
    long rc = ck_sc3(SYS_msgctl, id, IPC_SET, &ds);
    if (rc < 0)
        rst_fail("cannot set the owner, mode and size of a System V message queue", l->tok[1], rc);
    long in = open_data(l, 8);
    uint64_t off = 0, count = num(l, 7);
    for (uint64_t i = 0; i < count; i++) {
        uint64_t head[2];  /* type, length */
        rst_pread_all((int)in, head, sizeof(head), off, "saved System V messages are truncated");
        if (head[1] > BOUNCE - 8)
            rst_fail("corrupt image: a System V message is too long", l->tok[1], 0);
        *(int64_t *)bounce = (int64_t)head[0];  /* struct msgbuf: the type, then the bytes */
        rst_pread_all((int)in, bounce + 8, head[1], off + sizeof(head), "saved System V messages are truncated");
        rc = ck_sc4(SYS_msgsnd, id, bounce, head[1], IPC_NOWAIT);
        if (rc < 0)
            rst_fail("cannot queue a System V message again", l->tok[1], rc);
        off += sizeof(head) + ((head[1] + 7) & ~7ull);
    }
    ck_close((int)in);
}
