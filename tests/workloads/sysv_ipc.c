/*
 * System V IPC through a checkpoint, kill -9 and restart (issue 19): the
 * objects come back under the same ids, with their owner, mode, size and
 * contents, and every process finds its attachments where they were.
 *   sysv_ipc STEPS shm    a segment filled with a pattern, attached twice by
 *                         the parent (once read-only) and by a child that
 *                         answers the parent through it at every step; a
 *                         second segment attached in part (its first page
 *                         unmapped), detached at the end by its attach address
 *   sysv_ipc STEPS sem    a set of three semaphores with values, changed at
 *                         every step, and a child blocked in semop until the end
 *   sysv_ipc STEPS msg    a queue with messages of several types, a smaller
 *                         qbytes, one sent and one received at every step (by
 *                         type too), and a child blocked in msgrcv until the end
 *   sysv_ipc STEPS rmid   a segment removed (IPC_RMID) while attached: it stays,
 *                         marked, and goes at its last detach
 *   sysv_ipc STEPS undo   semaphores changed with SEM_UNDO by the parent and
 *                         two children; at the last step the children exit
 *                         one by one and the kernel undoes their changes: the
 *                         values after each exit are checked (70 sets set
 *                         and removed before: no refusal for those)
 *   sysv_ipc STEPS setval a child's SEM_UNDO change, then the parent's SETVAL
 *                         on the set (which clears the child's adjustment in
 *                         the kernel, unseen by the child's shim): refused
 *   sysv_ipc STEPS exec   a semaphore changed with SEM_UNDO, then an exec of
 *                         this program (case "after-exec", which runs the
 *                         steps): the adjustment outlives the shim's record
 *                         of it, refused
 * Every object is IPC_PRIVATE and removed at the end, so the uninterrupted
 * run (in the host's IPC namespace) leaves nothing behind.
 */
#define _GNU_SOURCE
#include <signal.h>
#include <stdint.h>
#include <sys/ipc.h>
#include <sys/mman.h>
#include <sys/msg.h>
#include <sys/prctl.h>
#include <sys/sem.h>
#include <sys/shm.h>
#include <sys/wait.h>
#include <unistd.h>

#include "state_check.h"

#define PAGE 4096
#define SEG_SIZE (3 * PAGE + 100)
#define PART_SIZE (4 * PAGE)

static int nsteps;
static pid_t child = -1;

/* a child that dies with the parent, which may stop at a BAD check */
static pid_t fork_child(void)
{
    pid_t pid = fork();
    CHECK(pid >= 0, "fork");
    if (pid == 0)
        prctl(PR_SET_PDEATHSIG, SIGKILL);
    return pid;
}

/* ---- shared memory ---- */

static int seg, part;
static volatile int32_t *rw;     /* seg, read-write */
static const volatile int32_t *ro;  /* seg again, read-only */
static unsigned char *part_at;   /* where part was attached; its first page unmapped */

static unsigned char pattern(size_t i) { return (unsigned char)(i * 7 + 3); }

static void shm_setup(void)
{
    seg = shmget(IPC_PRIVATE, SEG_SIZE, 0640 | IPC_CREAT);
    CHECK(seg >= 0, "shmget");
    rw = shmat(seg, 0, 0);
    CHECK(rw != (void *)-1, "shmat");
    for (size_t i = 8; i < SEG_SIZE; i++)
        ((unsigned char *)rw)[i] = pattern(i);
    rw[0] = rw[1] = 0;
    ro = shmat(seg, 0, SHM_RDONLY);
    CHECK(ro != (void *)-1, "shmat read-only");
    part = shmget(IPC_PRIVATE, PART_SIZE, 0600);
    CHECK(part >= 0, "shmget");
    part_at = shmat(part, 0, 0);
    CHECK(part_at != (void *)-1, "shmat");
    for (size_t i = 0; i < PART_SIZE; i++)
        part_at[i] = pattern(i + 1);
    CHECK(munmap(part_at, PAGE) == 0, "munmap");
    child = fork_child();
    if (child == 0) {  /* echoes the parent's number back, through the segment */
        for (;;) {
            int32_t v = rw[0];
            if (v < 0)
                _exit(0);
            rw[1] = v;
            usleep(2000);
        }
    }
}

/* "r--s" or "rw-s": the permissions /proc/self/maps shows at addr */
static void perms_at(const volatile void *addr, char out[5])
{
    FILE *f = fopen("/proc/self/maps", "r");
    char line[512];
    out[0] = 0;
    while (f && fgets(line, sizeof(line), f)) {
        unsigned long lo, hi;
        if (sscanf(line, "%lx-%lx %4s", &lo, &hi, out) == 3 && (unsigned long)addr >= lo && (unsigned long)addr < hi)
            break;
        out[0] = 0;
    }
    if (f)
        fclose(f);
}

