/*
 * System V IPC: whether the job's IPC namespace holds any object.
 *
 * The objects are the namespace's, not a process's: the agent saves them
 * once for the job (agent/sysv_ipc.py, a helper that joins the namespace)
 * and the restore plan makes them again (native/restorer/plan_sysv.c).
 * Most jobs hold none; the shim, already in the namespace, tells the agent
 * so in its DUMPED reply (sysv=0), and the agent then joins nothing during
 * the pause.  The kernel's counts, as ipcs reads them: shm_info.used_ids,
 * seminfo.semusz, msginfo.msgpool.  Parked, no process of the job can
 * create one before the agent looks.
 */
#include "shim.h"
#include "../common/sys.h"

#include <sys/ipc.h>
#include <sys/msg.h>
#include <sys/sem.h>
#include <sys/shm.h>

int ck_sysv_objects(void)
{
    int info[64]; /* larger than struct shm_info, seminfo and msginfo */
    long rc = ck_sc3(SYS_shmctl, 0, SHM_INFO, info);
    if (rc < 0 || info[0])
        return 1;
    rc = ck_sc4(SYS_semctl, 0, 0, SEM_INFO, info);
    if (rc < 0 || info[7])
        return 1;
    rc = ck_sc3(SYS_msgctl, 0, MSG_INFO, info);
    return rc < 0 || info[0];
}
