/*
 * ckptd-init: the root of one incarnation of a job.
 *
 *   ckptd-init --log FILE --index FILE --control SOCKET --exit-file FILE
 *              [--userns] [--restore] [--netns PATH] [--hostname NAME]
 *              [--hosts FILE] [--user UID --group GID --groups G,G...]
 *              -- PROGRAM [ARGS...]
 *
 * Three processes, so that the job's pids are its own and its output
 * outlives the agent:
 *
 *   relay (this process, host pid namespace): owns the read ends of the
 *     job's stdout/stderr pipes and appends everything to the job's log
 *     (FILE) plus an index of (offset, length, stream) records, so readers
 *     can separate the streams again.  Answers DRAIN on the control socket
 *     during a checkpoint: empties the pipes and reports the log's size,
 *     which the checkpoint records.  Writes the job's exit status to
 *     the exit file when it ends.
 *   reaper (pid 1 of a fresh pid namespace, own mount namespace with its
 *     own /proc): reaps orphans; when the job's main process exits it
 *     reports the wait status to the relay and exits, which ends the
 *     namespace.
 *   job (pid 2): stdin /dev/null, stdout and stderr to the relay, its own
 *     session; execs PROGRAM.  On restore PROGRAM is ckptd-restore, which
 *     needs pid 2 again and, without root, the capabilities to recreate
 *     thread ids, which --restore passes on as ambient capabilities.
 *
 * --userns (non-root): a user namespace mapping only the caller's own uid
 * and gid, which is what makes the pid namespace possible without root.
 *
 * --user, --group, --groups (a root agent running a job of another user,
 * agent/owner.py): right after joining the rank's namespaces, before it
 * opens anything, ckptd-init becomes that user (groups, gid, uid: every
 * capability goes) and goes on as that user's own daemon would have
 * started it, with --userns.
 *
 * --netns PATH, --hostname NAME (a rank of a multi-node job): the whole
 * incarnation joins the rank's network namespace, which the agent made with
 * the rank's own address, and gets its own UTS namespace with the rank's
 * stable host name, so both survive a restart on another node.  --hosts
 * FILE is mounted over /etc/hosts in the job's mount namespace: every
 * rank's host name resolves to its address (gloo and NCCL look their own
 * host name up to choose the interface they listen on).
 *
 * Statically linked, so the shim in LD_PRELOAD never loads into it.
 */
#include <errno.h>
#include <fcntl.h>
#include <grp.h>
#include <poll.h>
#include <sched.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <linux/capability.h>
#include <sys/syscall.h>
#include <sys/mount.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <unistd.h>

#ifndef CAP_CHECKPOINT_RESTORE
#define CAP_CHECKPOINT_RESTORE 40
#endif

struct options {
    const char *log, *index, *control, *exit_file, *netns, *hostname, *hosts;
    int userns, restore;
    int keep_fd;           /* --keep-fd: one descriptor the program inherits (the restorer's key), else -1 */
    int drop;              /* --user given */
    uid_t uid;
    gid_t gid;
    int ngroups;
    gid_t groups[64];
    char **argv;
};

struct index_record {
    uint64_t offset;
    uint32_t length;
    uint32_t stream;   /* 1 stdout, 2 stderr */
};

static void die(const char *what)
{
    fprintf(stderr, "ckptd-init: %s: %s\n", what, strerror(errno));
    exit(125);
}

static void usage(void)
{
    fprintf(stderr, "usage: ckptd-init --log FILE --index FILE --control SOCKET --exit-file FILE "
                    "[--userns] [--restore] [--netns PATH] [--hostname NAME] [--hosts FILE] "
                    "[--user UID --group GID --groups G,G...] -- PROGRAM [ARGS...]\n");
    exit(125);
}

static unsigned long parse_id(const char *s)
{
    char *end;
    errno = 0;
    unsigned long v = strtoul(s, &end, 10);
    if (errno || end == s || *end || v >= 0xFFFFFFFFul)
        usage();
    return v;
}

static void parse_groups(const char *list, struct options *o)
{
    char buf[1024], *save = NULL;
    if (strlen(list) >= sizeof(buf))
        usage();
    strcpy(buf, list);
    o->ngroups = 0;
    for (char *t = strtok_r(buf, ",", &save); t; t = strtok_r(NULL, ",", &save)) {
        if (o->ngroups >= (int)(sizeof(o->groups) / sizeof(o->groups[0])))
            usage();
        o->groups[o->ngroups++] = (gid_t)parse_id(t);
    }
}