static void shm_check(int step)
{
    struct shmid_ds ds;
    CHECK(shmctl(seg, IPC_STAT, &ds) == 0, "segment %d is gone", seg);
    CHECK(ds.shm_segsz == SEG_SIZE && (ds.shm_perm.mode & 0777) == 0640, "segment size %zu mode %o",
          (size_t)ds.shm_segsz, ds.shm_perm.mode);
    CHECK(ds.shm_nattch == 4, "segment attached %lu times", (unsigned long)ds.shm_nattch);
    CHECK(shmctl(part, IPC_STAT, &ds) == 0 && ds.shm_segsz == PART_SIZE && ds.shm_nattch == 2, "second segment");
    for (size_t i = 8; i < SEG_SIZE; i += 61)
        CHECK(((volatile unsigned char *)rw)[i] == pattern(i) && ((volatile unsigned char *)ro)[i] == pattern(i),
              "segment byte %zu", i);
    for (size_t i = PAGE; i < PART_SIZE; i += 53)
        CHECK(part_at[i] == pattern(i + 1), "second segment byte %zu", i);
    char p[5];
    perms_at(ro, p);
    CHECK(!strcmp(p, "r--s"), "read-only attachment is %s", p);
    perms_at(rw, p);
    CHECK(!strcmp(p, "rw-s"), "read-write attachment is %s", p);
    perms_at(part_at, p);
    CHECK(p[0] == 0, "the unmapped page of the second segment is mapped (%s)", p);
    rw[0] = step;  /* the child answers through the segment */
    for (int i = 0; i < 2000 && rw[1] != step; i++)
        usleep(1000);
    CHECK(rw[1] == step, "the child answered %d, not %d", rw[1], step);
    if (step == nsteps) {
        CHECK(shmdt(part_at) == 0, "shmdt of the partly unmapped attachment");
        CHECK(shmctl(part, IPC_STAT, &ds) == 0 && ds.shm_nattch == 1, "second segment still attached");
        rw[0] = -1;
        int status;
        CHECK(waitpid(child, &status, 0) == child && status == 0, "child status %d", status);
        shmctl(seg, IPC_RMID, 0);
        shmctl(part, IPC_RMID, 0);
    }
}

/* ---- semaphores ---- */

static int sems;
static int base0 = 5;  /* semaphore 0 between steps */

static void sem_setup(void)
{
    sems = semget(IPC_PRIVATE, 3, 0604);
    CHECK(sems >= 0, "semget");
    unsigned short init[3] = {5, 0, 7};
    CHECK(semctl(sems, 0, SETALL, init) == 0, "SETALL");
    child = fork_child();
    if (child == 0) {  /* blocked until the parent's last step */
        struct sembuf op = {1, -1, 0};
        _exit(semop(sems, &op, 1) < 0 ? 2 : 0);  /* never EINTR for a checkpoint (shim/eintr.c) */
    }
}

static void sem_check(int step)
{
    struct semid_ds ds;
    CHECK(semctl(sems, 0, IPC_STAT, &ds) == 0, "semaphore set %d is gone", sems);
    CHECK(ds.sem_nsems == 3 && (ds.sem_perm.mode & 0777) == 0604, "set of %lu, mode %o", (unsigned long)ds.sem_nsems,
          ds.sem_perm.mode);
    struct sembuf op[2] = {{0, -1, 0}, {2, 1, 0}};
    CHECK(semop(sems, op, 2) == 0, "semop");
    unsigned short v[3];
    CHECK(semctl(sems, 0, GETALL, v) == 0, "GETALL");
    CHECK(v[0] == base0 - 1 && v[1] == 0 && v[2] == 7 + step, "values %u %u %u at step %d", v[0], v[1], v[2], step);
    struct sembuf back = {0, 1, 0};
    CHECK(semop(sems, &back, 1) == 0, "semop");
    for (int i = 0; i < 2000 && semctl(sems, 1, GETNCNT) != 1; i++)  /* the child may not wait yet */
        usleep(1000);
    CHECK(semctl(sems, 1, GETNCNT) == 1, "%d processes wait on semaphore 1", semctl(sems, 1, GETNCNT));
    if (step == nsteps) {
        struct sembuf wake = {1, 1, 0};
        CHECK(semop(sems, &wake, 1) == 0, "semop");
        int status;
        CHECK(waitpid(child, &status, 0) == child && status == 0, "child status %d", status);
        semctl(sems, 0, IPC_RMID);
    }
}

/* ---- SEM_UNDO ---- */

static pid_t undoer[2];

/* values 0 and 1 of the set, as GETALL says */
static void undo_expect(int v0, int v1, const char *when)
{
    unsigned short v[3];
    CHECK(semctl(sems, 0, GETALL, v) == 0, "GETALL");
    CHECK(v[0] == v0 && v[1] == v1, "values %u %u %s, not %d %d", v[0], v[1], when, v0, v1);
}

