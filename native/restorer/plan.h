/*
 * What the restore plan's files share (plan.c: the format, the parser and
 * the table of operations; plan_<kind>.c: one kind each).  Only those
 * files include this; the rest of the restorer sees restorer.h.
 */
#ifndef CKPTD_RESTORER_PLAN_H
#define CKPTD_RESTORER_PLAN_H

#include "restorer.h"

#define MAX_TOKENS 16
#define BOUNCE (1u << 20)

/* one plan line, cut into tokens in place; tok[0] is the op word */
struct line {
    char *tok[MAX_TOKENS];
    int ntok;
};

/* the line reader (plan.c) */
char *plan_next_line(char **cursor, char *end, struct line *l);
uint64_t num(const struct line *l, int i);
size_t unhex(const struct line *l, int i, char *out, size_t cap);  /* hex bytes into out; returns the length */

/* shared by the kinds (plan.c) */
extern char *bounce;  /* BOUNCE bytes: saved data on its way into an object */
int slot_fd(const struct line *l, int i);
void to_slot(long fd, const struct line *l, int i, const char *what);  /* put a new descriptor at its slot */
long open_data(const struct line *l, int i);                            /* a saved data file, read-only */
void put_bytes(int to, const struct line *l, int i, const char *why);  /* FILE OFF LEN into a pipe or socket */

/*
 * The operations, one per op word (the table is in plan.c): build creates
 * or fills an object at its slot while the builder runs; key names the
 * slots a per-process restorer looks its descriptors up in (rst_slot_for):
 * token indexes of the slot, dev (0: none) and ino.
 */
struct plan_key {
    uint8_t kind, slot, dev, ino;  /* kind RST_KEY_*, 0: none */
};
struct plan_op {
    const char *word;
    void (*build)(const struct line *l);  /* 0: read by another step (the tree, the keys) */
    struct plan_key key[2];
};

/* plan_pipe.c */
void op_pipe(const struct line *l);
void op_fifo(const struct line *l);
void op_log(const struct line *l);
/* plan_unix.c */
void op_socket(const struct line *l);
void op_socketpair(const struct line *l);
void op_bind(const struct line *l);
void op_connect(const struct line *l);
void op_messages(const struct line *l);
void op_rights(const struct line *l);
void op_sendto(const struct line *l);
void op_shutdown(const struct line *l);
/* plan_tcp.c */
void op_tcp(const struct line *l);
void op_tcpbind(const struct line *l);
void op_tcpopts(const struct line *l);
void op_tcppair(const struct line *l);
void op_tcprepair(const struct line *l);
void op_repairq(const struct line *l);
void op_repairoff(const struct line *l);
void op_sockbuf(const struct line *l);
void op_tcpfin(const struct line *l);
void op_tcpgone(const struct line *l);
/* plan_dgram.c */
void op_dgram(const struct line *l);
void op_dgrambind(const struct line *l);
void op_dgramconnect(const struct line *l);
void op_mcast(const struct line *l);
/* plan_shm.c */
void op_shm(const struct line *l);
void op_shmfill(const struct line *l);
/* plan_deleted.c */
void op_deleted(const struct line *l);
/* plan_file.c */
void op_file(const struct line *l);
void op_fileshm(const struct line *l);
/* plan_eventfd.c */
void op_eventfd(const struct line *l);
/* plan_timerfd.c, plan_signalfd.c */
void op_timerfd(const struct line *l);
void op_signalfd(const struct line *l);
/* plan_sysv.c */
void op_sysvshm(const struct line *l);
void op_sysvsem(const struct line *l);
void op_sysvmsg(const struct line *l);
/* plan_pty.c */
void op_pty(const struct line *l);
/* plan_tree.c: the proc, zombie and helper lines, once every object exists */
void plan_build_tree(char *buf, uint64_t size) __attribute__((noreturn));

#endif
