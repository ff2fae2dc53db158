/*
 * Process and thread attributes that must come back exactly after a restart
 * (tests/test_exact_process.py).  proc_attrs STEPS MODE [ATTR,...]:
 *
 *   attrs     the attributes named (subreaper, pdeathsig, oom, thp, loginuid,
 *             timerslack (two threads), keepcaps, dumpable, nnp, and the
 *             scheduling, each thread its own: nice, cpus (affinity), batch
 *             (the second thread SCHED_BATCH)) are set, the others checked
 *             to stay at their defaults
 *   rseq      glibc's rseq registration (a second rseq() of it answers EBUSY)
 *   rseq-own  the program's own rseq area (run with GLIBC_TUNABLES=glibc.pthread.rseq=0)
 *   creds     a root process dropping privileges: groups, gids, uids, capabilities
 *             (effective, permitted, inheritable, ambient, bounding), with a child
 *             forked after the drop and a second thread
 *   seccomp   a seccomp filter (refused)
 *   sigqueue  signals kept blocked: three instances of an RT signal queued with
 *             values process-wide, a SIGUSR1 with a value and a pthread_kill()ed
 *             SIGPIPE to the second thread, a kill()ed SIGUSR2; taken at the
 *             last step, each with its siginfo, in order
 */
#define _GNU_SOURCE
#include "state_check.h"

#include <linux/capability.h>
#include <linux/filter.h>
#include <linux/seccomp.h>
#include <grp.h>
#include <pthread.h>
#include <sched.h>
#include <sys/resource.h>
#include <signal.h>
#include <stddef.h>
#include <stdint.h>
#include <sys/prctl.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#define RSEQ_SIG 0x53053053u

static const char *mode;

/* ---- attrs ---- */

static long read_long(const char *path)
{
    FILE *f = fopen(path, "r");
    long v = -999999;
    CHECK(f, "open %s", path);
    CHECK(fscanf(f, "%ld", &v) == 1, "read %s", path);
    fclose(f);
    return v;
}

static void write_long(const char *path, long v)
{
    FILE *f = fopen(path, "w");
    CHECK(f, "open %s for writing", path);
    fprintf(f, "%ld", v);
    CHECK(fclose(f) == 0, "write %s", path);
}

static const char *attrs = "";  /* argv[3]: the attributes to set, comma-separated */

static int has(const char *name)
{
    size_t n = strlen(name);
    for (const char *p = attrs; (p = strstr(p, name)); p += n)
        if ((p == attrs || p[-1] == ',') && (p[n] == ',' || !p[n]))
            return 1;
    return 0;
}

/* the second thread answers for itself: its own timer slack, no_new_privs and ids */
static volatile int ask, answered;
static volatile long answer_slack, answer_nnp, answer_nice, answer_policy, answer_cpus;
static volatile uid_t answer_uid[3];

/* the CPUs each thread binds itself to (cpus): the main thread the last
 * one it may use, the second thread the first */
static cpu_set_t main_cpus, helper_cpus;
static long base_nice, base_policy;  /* what the program started with */

static void choose_cpus(void)
{
    cpu_set_t all;
    CHECK(sched_getaffinity(0, sizeof(all), &all) == 0, "sched_getaffinity");
    int first = -1, last = -1;
    for (int c = 0; c < CPU_SETSIZE; c++)
        if (CPU_ISSET(c, &all)) {
            if (first < 0)
                first = c;
            last = c;
        }
    CPU_ZERO(&main_cpus);
    CPU_SET(last, &main_cpus);
    CPU_ZERO(&helper_cpus);
    CPU_SET(first, &helper_cpus);
}

static int on_cpus(const cpu_set_t *want)
{
    cpu_set_t now;
    return sched_getaffinity(0, sizeof(now), &now) == 0 && CPU_EQUAL(&now, want);
}

