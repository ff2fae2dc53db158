/*
 * ckptd-restore: rebuilds one process from its image, then jumps into it.
 *
 * A freestanding static-PIE with no libc and no relocations (the build
 * checks), so it can copy itself anywhere.  Phase 1 runs where the kernel
 * loaded it: read the image, check it fits this kernel and CPU, pick a hole
 * that is free both now and in the image's address space, copy itself and
 * the image metadata there.  Phase 2 runs in the hole: unmap everything
 * else, rebuild memory, mm fields, process state, descriptors and threads,
 * then every thread jumps to its saved resume point inside the shim.
 *
 * Nothing before the first jump may fail silently: errors go to the status
 * file the agent reads, and the process exits 1.
 */
#ifndef CKPTD_RESTORER_H
#define CKPTD_RESTORER_H

#include "../common/sealed.h"
#include "../common/sys.h"
#include "../common/util.h"
#include "../common/maps.h"
#include "../include/ckptd/image_format.h"

#define RST_MAX_SPECIAL 4        /* [vvar], [vvar_vclock], [vdso], ... */
#define RST_THREAD_STACK (64u << 10)
#define RST_MAIN_STACK (256u << 10)
#define RST_SCRATCH (4u << 20)

#define RST_MAX_KEYS 8192

/* restore-plan keys: which inherited slot holds a shared object */
#define RST_KEY_PIPE_R 1
#define RST_KEY_PIPE_W 2
#define RST_KEY_FIFO 3
#define RST_KEY_UNIX 4
#define RST_KEY_SHM 5
#define RST_KEY_TCP 6
#define RST_KEY_DESC 7   /* an open file description several processes share: dev = pid, ino = fd */
#define RST_KEY_DELETED 8  /* a deleted file or directory the plan made again (plan_deleted.c) */
#define RST_KEY_DGRAM 9  /* a UDP, ping or raw socket (plan_dgram.c) */
#define RST_KEY_PTY 10     /* a pseudo-terminal's master, by its number (ino; plan_pty.c) */
struct rst_key {
    uint32_t kind;
    uint32_t slot;
    uint64_t dev;
    uint64_t ino;
};

struct rst_special {
    char name[16];
    uint64_t start, end;
};

/* the parsed image: pointers into the core buffer */
struct rst_image {
    const struct ck_header *hdr;
    const struct ck_proc *proc;
    const struct ck_thread *threads;
    uint32_t nthreads;
    const struct ck_vma *vmas;
    uint32_t nvmas;
    const struct ck_page_run *runs;
    uint64_t nruns;
    const struct ck_fd *fds;
    uint32_t nfds;
    const struct ck_epoll_target *epoll;
    uint32_t nepoll;
    const struct ck_sigaction *sigacts;
    const struct ck_rlimit *rlimits;
    const struct ck_pending *pending;
    uint32_t npending;
    const char *strings;
    uint64_t strings_size;
    const uint8_t *blob;
    uint64_t blob_size;
    const uint8_t *auxv;
    uint64_t auxv_size;
    const struct ck_page_source *sources;
    uint64_t nsources;
};

/*
 * Phase-1 results carried into phase 2.  Lives in .bss, which is copied
 * with the program, so it may hold numbers and arrays but no pointers.
 */
struct rst_state {
    char image_dir[1024];
    char agent_socket[108];
    char checkpoint_id[64];
    int status_fd;
    int pages_fd;
    int source_fd[CK_MAX_SOURCES];  /* earlier images' pages.img (incremental images) */
    int stdio_fd[3];             /* inherited stdin/stdout/stderr, moved high */
    int maxfd;                   /* highest descriptor in the image */
    uint64_t core_size;
    uint64_t hole_start, hole_len;
    uint64_t core_off;           /* offsets inside the hole */
    uint64_t stacks_off;
    uint64_t park_off;           /* where the vdso waits while memory is rebuilt */
    uint64_t scratch_off;
    struct rst_special cur_special[RST_MAX_SPECIAL];
    int ncur_special;
    int uid_is_root;
    /* restart --lazy (lazy.c) */
    int lazy;                    /* map large mappings empty, filled on demand */
    int lazy_uffd;               /* the userfaultfd they are registered with, or -1 */
    int serve_lazy;              /* this run is the pager: --serve-lazy DIR --uffd N */
    long fill_delay_ms;          /* pager: pause between background copies (tests) */
    int track_uffd;              /* write protection on the restored memory (track.c), or -1 */
    /* the restore plan (plan.c) */
    char plan_path[1024];
    char status_dir[1024];
    char self_path[1024];
    int slot_base, nslots;
    /* encryption at rest (image.c, rst_seal_*): the key read from --key-fd,
     * the sidecars ([0] pages.img.gcm, [i] source i's) loaded into the
     * sealed area: a chunk of scratch, then the sidecars (in the hole) */
    int key_fd;                  /* --key-fd, or -1 */
    int sealed;
    struct ck_gcm_key key;
    uint32_t nside;              /* 1 + the image's sources */
    int side_fd[CK_MAX_SOURCES + 1];
    uint64_t side_len[CK_MAX_SOURCES + 1];
    struct ck_opened opened[CK_MAX_SOURCES + 1];
    uint64_t seal_off;           /* in the hole */
    uint64_t seal_scratch;       /* the area's address (in the hole, which does not move) */
    int nkeys;
    struct rst_key keys[RST_MAX_KEYS];
};