/* a child that changes the set with SEM_UNDO, then waits on semaphore 2
 * (its own turn: 2 * which + 1 posts, then exits, undone by the kernel) */
static pid_t undo_child(int which, short d0, short d1)
{
    pid_t pid = fork_child();
    if (pid == 0) {
        struct sembuf ops[2] = {{0, d0, SEM_UNDO}, {1, d1, SEM_UNDO}};
        if (semop(sems, ops, 2) < 0)
            _exit(2);
        struct sembuf wait = {2, (short)-(which + 1), 0};
        _exit(semop(sems, &wait, 1) < 0 ? 3 : 0);
    }
    for (int i = 0; i < 2000 && semctl(sems, 2, GETNCNT) != which + 1; i++)  /* it has changed the set */
        usleep(1000);
    CHECK(semctl(sems, 2, GETNCNT) == which + 1, "child %d did not wait", which);
    return pid;
}

static void undo_setup(int setval)
{
    for (int i = 0; i < 70; i++) {  /* more sets set and removed than the shim's table of clears holds */
        int other = semget(IPC_PRIVATE, 1, 0600);
        CHECK(other >= 0 && semctl(other, 0, SETVAL, 1) == 0 && semctl(other, 0, IPC_RMID) == 0, "a set");
    }
    sems = semget(IPC_PRIVATE, 3, 0600);
    CHECK(sems >= 0, "semget");
    unsigned short init[3] = {5, 2, 0};
    CHECK(semctl(sems, 0, SETALL, init) == 0, "SETALL");
    struct sembuf ops[2] = {{0, -1, SEM_UNDO}, {1, 2, SEM_UNDO}};  /* the parent's adjustments: +1, -2 */
    CHECK(semop(sems, ops, 2) == 0, "semop SEM_UNDO");
    undoer[0] = undo_child(0, -2, 1);  /* 2, 5: adjustments +2, -1 */
    if (setval) {
        CHECK(semctl(sems, 1, SETVAL, 9) == 0, "SETVAL");  /* the child's -1 on semaphore 1 is gone */
        return;
    }
    undoer[1] = undo_child(1, 1, -3);  /* 3, 2: adjustments -1, +3 */
    undo_expect(3, 2, "after the changes");
}

static void undo_check(int step)
{
    struct sembuf ops[2] = {{0, 4, SEM_UNDO}, {0, -4, SEM_UNDO}};  /* the parent's adjustment changes and comes back */
    CHECK(semop(sems, ops, 1) == 0 && semop(sems, ops + 1, 1) == 0, "semop SEM_UNDO");
    if (undoer[1] <= 0)
        return;
    undo_expect(3, 2, "between steps");
    if (step < nsteps)
        return;
    struct sembuf post = {2, 1, 0};  /* child 0 takes it */
    int status;
    CHECK(semop(sems, &post, 1) == 0 && waitpid(undoer[0], &status, 0) == undoer[0] && status == 0,
          "child 0 status %d", status);
    undo_expect(5, 1, "after child 0's exit");
    post.sem_op = 2;
    CHECK(semop(sems, &post, 1) == 0 && waitpid(undoer[1], &status, 0) == undoer[1] && status == 0,
          "child 1 status %d", status);
    undo_expect(4, 4, "after child 1's exit");
    printf("values after the children's exits: 4 4\n");
    semctl(sems, 0, IPC_RMID);
}

/* ---- message queues ---- */

struct msg {
    long type;
    char text[32];
};

static int queue;
static struct msg model[64];  /* what the queue holds, in order */
static int nmodel;

static void model_send(long type, const char *text)
{
    struct msg m = {type, {0}};
    snprintf(m.text, sizeof(m.text), "%s", text);
    CHECK(msgsnd(queue, &m, strlen(m.text) + 1, IPC_NOWAIT) == 0, "msgsnd");
    model[nmodel++] = m;
}

/* receive the first message of type (0: any), as the model says it is */
static void model_receive(long type)
{
    int i = 0;
    while (type && model[i].type != type)
        i++;
    struct msg m;
    ssize_t n = msgrcv(queue, &m, sizeof(m.text), type, IPC_NOWAIT);
    CHECK(n == (ssize_t)strlen(model[i].text) + 1 && m.type == model[i].type && !strcmp(m.text, model[i].text),
          "received type %ld \"%s\" (%zd bytes), not type %ld \"%s\"", m.type, n > 0 ? m.text : "", n, model[i].type,
          model[i].text);
    memmove(&model[i], &model[i + 1], (size_t)(nmodel - i - 1) * sizeof(model[0]));
    nmodel--;
}

