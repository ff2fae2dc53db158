/*
 * System V semaphore undo adjustments (semop with SEM_UNDO), issue 19: the
 * shim tracked each process's semadj (native/shim/eintr.c); the plan made
 * every set with value = saved + the sum of every process's adjustments
 * (ckptd/image/plan/sysv.py, which checks it fits), and here each process
 * takes its own back with a semop of -adj with SEM_UNDO, which leaves the
 * value as saved and gives the process semadj = adj, as the kernel had it.
 * The raises first; a lowering op may have to wait for another process's
 * raise (the sum already counts it), so it blocks: raises never do (the
 * plan checked saved + every positive adjustment stays under SEMVMX).
 */
#include "restorer.h"

#include <errno.h>

#include <sys/sem.h>

#define RST_MAX_SEM_UNDO 4096

static void take(const struct ck_sem_undo *u)
{
    struct sembuf op = {(unsigned short)u->semnum, (short)-u->adj, SEM_UNDO};
    long rc;
    while ((rc = ck_sc3(SYS_semop, u->semid, &op, 1)) == -EINTR)
        ;
    if (rc < 0) {
        char detail[48];
        struct ck_buf b;
        ck_buf_init(&b, detail, sizeof(detail));
        ck_buf_str(&b, "semid ");
        ck_buf_i64(&b, u->semid);
        ck_buf_str(&b, " semaphore ");
        ck_buf_i64(&b, u->semnum);
        rst_fail("cannot give a process its System V semaphore undo adjustment again", detail, rc);
    }
}

void rst_restore_sem_undo(const struct rst_image *im)
{
    const struct ck_proc *p = im->proc;
    if (!p->nsemundo)
        return;
    if (p->nsemundo > RST_MAX_SEM_UNDO || p->semundo_off > im->blob_size ||
        (uint64_t)p->nsemundo * sizeof(struct ck_sem_undo) > im->blob_size - p->semundo_off || p->semundo_off % 8)
        rst_fail("corrupt image: the System V semaphore undo adjustments lie outside the image", 0, 0);
    const struct ck_sem_undo *us = (const struct ck_sem_undo *)(im->blob + p->semundo_off);
    for (int raises = 1; raises >= 0; raises--)
        for (uint32_t i = 0; i < p->nsemundo; i++)
            if (us[i].kind == CK_SEM_UNDO_ADJ && us[i].adj && (us[i].adj < 0) == raises)
                take(&us[i]);
}