static void *helper(void *arg)
{
    (void)arg;
    if (has("timerslack"))
        CHECK(prctl(PR_SET_TIMERSLACK, 2345678UL, 0, 0, 0) == 0, "PR_SET_TIMERSLACK (thread)");
    if (has("nice"))
        CHECK(setpriority(PRIO_PROCESS, 0, 7) == 0, "setpriority (thread)");
    if (has("cpus"))
        CHECK(sched_setaffinity(0, sizeof(helper_cpus), &helper_cpus) == 0, "sched_setaffinity (thread)");
    if (has("batch")) {
        struct sched_param none = {0};
        CHECK(sched_setscheduler(0, SCHED_BATCH, &none) == 0, "SCHED_BATCH (thread)");
    }
    for (;;) {
        int want = __atomic_load_n(&ask, __ATOMIC_ACQUIRE);
        if (want == -1 && answered != -1) {
            sigset_t one;
            siginfo_t si;
            struct timespec zero = {0, 0};
            sigemptyset(&one);
            sigaddset(&one, SIGUSR1);
            answer_slack = sigtimedwait(&one, &si, &zero) == SIGUSR1 && si.si_code == SI_QUEUE && si.si_pid == getpid()
                               ? si.si_value.sival_int
                               : -1;
            sigemptyset(&one);
            sigaddset(&one, SIGPIPE);
            if (sigtimedwait(&one, &si, &zero) != SIGPIPE || si.si_pid != getpid())
                answer_slack = -2;
            answer_nnp = si.si_code;  /* printed: the same as without a restart */
            __atomic_store_n(&answered, want, __ATOMIC_RELEASE);
        } else if (want != answered) {
            uid_t r, e, s;
            getresuid(&r, &e, &s);
            answer_uid[0] = r, answer_uid[1] = e, answer_uid[2] = s;
            answer_slack = prctl(PR_GET_TIMERSLACK, 0, 0, 0, 0);
            answer_nnp = prctl(PR_GET_NO_NEW_PRIVS, 0, 0, 0, 0);
            errno = 0;
            answer_nice = getpriority(PRIO_PROCESS, 0);
            answer_policy = sched_getscheduler(0);
            answer_cpus = has("cpus") ? on_cpus(&helper_cpus) : 1;
            __atomic_store_n(&answered, want, __ATOMIC_RELEASE);
        }
        step_sleep_ms(5);
    }
    return 0;
}

static void ask_helper(int step)
{
    __atomic_store_n(&ask, step, __ATOMIC_RELEASE);
    for (int i = 0; i < 2000 && __atomic_load_n(&answered, __ATOMIC_ACQUIRE) != step; i++)
        step_sleep_ms(1);
    CHECK(answered == step, "the second thread did not answer");
}

static void setup_attrs(void)
{
    if (has("subreaper"))
        CHECK(prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0, "PR_SET_CHILD_SUBREAPER");
    if (has("pdeathsig"))
        CHECK(prctl(PR_SET_PDEATHSIG, SIGUSR2, 0, 0, 0) == 0, "PR_SET_PDEATHSIG");
    if (has("oom"))
        write_long("/proc/self/oom_score_adj", 321);
    if (has("thp"))
        CHECK(prctl(PR_SET_THP_DISABLE, 1, 0, 0, 0) == 0, "PR_SET_THP_DISABLE");
    if (has("loginuid"))
        write_long("/proc/self/loginuid", 4242);
    if (has("timerslack"))
        CHECK(prctl(PR_SET_TIMERSLACK, 1234567UL, 0, 0, 0) == 0, "PR_SET_TIMERSLACK");
    if (has("keepcaps"))
        CHECK(prctl(PR_SET_KEEPCAPS, 1, 0, 0, 0) == 0, "PR_SET_KEEPCAPS");
    if (has("dumpable"))
        CHECK(prctl(PR_SET_DUMPABLE, 0, 0, 0, 0) == 0, "PR_SET_DUMPABLE");
    if (has("nnp"))
        CHECK(prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) == 0, "PR_SET_NO_NEW_PRIVS");
    errno = 0;
    base_nice = getpriority(PRIO_PROCESS, 0);
    base_policy = sched_getscheduler(0);
    if (has("nice"))
        CHECK(setpriority(PRIO_PROCESS, 0, 3) == 0, "setpriority");
    choose_cpus();
    if (has("cpus"))
        CHECK(sched_setaffinity(0, sizeof(main_cpus), &main_cpus) == 0, "sched_setaffinity");
}