static void parse(int argc, char **argv, struct options *o)
{
    memset(o, 0, sizeof(*o));
    o->keep_fd = -1;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        if (!strcmp(a, "--")) {
            o->argv = argv + i + 1;
            break;
        } else if (!strcmp(a, "--userns")) {
            o->userns = 1;
        } else if (!strcmp(a, "--restore")) {
            o->restore = 1;
        } else if (i + 1 < argc && !strcmp(a, "--keep-fd")) {
            o->keep_fd = (int)parse_id(argv[++i]);
            if (o->keep_fd < 3)
                usage();
        } else if (i + 1 < argc && !strcmp(a, "--log")) {
            o->log = argv[++i];
        } else if (i + 1 < argc && !strcmp(a, "--index")) {
            o->index = argv[++i];
        } else if (i + 1 < argc && !strcmp(a, "--control")) {
            o->control = argv[++i];
        } else if (i + 1 < argc && !strcmp(a, "--exit-file")) {
            o->exit_file = argv[++i];
        } else if (i + 1 < argc && !strcmp(a, "--netns")) {
            o->netns = argv[++i];
        } else if (i + 1 < argc && !strcmp(a, "--hostname")) {
            o->hostname = argv[++i];
        } else if (i + 1 < argc && !strcmp(a, "--hosts")) {
            o->hosts = argv[++i];
        } else if (i + 1 < argc && !strcmp(a, "--user")) {
            o->drop = 1;
            o->uid = (uid_t)parse_id(argv[++i]);
        } else if (i + 1 < argc && !strcmp(a, "--group")) {
            o->gid = (gid_t)parse_id(argv[++i]);
        } else if (i + 1 < argc && !strcmp(a, "--groups")) {
            parse_groups(argv[++i], o);
        } else {
            usage();
        }
    }
    if (!o->log || !o->index || !o->control || !o->exit_file || !o->argv || !o->argv[0])
        usage();
    if (o->drop && (o->uid == 0 || o->gid == 0 || o->ngroups == 0))
        usage();  /* --user is for dropping root, with --group and --groups */
}

static int write_all(int fd, const void *p, size_t n)
{
    const char *c = p;
    while (n) {
        ssize_t w = write(fd, c, n);
        if (w < 0 && errno == EINTR)
            continue;
        if (w <= 0)
            return -1;
        c += w;
        n -= (size_t)w;
    }
    return 0;
}

static void write_proc_file(const char *path, const char *text)
{
    int fd = open(path, O_WRONLY | O_CLOEXEC);
    if (fd < 0)
        die(path);
    if (write_all(fd, text, strlen(text)) < 0)
        die(path);
    if (close(fd) < 0)
        die(path);
}

/* the rank's network namespace and host name (before the user namespace:
 * joining a network namespace needs the host's CAP_SYS_ADMIN) */
static void enter_rank_namespaces(const struct options *o)
{
    if (o->netns) {
        int fd = open(o->netns, O_RDONLY | O_CLOEXEC);
        if (fd < 0)
            die(o->netns);
        if (setns(fd, CLONE_NEWNET) < 0)
            die("setns (the rank's network namespace)");
        if (close(fd) < 0)
            die("close");
    }
    if (o->hostname) {
        if (unshare(CLONE_NEWUTS) < 0)
            die("unshare (UTS namespace)");
        if (sethostname(o->hostname, strlen(o->hostname)) < 0)
            die("sethostname");
    }
}

/* --user: become the job's owner for good (no way back to root, no
 * capability left) before anything is opened; dumpable again, so that the
 * user namespace's maps can be written */
static void drop_privileges(const struct options *o)
{
    if (!o->drop)
        return;
    if (setgroups((size_t)o->ngroups, o->groups) < 0)
        die("setgroups (the job's owner's groups)");
    if (setresgid(o->gid, o->gid, o->gid) < 0)
        die("setresgid (the job's owner's group)");
    if (setresuid(o->uid, o->uid, o->uid) < 0)
        die("setresuid (the job's owner)");
    if (setresuid(0, 0, 0) == 0 || geteuid() != o->uid) {
        fprintf(stderr, "ckptd-init: could not drop root for uid %u\n", (unsigned)o->uid);
        exit(125);
    }
    if (prctl(PR_SET_DUMPABLE, 1, 0, 0, 0) < 0)
        die("prctl(PR_SET_DUMPABLE)");
    if (access(".", X_OK) < 0)
        die("the job's working directory (as its owner)");
}