static void msg_setup(void)
{
    queue = msgget(IPC_PRIVATE, 0620);
    CHECK(queue >= 0, "msgget");
    struct msqid_ds ds;
    CHECK(msgctl(queue, IPC_STAT, &ds) == 0, "IPC_STAT");
    ds.msg_qbytes = 3000;
    CHECK(msgctl(queue, IPC_SET, &ds) == 0, "IPC_SET");
    const char *texts[] = {"one", "two", "three", "four", "five", "six"};
    for (int i = 0; i < 6; i++)
        model_send(i % 3 + 1, texts[i]);
    child = fork_child();
    if (child == 0) {  /* blocked until the parent's last step */
        struct msg m;
        if (msgrcv(queue, &m, sizeof(m.text), 99, 0) < 0)  /* never EINTR for a checkpoint */
            _exit(2);
        _exit(strcmp(m.text, "bye") ? 3 : 0);
    }
}

static void msg_check(int step)
{
    struct msqid_ds ds;
    CHECK(msgctl(queue, IPC_STAT, &ds) == 0, "queue %d is gone", queue);
    CHECK(ds.msg_qnum == (msgqnum_t)nmodel && ds.msg_qbytes == 3000 && (ds.msg_perm.mode & 0777) == 0620,
          "queue holds %lu messages, qbytes %lu, mode %o", (unsigned long)ds.msg_qnum, (unsigned long)ds.msg_qbytes,
          ds.msg_perm.mode);
    char text[32];
    snprintf(text, sizeof(text), "step %d", step);
    model_send(step % 3 + 1, text);
    model_receive(step % 4 == 0 ? 2 : 0);
    if (step == nsteps) {
        struct msg bye = {99, "bye"};
        CHECK(msgsnd(queue, &bye, 4, 0) == 0, "msgsnd");  /* the child takes it */
        int status;
        CHECK(waitpid(child, &status, 0) == child && status == 0, "child status %d", status);
        while (nmodel)
            model_receive(0);
        msgctl(queue, IPC_RMID, 0);
    }
}

/* ---- removed while attached ---- */

static int removed;

static void rmid_setup(void)
{
    removed = shmget(IPC_PRIVATE, PAGE, 0600);
    CHECK(removed >= 0, "shmget");
    rw = shmat(removed, 0, 0);
    CHECK(rw != (void *)-1 && shmctl(removed, IPC_RMID, 0) == 0, "shmat, IPC_RMID");
    rw[5] = 1234;
}

static void rmid_check(int step)
{
    struct shmid_ds ds;
    CHECK(shmctl(removed, IPC_STAT, &ds) == 0, "removed segment %d is gone", removed);
    CHECK((ds.shm_perm.mode & SHM_DEST) && ds.shm_nattch == 1, "segment mode %o, attached %lu times",
          ds.shm_perm.mode, (unsigned long)ds.shm_nattch);
    CHECK(rw[5] == 1234 + step - 1, "segment holds %d", rw[5]);
    rw[5]++;
    if (step == nsteps) {
        CHECK(shmdt((void *)rw) == 0, "shmdt");
        CHECK(shmctl(removed, IPC_STAT, &ds) < 0 && errno == EINVAL, "the removed segment outlived its last detach");
    }
}

static void nothing(int step) { (void)step; }

int main(int argc, char **argv)
{
    nsteps = steps_of(argc, argv);
    const char *what = argc > 2 ? argv[2] : "shm";
    void (*check)(int) = nothing;
    if (!strcmp(what, "shm")) {
        shm_setup();
        check = shm_check;
    } else if (!strcmp(what, "sem")) {
        sem_setup();
        check = sem_check;
    } else if (!strcmp(what, "undo") || !strcmp(what, "setval")) {
        undo_setup(!strcmp(what, "setval"));
        check = undo_check;
    } else if (!strcmp(what, "exec")) {
        sems = semget(IPC_PRIVATE, 1, 0600);
        struct sembuf up = {0, 1, SEM_UNDO};
        CHECK(sems >= 0 && semop(sems, &up, 1) == 0, "semget, semop SEM_UNDO");
        execl("/proc/self/exe", argv[0], argv[1], "after-exec", (char *)0);
        CHECK(0, "exec");
    } else if (!strcmp(what, "after-exec")) {
        check = nothing;
    } else if (!strcmp(what, "msg")) {
        msg_setup();
        check = msg_check;
    } else if (!strcmp(what, "rmid")) {
        rmid_setup();
        check = rmid_check;
    } else {
        CHECK(0, "unknown case %s", what);
    }
    int rc = run_steps(nsteps, check);
    if (child > 0)
        kill(child, SIGKILL);
    for (int i = 0; i < 2; i++)
        if (undoer[i] > 0)
            kill(undoer[i], SIGKILL);
    return rc;
}