static void check_attrs(int step)
{
    int v = -1;
    CHECK(prctl(PR_GET_CHILD_SUBREAPER, &v, 0, 0, 0) == 0 && v == has("subreaper"), "child subreaper is %d", v);
    v = -1;
    int sig = has("pdeathsig") ? SIGUSR2 : 0;
    CHECK(prctl(PR_GET_PDEATHSIG, &v, 0, 0, 0) == 0 && v == sig, "parent-death signal is %d", v);
    if (has("oom")) {
        long oom = read_long("/proc/self/oom_score_adj");
        CHECK(oom == 321, "oom_score_adj is %ld", oom);
    }
    long thp = prctl(PR_GET_THP_DISABLE, 0, 0, 0, 0);
    CHECK(thp == has("thp"), "THP-disable is %ld", thp);
    if (has("loginuid")) {
        long login = read_long("/proc/self/loginuid");
        CHECK(login == 4242, "loginuid is %ld", login);
    }
    if (has("timerslack")) {
        long slack = prctl(PR_GET_TIMERSLACK, 0, 0, 0, 0);
        CHECK(slack == 1234567, "timer slack is %ld", slack);
    }
    long keep = prctl(PR_GET_KEEPCAPS, 0, 0, 0, 0);
    CHECK(keep == has("keepcaps"), "keep-caps is %ld", keep);
    long dumpable = prctl(PR_GET_DUMPABLE, 0, 0, 0, 0);
    CHECK(dumpable == !has("dumpable"), "dumpable is %ld", dumpable);
    long nnp = prctl(PR_GET_NO_NEW_PRIVS, 0, 0, 0, 0);
    CHECK(nnp == has("nnp"), "no_new_privs is %ld", nnp);
    errno = 0;
    long nice = getpriority(PRIO_PROCESS, 0);
    CHECK(nice == (has("nice") ? 3 : base_nice), "nice is %ld", nice);
    CHECK(sched_getscheduler(0) == base_policy, "the scheduling policy is %d", sched_getscheduler(0));
    if (has("cpus"))
        CHECK(on_cpus(&main_cpus), "the thread is not bound to its CPU");
    ask_helper(step);
    CHECK(answer_nice == (has("nice") ? 7 : base_nice), "the second thread's nice is %ld", answer_nice);
    CHECK(answer_policy == (has("batch") ? SCHED_BATCH : base_policy), "the second thread's policy is %ld", answer_policy);
    CHECK(answer_cpus, "the second thread is not bound to its CPU");
    if (has("timerslack"))
        CHECK(answer_slack == 2345678, "the second thread's timer slack is %ld", answer_slack);
    CHECK(answer_nnp == has("nnp"), "the second thread's no_new_privs is %ld", answer_nnp);
}

/* ---- rseq ---- */

extern const ptrdiff_t __rseq_offset;
extern const unsigned int __rseq_size;

static struct {
    uint32_t cpu_id_start, cpu_id;
    uint64_t rseq_cs;
    uint32_t flags, node_id, mm_cid, pad;
} own_area __attribute__((aligned(32)));

static uint32_t glibc_len;  /* the length glibc registered, found at the start */

static void *glibc_area(void)
{
    return (char *)__builtin_thread_pointer() + __rseq_offset;
}

static void setup_rseq(void)
{
    if (!strcmp(mode, "rseq-own")) {
        CHECK(__rseq_size == 0, "glibc registered rseq (run with GLIBC_TUNABLES=glibc.pthread.rseq=0)");
        CHECK(syscall(SYS_rseq, &own_area, sizeof(own_area), 0, RSEQ_SIG) == 0, "rseq register");
        return;
    }
    CHECK(__rseq_size > 0, "glibc did not register rseq");
    for (uint32_t len = 20; len <= 64 && !glibc_len; len += 4)
        if (syscall(SYS_rseq, glibc_area(), len, 0, RSEQ_SIG) < 0 && errno == EBUSY)
            glibc_len = len;
    CHECK(glibc_len, "cannot find glibc's rseq registration");
}

static void check_rseq(int step)
{
    (void)step;
    void *area = !strcmp(mode, "rseq-own") ? (void *)&own_area : glibc_area();
    uint32_t len = !strcmp(mode, "rseq-own") ? sizeof(own_area) : glibc_len;
    errno = 0;
    long rc = syscall(SYS_rseq, area, len, 0, RSEQ_SIG);
    CHECK(rc < 0 && errno == EBUSY, "a second rseq() of the registration answers %ld", rc);
    int cpu = ((volatile int32_t *)area)[1];
    CHECK(cpu >= 0, "rseq cpu_id is %d", cpu);
}