static void enter_namespaces(const struct options *o)
{
    uid_t uid = getuid();
    gid_t gid = getgid();
    int flags = CLONE_NEWPID | CLONE_NEWNS;
    /* as root, an IPC namespace too: its System V objects are the job's
     * alone, saved whole at a checkpoint and made again under their ids
     * (agent/sysv_ipc.py, restorer/plan_sysv.c), which needs root's right
     * to choose the next id; a job in a user namespace shares the host's
     * and ckptd refuses its System V shared memory (plan/sysv.py) */
    if (o->userns)
        flags |= CLONE_NEWUSER;
    else
        flags |= CLONE_NEWIPC;
    if (unshare(flags) < 0)
        die(o->userns ? "cannot create user/pid/mount namespaces (unprivileged user namespaces disabled?)"
                      : "cannot create pid/mount/IPC namespaces");
    if (o->userns) {
        char map[64];
        write_proc_file("/proc/self/setgroups", "deny");
        snprintf(map, sizeof(map), "%u %u 1\n", (unsigned)uid, (unsigned)uid);
        write_proc_file("/proc/self/uid_map", map);
        snprintf(map, sizeof(map), "%u %u 1\n", (unsigned)gid, (unsigned)gid);
        write_proc_file("/proc/self/gid_map", map);
    }
}

/* ---- the job (pid 2) ---- */

static void raise_ambient(int cap)
{
    struct __user_cap_header_struct h = {_LINUX_CAPABILITY_VERSION_3, 0};
    struct __user_cap_data_struct d[2];
    if (syscall(SYS_capget, &h, d) < 0)
        die("capget");
    d[cap / 32].inheritable |= 1u << (cap % 32);
    if (syscall(SYS_capset, &h, d) < 0)
        die("cannot make a capability inheritable");
    if (prctl(PR_CAP_AMBIENT, PR_CAP_AMBIENT_RAISE, cap, 0, 0) < 0)
        die("cannot raise an ambient capability");
}

static void run_job(const struct options *o, int out_w, int err_w)
{
    int devnull = open("/dev/null", O_RDONLY);
    if (devnull < 0)
        die("/dev/null");
    if (dup2(devnull, 0) < 0 || dup2(out_w, 1) < 0 || dup2(err_w, 2) < 0)
        die("dup2");
    if (o->keep_fd >= 3) {  /* launch --encrypt: the key's memfd, which the restorer reads and closes */
        if (o->keep_fd > 3)
            close_range(3, (unsigned)o->keep_fd - 1, 0);
        closefrom(o->keep_fd + 1);
    } else {
        closefrom(3);
    }
    if (setsid() < 0)
        die("setsid");
    sigset_t none;
    sigemptyset(&none);
    sigprocmask(SIG_SETMASK, &none, NULL);
    for (int s = 1; s < NSIG; s++)
        signal(s, SIG_DFL);
    if (o->restore && o->userns) {
        /* rebuilding thread ids and /proc/self/exe needs these in the
         * namespace; the restorer drops them before the job runs */
        raise_ambient(CAP_SYS_ADMIN);
        raise_ambient(CAP_CHECKPOINT_RESTORE);
    }
    execvp(o->argv[0], o->argv);
    fprintf(stderr, "ckptd: cannot run %s: %s\n", o->argv[0], strerror(errno));
    _exit(errno == ENOENT ? 127 : 126);
}

/* ---- the reaper (pid 1) ---- */

/*
 * The job's own pseudo-terminals: a devpts instance of its own at
 * /dev/pts, so that their numbers start at 0 and a restart can give each
 * pair its number again (native/restorer/plan_pty.c).  /dev/ptmx, a device
 * node or a link to pts/ptmx, finds the instance at pts beside it.  Its
 * source, "ckptd-devpts", is how the shim knows it (dump_pty.c).  Where it
 * cannot be mounted (no /dev/pts), the job's ptys are refused at checkpoint.
 */