extern struct rst_state rst;

/* this process's mappings before the move (phase 1) */
struct rst_range {
    uint64_t start, end;
};
extern struct rst_range rst_cur_maps[64];
extern int rst_ncur_maps;

/* start.S */
void rst_switch_stack(uint64_t stack_top, void (*fn)(uint64_t), uint64_t arg) __attribute__((noreturn));
long rst_clone3_thread(void *args, uint64_t size, void (*fn)(const struct ck_thread *), const struct ck_thread *t);
void rst_jump_ctx(const struct ck_jmpctx *ctx) __attribute__((noreturn));

/* report.c */
void rst_fail(const char *what, const char *detail, long rc) __attribute__((noreturn));
void rst_note(const char *what, const char *detail, long rc);

/* image.c */
uint8_t *rst_read_file(const char *path, uint64_t *size);  /* whole, NUL-terminated, mmap'd */
/* exactly n bytes at off, or rst_fail(what) */
void rst_pread_all(int fd, void *buf, uint64_t n, uint64_t off, const char *what);
void rst_parse_image(struct rst_image *im, const uint8_t *core, uint64_t size);
const char *rst_str(const struct rst_image *im, uint32_t off);

/* mem.c */
void rst_check_layout(const struct rst_image *im);
uint64_t rst_find_hole(const struct rst_image *im, uint64_t size);
void rst_park_specials(void);
void rst_unmap_all_but_hole(void);
void rst_map_image(const struct rst_image *im);
void rst_place_specials(const struct rst_image *im);
void rst_set_mm(const struct rst_image *im);

/* lazy.c */
int rst_vma_lazy(const struct rst_image *im, const struct ck_vma *v);
/* track.c: write protection on the restored memory (for the shim's ADOPT) */
int rst_track_arm(const struct rst_image *im);
void rst_lazy_open(void);
void rst_lazy_register(const struct ck_vma *v);
void rst_serve_lazy(void) __attribute__((noreturn));

/* main.c: the memory images an image reads its pages from */
void rst_open_pages(const struct rst_image *im);
/* image.c: encryption at rest */
void rst_seal_key(void);                                 /* read --key-fd's key, close it */
void rst_seal_open(const struct rst_image *im);          /* the sidecars, after the pages files */
uint64_t rst_seal_space(void);                           /* bytes the sealed area needs */
void rst_seal_load(uint8_t *area);                       /* sidecars into it, checked */
/* plaintext of pages file i (0: pages.img, i: source i) at off into dst */
void rst_seal_read(uint32_t i, void *dst, uint64_t len, uint64_t off);

/* plan.c (the plan's objects: plan_<kind>.c, through plan.h) */
void rst_load_plan_keys(const char *path);
/* a deleted file (its contents from FILL, -1: none) or removed directory made
 * again at PATH or beside it, and removed again: its descriptor (plan_deleted.c) */
long rst_recreate_deleted(const char *path, uint32_t mode, uint32_t uid, uint32_t gid, long fill, uint64_t size);
/* a timerfd and a signalfd made again (plan_timerfd.c, plan_signalfd.c) */
long rst_make_timerfd(uint32_t clockid, uint32_t flags, uint64_t interval_ns, uint64_t value_ns, uint64_t ticks);
long rst_make_signalfd(uint64_t mask);
/* an inotify instance with f's watches at their numbers (inotify.c) */
int rst_make_inotify(const struct rst_image *im, const struct ck_fd *f);
int rst_slot_for(uint32_t kind, uint64_t dev, uint64_t ino);  /* descriptor, or -1 */
void rst_close_slots(void);
void rst_build(void) __attribute__((noreturn));

/* fds.c */
void rst_restore_fds(const struct rst_image *im);
void rst_restore_fd_owners(const struct rst_image *im);  /* once the threads exist */
void rst_restore_epolls(const struct rst_image *im);  /* epoll.c: once every descriptor is back */
/* plan_shm.c: a shared memory descriptor's mode and (a memfd's) seals, once its mappings are filled */
void rst_shm_mode_and_seals(int fd, const struct ck_fd *f, const char *path);

/* proc.c */
void rst_restore_limits(const struct rst_image *im);
void rst_restore_thp(const struct rst_image *im);
void rst_queue_pending_of(const struct rst_image *im, int tid);
void rst_restore_attrs(const struct rst_image *im);
const uint32_t *rst_groups(const struct rst_image *im);
void rst_restore_dumpable(const struct rst_image *im);
void rst_restore_process(const struct rst_image *im);
void rst_queue_pending(const struct rst_image *im);
void rst_arm_timers(const struct rst_image *im);
/* timers.c: POSIX timers */
void rst_create_timers(const struct rst_image *im);
void rst_timer_overruns(const struct rst_image *im, int tid);
int rst_timer_pending(const struct rst_image *im, const uint8_t *info);
void rst_arm_posix_timers(const struct rst_image *im);

/* threads.c */
void rst_restore_sem_undo(const struct rst_image *im);  /* semundo.c: SEM_UNDO adjustments */
void rst_restore_threads(const struct rst_image *im) __attribute__((noreturn));

#endif