/* ---- creds ---- */

static const gid_t groups[] = {4, 27, 100};
static pid_t child;

static uint32_t caps[3][2];  /* effective, permitted, inheritable as set up */

static void read_caps(uint32_t out[3][2])
{
    struct __user_cap_header_struct h = {_LINUX_CAPABILITY_VERSION_3, 0};
    struct __user_cap_data_struct d[2];
    CHECK(syscall(SYS_capget, &h, d) == 0, "capget");
    for (int i = 0; i < 2; i++)
        out[0][i] = d[i].effective, out[1][i] = d[i].permitted, out[2][i] = d[i].inheritable;
}

static void check_creds_now(const char *who)
{
    uid_t r, e, s;
    gid_t gr, ge, gs, g[16];
    CHECK(getresuid(&r, &e, &s) == 0 && r == 2001 && e == 2002 && s == 0, "%s: uids %d %d %d", who, r, e, s);
    CHECK(getresgid(&gr, &ge, &gs) == 0 && gr == 1001 && ge == 1002 && gs == 1003, "%s: gids %d %d %d", who, gr, ge, gs);
    int n = getgroups(16, g);
    CHECK(n == 3 && g[0] == 4 && g[1] == 27 && g[2] == 100, "%s: %d supplementary groups", who, n);
    uint32_t now[3][2];
    read_caps(now);
    CHECK(!memcmp(now, caps, sizeof(caps)), "%s: capabilities %x/%x/%x, set up %x/%x/%x", who, now[0][0], now[1][0],
          now[2][0], caps[0][0], caps[1][0], caps[2][0]);
    CHECK(prctl(PR_CAP_AMBIENT, PR_CAP_AMBIENT_IS_SET, CAP_NET_BIND_SERVICE, 0, 0) == 1, "%s: ambient capability lost", who);
    CHECK(prctl(PR_CAP_AMBIENT, PR_CAP_AMBIENT_IS_SET, CAP_CHOWN, 0, 0) == 0, "%s: an ambient capability more", who);
    CHECK(prctl(PR_CAPBSET_READ, CAP_SYS_MODULE, 0, 0, 0) == 0, "%s: CAP_SYS_MODULE back in the bounding set", who);
    CHECK(prctl(PR_CAPBSET_READ, CAP_KILL, 0, 0, 0) == 1, "%s: CAP_KILL gone from the bounding set", who);
}

static void setup_creds(void)
{
    CHECK(prctl(PR_CAPBSET_DROP, CAP_SYS_MODULE, 0, 0, 0) == 0, "PR_CAPBSET_DROP");
    CHECK(setgroups(3, groups) == 0, "setgroups");
    CHECK(setresgid(1001, 1002, 1003) == 0, "setresgid");
    CHECK(setresuid(2001, 2002, 0) == 0, "setresuid");  /* saved root: permitted capabilities stay */
    struct __user_cap_header_struct h = {_LINUX_CAPABILITY_VERSION_3, 0};
    struct __user_cap_data_struct d[2];
    CHECK(syscall(SYS_capget, &h, d) == 0, "capget");
    d[0].effective = 1u << CAP_CHOWN;
    d[0].inheritable = 1u << CAP_NET_BIND_SERVICE;
    d[1].effective = d[1].inheritable = 0;
    CHECK(syscall(SYS_capset, &h, d) == 0, "capset");
    CHECK(prctl(PR_CAP_AMBIENT, PR_CAP_AMBIENT_RAISE, CAP_NET_BIND_SERVICE, 0, 0) == 0, "ambient raise");
    read_caps(caps);
    child = fork();
    CHECK(child >= 0, "fork");
    if (child == 0) {  /* a process of the job that starts as uid 2001 */
        for (;;)
            pause();
    }
}

static void check_creds(int step)
{
    check_creds_now("main thread");
    ask_helper(step);
    CHECK(answer_uid[0] == 2001 && answer_uid[1] == 2002 && answer_uid[2] == 0, "second thread: uids %d %d %d",
          answer_uid[0], answer_uid[1], answer_uid[2]);
    int status;
    CHECK(waitpid(child, &status, WNOHANG) == 0, "the child is gone");
}

/* ---- sigqueue ---- */

static int nsteps;
static pthread_t helper_thread;