static void mount_devpts(const struct options *o)
{
    /* gid 5 (tty) as the host's instance has it; a user namespace maps no such group */
    const char *opts = o->userns ? "newinstance,ptmxmode=0666,mode=0620" : "newinstance,ptmxmode=0666,mode=0620,gid=5";
    if (mount("ckptd-devpts", "/dev/pts", "devpts", MS_NOSUID | MS_NOEXEC, opts) < 0) {
        /* the job runs on; a checkpoint refuses its ptys */
    }
}

static void run_reaper(const struct options *o, int out_w, int err_w, int status_w)
{
    char msg[64];
    if (mount(NULL, "/", NULL, MS_REC | MS_PRIVATE, NULL) < 0)
        die("cannot make mounts private");
    if (mount("proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC, NULL) < 0)
        die("cannot mount /proc for the job's pid namespace");
    if (o->hosts && mount(o->hosts, "/etc/hosts", NULL, MS_BIND, NULL) < 0)
        die("cannot mount the ranks' hosts file over /etc/hosts");
    mount_devpts(o);
    pid_t job = fork();
    if (job < 0)
        die("fork");
    if (job == 0) {
        close(status_w);
        run_job(o, out_w, err_w);
    }
    close(out_w);
    close(err_w);
    if (o->keep_fd >= 3)
        close(o->keep_fd);
    for (;;) {
        int st;
        pid_t p = wait(&st);
        if (p < 0 && errno == EINTR)
            continue;
        if (p < 0)
            die("wait");
        if (p == job) {
            snprintf(msg, sizeof(msg), "EXIT %d\n", st);
            write_all(status_w, msg, strlen(msg));
            _exit(0);  /* ends the namespace: the kernel kills what is left */
        }
    }
}

/* ---- the relay (host side) ---- */

struct relay {
    int log_fd, index_fd;
    uint64_t log_size, index_size;
    int cut_pending;  /* a failed chunk's written part is still there: no chunk goes after it (cut_back) */
    int pipes[2];     /* read ends: stdout, stderr; -1 at EOF */
    uint64_t pipe_ino[2];  /* their inodes: how a checkpoint recognises them in the job */
};

/* The log and its index back to the sizes of the last whole chunk: 0 while
 * the storage refuses even that (EIO; shrinking needs no space, so a full
 * disk never does), and then it is tried again before each next chunk. */
static int cut_back(struct relay *r)
{
    int log_cut = ftruncate(r->log_fd, (off_t)r->log_size) == 0;
    int index_cut = ftruncate(r->index_fd, (off_t)r->index_size) == 0;
    r->cut_pending = !(log_cut && index_cut);
    return !r->cut_pending;
}

static void relay_chunk(struct relay *r, int stream, const char *buf, size_t n)
{
    struct index_record rec = {r->log_size, (uint32_t)n, (uint32_t)stream};
    /* storage that failed a chunk: the chunks until it takes the cut are lost
     * too, never written after a part of that one (O_APPEND: they would land
     * past bytes no record covers, or after half a record, and every later
     * record would point into the wrong bytes) */
    if (r->cut_pending && !cut_back(r))
        return;
    if (write_all(r->log_fd, buf, n) < 0 || write_all(r->index_fd, &rec, sizeof(rec)) < 0) {
        /* disk full or failing: this chunk is lost, the job goes on, and the
         * log and its index stay one another's image: a part written before
         * the error is cut off again */
        cut_back(r);
        return;
    }
    r->log_size += n;
    r->index_size += sizeof(rec);
}

/* read what is available on one pipe; returns 0 at EOF */
static int relay_pipe(struct relay *r, int which)
{
    char buf[65536];
    for (;;) {
        ssize_t n = read(r->pipes[which], buf, sizeof(buf));
        if (n > 0) {
            relay_chunk(r, which + 1, buf, (size_t)n);
            continue;
        }
        if (n < 0 && errno == EINTR)
            continue;
        if (n < 0 && errno == EAGAIN)
            return 1;
        close(r->pipes[which]);
        r->pipes[which] = -1;
        return 0;
    }
}

static void answer_control(struct relay *r, int client)
{
    char req[64], reply[128];
    ssize_t n = read(client, req, sizeof(req) - 1);
    if (n <= 0)
        return;
    req[n] = 0;
    if (!strncmp(req, "DRAIN", 5)) {
        for (int i = 0; i < 2; i++)
            if (r->pipes[i] >= 0)
                relay_pipe(r, i);
        if (r->cut_pending)
            cut_back(r);  /* the sizes below are the whole chunks': the files too, if the storage lets us */
        /* no fsync here, in every rank's pause: the checkpoint keeps its
         * own copy of both (finalize's copy_prefix, synced with its images),
         * and a restart puts that copy back (agent/rollback.py put_back_log) */
        snprintf(reply, sizeof(reply), "OK log=%llu index=%llu stdout_ino=%llu stderr_ino=%llu\n",
                 (unsigned long long)r->log_size, (unsigned long long)r->index_size,
                 (unsigned long long)r->pipe_ino[0], (unsigned long long)r->pipe_ino[1]);
    } else if (!strncmp(req, "PING", 4)) {
        snprintf(reply, sizeof(reply), "PONG\n");
    } else {
        snprintf(reply, sizeof(reply), "ERROR unknown request\n");
    }
    write_all(client, reply, strlen(reply));
}

static int listen_control(const char *path)
{
    struct sockaddr_un sa;
    memset(&sa, 0, sizeof(sa));
    sa.sun_family = AF_UNIX;
    if (strlen(path) >= sizeof(sa.sun_path)) {
        errno = ENAMETOOLONG;
        die(path);
    }
    strcpy(sa.sun_path, path);
    unlink(path);
    int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd < 0 || bind(fd, (struct sockaddr *)&sa, sizeof(sa)) < 0 || listen(fd, 8) < 0)
        die(path);
    return fd;
}

/* The job's log or index, private to its user.  Never through a symbolic
   link, nor into anything but a regular file (a FIFO would block us): the
   checkpoint directory may be shared, and someone may have planted one. */
static int open_append(const char *path, uint64_t *size)
{
    int fd = open(path, O_WRONLY | O_APPEND | O_CREAT | O_CLOEXEC | O_NOFOLLOW | O_NONBLOCK, 0600);
    struct stat st;
    if (fd < 0 && errno == ELOOP) {
        fprintf(stderr, "ckptd-init: %s is a symbolic link: refusing to write the job's output through it; "
                        "remove it or choose another --job name\n", path);
        exit(125);
    }
    if (fd < 0 || fstat(fd, &st) < 0)
        die(path);
    if (!S_ISREG(st.st_mode)) {
        fprintf(stderr, "ckptd-init: %s is not a regular file: refusing to write the job's output to it; "
                        "remove it or choose another --job name\n", path);
        exit(125);
    }
    if (fcntl(fd, F_SETFL, O_APPEND) < 0)
        die(path);
    if ((st.st_mode & 077) && st.st_uid == geteuid() && fchmod(fd, 0600) < 0)
        die(path);
    *size = (uint64_t)st.st_size;
    return fd;
}

/* The reaper's "EXIT <wait status>" line; 0 when the pipe holds none (EOF:
   the reaper died without writing one). */
static int read_exit_message(int fd, int *status)
{
    char msg[64];
    ssize_t m;
    do
        m = read(fd, msg, sizeof(msg) - 1);
    while (m < 0 && errno == EINTR);
    if (m <= 0)
        return 0;
    msg[m] = 0;
    return sscanf(msg, "EXIT %d", status) == 1;
}

static void write_exit_file(const char *path, int status)
{
    char tmp[4200], text[128];
    if (WIFSIGNALED(status))
        snprintf(text, sizeof(text), "{\"signal\": %d}\n", WTERMSIG(status));
    else
        snprintf(text, sizeof(text), "{\"exit_code\": %d}\n", WEXITSTATUS(status));
    snprintf(tmp, sizeof(tmp), "%s.tmp", path);
    int fd = open(tmp, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC | O_NOFOLLOW, 0600);
    if (fd < 0)
        return;
    int ok = write_all(fd, text, strlen(text)) == 0 && fsync(fd) == 0;
    if (close(fd) == 0 && ok)
        rename(tmp, path);
}

int main(int argc, char **argv)
{
    struct options o;
    struct relay r;
    int out[2], err[2], st[2];

    parse(argc, argv, &o);
    signal(SIGPIPE, SIG_IGN);
    signal(SIGHUP, SIG_IGN);
    /* the relay (and the reaper it forks) are ckptd's, not the job's: a batch
     * system signalling every process of a job (Slurm's scancel, requeue)
     * must not cut the job's output while its final checkpoint is taken.
     * The agent ends them with SIGKILL; the job itself starts with every
     * signal at SIG_DFL (run_job). */
    signal(SIGTERM, SIG_IGN);
    signal(SIGINT, SIG_IGN);
    signal(SIGQUIT, SIG_IGN);
    signal(SIGUSR1, SIG_IGN);
    signal(SIGUSR2, SIG_IGN);
    enter_rank_namespaces(&o);  /* the host's CAP_SYS_ADMIN: before dropping it */
    drop_privileges(&o);
    unlink(o.exit_file);
    r.log_fd = open_append(o.log, &r.log_size);
    r.index_fd = open_append(o.index, &r.index_size);
    r.cut_pending = 0;
    int ctl = listen_control(o.control);
    if (pipe2(out, O_CLOEXEC) < 0 || pipe2(err, O_CLOEXEC) < 0 || pipe2(st, O_CLOEXEC) < 0)
        die("pipe");
    enter_namespaces(&o);

    pid_t reaper = fork();
    if (reaper < 0)
        die("fork");
    if (reaper == 0) {
        /* a relay killed (kill -9) takes its pid namespace with it: a reaper
         * and a job (a restore's parked processes) nobody tracks any more
         * must not live on; the reaper's death kills every process of it.
         * (From pid 1 of a new namespace getppid() says 0: a relay dead
         * before this line is not seen; that window is a few instructions.) */
        prctl(PR_SET_PDEATHSIG, SIGKILL, 0, 0, 0);
        close(out[0]);
        close(err[0]);
        close(st[0]);
        close(ctl);
        /* the job's ends must survive exec in pid 2; drop CLOEXEC there */
        run_reaper(&o, out[1], err[1], st[1]);
    }
    close(out[1]);
    close(err[1]);
    close(st[1]);
    if (o.keep_fd >= 3)
        close(o.keep_fd);  /* the relay has no use for it */
    r.pipes[0] = out[0];
    r.pipes[1] = err[0];
    for (int i = 0; i < 2; i++) {
        struct stat pst;
        if (fstat(r.pipes[i], &pst) < 0)
            die("fstat");
        r.pipe_ino[i] = (uint64_t)pst.st_ino;
    }
    fcntl(out[0], F_SETFL, O_NONBLOCK);
    fcntl(err[0], F_SETFL, O_NONBLOCK);

    int status = -1, have_status = 0, reaper_done = 0;
    for (;;) {
        struct pollfd pfd[4];
        int n = 0;
        pfd[n++] = (struct pollfd){ctl, POLLIN, 0};
        pfd[n++] = (struct pollfd){have_status ? -1 : st[0], POLLIN, 0};
        pfd[n++] = (struct pollfd){r.pipes[0], POLLIN, 0};
        pfd[n++] = (struct pollfd){r.pipes[1], POLLIN, 0};
        int rc = poll(pfd, (nfds_t)n, 200);
        if (rc < 0 && errno != EINTR)
            die("poll");
        if (rc > 0) {
            if (pfd[0].revents & POLLIN) {
                int client = accept4(ctl, NULL, NULL, SOCK_CLOEXEC);
                if (client >= 0) {
                    answer_control(&r, client);
                    close(client);
                }
            }
            if (pfd[1].revents) {
                have_status = read_exit_message(st[0], &status);
                if (!have_status) {
                    close(st[0]);
                    st[0] = -1;
                }
            }
            for (int i = 0; i < 2; i++)
                if (pfd[2 + i].revents && r.pipes[i] >= 0)
                    relay_pipe(&r, i);
        }
        if (!reaper_done) {
            int rs;
            if (waitpid(reaper, &rs, WNOHANG) == reaper) {
                reaper_done = 1;
                /* the reaper may have written the job's status and exited
                   after this loop's poll: read it before trusting rs */
                if (!have_status && st[0] >= 0)
                    have_status = read_exit_message(st[0], &status);
                if (!have_status)
                    status = rs;  /* the reaper itself died (killed) */
                have_status = 1;
            }
        }
        /* done once the reaper is gone and every writer has closed */
        if (reaper_done && r.pipes[0] < 0 && r.pipes[1] < 0)
            break;
    }
    if (r.cut_pending)
        cut_back(&r);  /* the storage may be back: leave the two agreeing */
    write_exit_file(o.exit_file, status);
    close(ctl);
    unlink(o.control);
    if (WIFSIGNALED(status))
        return 128 + WTERMSIG(status);
    return WEXITSTATUS(status);
}
