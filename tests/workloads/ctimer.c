/*
 * pthreads with a mutex and condition variables, driven by setitimer.
 *
 * SIGALRM from ITIMER_REAL (every 20 ms) advances a round counter; four
 * workers wait on a condition variable for each new round, add their share
 * under the mutex, and the main thread prints the round's total.  The
 * output is deterministic; after a restore the timer must still tick or the
 * program never finishes.  Usage: ctimer ROUNDS
 */
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/time.h>
#include <unistd.h>

#define WORKERS 4

static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t new_round = PTHREAD_COND_INITIALIZER;
static pthread_cond_t round_done = PTHREAD_COND_INITIALIZER;
static volatile sig_atomic_t ticks;
static int round_no = -1, done_count, rounds;
static long long total;

static void on_alarm(int sig) { (void)sig; ticks++; }

static void *worker(void *arg)
{
    long id = (long)arg;
    for (int r = 0; r < rounds; r++) {
        pthread_mutex_lock(&mu);
        while (round_no < r)
            pthread_cond_wait(&new_round, &mu);
        total += (long long)(r + 1) * (id + 1) * 1000003 % 7919;
        if (++done_count == WORKERS)
            pthread_cond_signal(&round_done);
        pthread_mutex_unlock(&mu);
    }
    return NULL;
}

int main(int argc, char **argv)
{
    rounds = argc > 1 ? atoi(argv[1]) : 150;
    struct sigaction sa = {0};
    sa.sa_handler = on_alarm;
    sa.sa_flags = SA_RESTART;
    sigaction(SIGALRM, &sa, NULL);
    struct itimerval it = {{0, 20000}, {0, 20000}};
    setitimer(ITIMER_REAL, &it, NULL);
    pthread_t t[WORKERS];
    for (long i = 0; i < WORKERS; i++)
        pthread_create(&t[i], NULL, worker, (void *)i);
    int seen = 0;
    for (int r = 0; r < rounds; r++) {
        while (ticks <= seen)  /* only the timer moves us on */
            pause();
        seen = ticks;
        pthread_mutex_lock(&mu);
        done_count = 0;
        round_no = r;
        pthread_cond_broadcast(&new_round);
        while (done_count < WORKERS)
            pthread_cond_wait(&round_done, &mu);
        printf("round %d total %lld\n", r, total);
        fflush(stdout);
        pthread_mutex_unlock(&mu);
    }
    for (int i = 0; i < WORKERS; i++)
        pthread_join(t[i], NULL);
    printf("finished %d rounds\n", rounds);
    return 0;
}