static void block_signals(void)
{
    sigset_t set;
    sigemptyset(&set);
    sigaddset(&set, SIGUSR1);
    sigaddset(&set, SIGUSR2);
    sigaddset(&set, SIGPIPE);
    sigaddset(&set, SIGRTMIN + 2);
    CHECK(pthread_sigmask(SIG_BLOCK, &set, 0) == 0, "block");
}

static void check_sigqueue(int step)
{
    if (step == 1) {
        for (int v = 111; v <= 333; v += 111)
            CHECK(sigqueue(getpid(), SIGRTMIN + 2, (union sigval){.sival_int = v}) == 0, "sigqueue");
        CHECK(pthread_sigqueue(helper_thread, SIGUSR1, (union sigval){.sival_int = 444}) == 0, "pthread_sigqueue");
        CHECK(kill(getpid(), SIGUSR2) == 0, "kill");                   /* SI_USER, process-wide */
        CHECK(pthread_kill(helper_thread, SIGPIPE) == 0, "pthread_kill");  /* SI_TKILL, to the thread */
    }
    sigset_t pend;
    sigpending(&pend);
    CHECK(sigismember(&pend, SIGRTMIN + 2) == 1, "the RT signal is no longer pending");
    if (step < nsteps)
        return;
    sigset_t one;
    sigemptyset(&one);
    sigaddset(&one, SIGRTMIN + 2);
    struct timespec zero = {0, 0};
    for (int v = 111; v <= 333; v += 111) {
        siginfo_t si;
        int got = sigtimedwait(&one, &si, &zero);
        CHECK(got == SIGRTMIN + 2, "instance %d of the RT signal is gone", v / 111);
        CHECK(si.si_code == SI_QUEUE && si.si_pid == getpid() && si.si_uid == getuid(),
              "siginfo code %d pid %d uid %d", si.si_code, si.si_pid, si.si_uid);
        CHECK(si.si_value.sival_int == v, "value %d, queued %d", si.si_value.sival_int, v);
    }
    CHECK(sigtimedwait(&one, 0, &zero) < 0 && errno == EAGAIN, "one RT signal more than was queued");
    sigemptyset(&one);
    sigaddset(&one, SIGUSR2);
    siginfo_t si;
    CHECK(sigtimedwait(&one, &si, &zero) == SIGUSR2, "SIGUSR2 is gone");
    CHECK(si.si_pid == getpid() && si.si_uid == getuid(), "SIGUSR2 siginfo pid %d", si.si_pid);
    printf("SIGUSR2 code %d\n", si.si_code);
    ask_helper(-1);
    CHECK(answer_slack == 444, "the second thread's SIGUSR1 has value %ld (-2: its SIGPIPE is gone)", answer_slack);
    printf("SIGPIPE code %ld\n", answer_nnp);
}

/* ---- seccomp ---- */

static void setup_seccomp(void)
{
    struct sock_filter allow[] = {BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_ALLOW)};
    struct sock_fprog prog = {1, allow};
    CHECK(prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) == 0, "PR_SET_NO_NEW_PRIVS");
    CHECK(syscall(SYS_seccomp, SECCOMP_SET_MODE_FILTER, 0, &prog) == 0, "seccomp");
}

static void check_nothing(int step)
{
    (void)step;
}

int main(int argc, char **argv)
{
    int steps = steps_of(argc, argv);
    mode = argc > 2 ? argv[2] : "attrs";
    attrs = argc > 3 ? argv[3] : "";
    void (*check)(int) = check_nothing;
    pthread_t th;
    if (!strcmp(mode, "attrs")) {
        setup_attrs();
        check = check_attrs;
    } else if (!strncmp(mode, "rseq", 4)) {
        setup_rseq();
        check = check_rseq;
    } else if (!strcmp(mode, "creds")) {
        setup_creds();
        check = check_creds;
    } else if (!strcmp(mode, "sigqueue")) {
        block_signals();
        check = check_sigqueue;
    } else if (!strcmp(mode, "seccomp")) {
        setup_seccomp();
    } else {
        CHECK(0, "unknown mode %s", mode);
    }
    CHECK(pthread_create(&th, 0, helper, 0) == 0, "pthread_create");
    helper_thread = th;
    nsteps = steps;
    int rc = run_steps(steps, check);
    if (child > 0) {
        kill(child, SIGKILL);
        waitpid(child, 0, 0);
    }
    return rc;
}
