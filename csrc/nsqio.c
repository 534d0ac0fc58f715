/*
 * Batched socket I/O for the event loops: see nsqframe.h (nsqf_recv_many,
 * nsqf_send_many, and the sender thread that runs the latter off the loop's thread).
 * Plain POSIX calls, and Linux's futex for the sender (elsewhere nsqf_sender_new
 * gives NULL and the loop writes its jobs itself); only a sender keeps state.
 */
#define _GNU_SOURCE
#include "nsqframe.h"

#include <errno.h>
#include <stdlib.h>
#include <sys/socket.h>
#include <sys/types.h>
#ifdef __linux__
#include <limits.h>
#include <linux/futex.h>
#include <pthread.h>
#include <sched.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>
#endif

#ifndef MSG_NOSIGNAL
#define MSG_NOSIGNAL 0
#endif

int nsqf_recv_many(const int32_t *fds, int n, uint8_t *buf, uint32_t cap,
                   uint32_t piece, uint32_t *starts, int32_t *got)
{
    uint32_t pos = 0;
    int i;
    for (i = 0; i < n; i++) {
        ssize_t r;
        if (piece > cap - pos)
            break;
        do {
            r = recv(fds[i], buf + pos, piece, 0);
        } while (r < 0 && errno == EINTR);
        starts[i] = pos;
        if (r < 0) {
            got[i] = -errno;
        } else {
            got[i] = (int32_t)r;
            pos += (uint32_t)r;
        }
    }
    return i;
}

void nsqf_send_many(const int32_t *fds, int n, const uint8_t *buf,
                    const uint32_t *lens, int32_t *sent)
{
    size_t at = 0;
    int i;
    for (i = 0; i < n; i++) {
        ssize_t r;
        do {
            r = send(fds[i], buf + at, lens[i], MSG_NOSIGNAL);
        } while (r < 0 && errno == EINTR);
        sent[i] = r < 0 ? -errno : (int32_t)r;
        at += lens[i];
    }
}

#ifdef __linux__
/*
 * The sender. Its state word is the only thing the two threads share besides the job,
 * and every access to it is sequentially consistent: the thread marks itself asleep
 * and then looks at the state once more, the loop publishes a job and then looks
 * whether the thread sleeps, so at least one of them sees the other (the same for a
 * loop waiting for a job's end). A wake-up is a futex system call only when the other
 * side sleeps; after a job the thread first looks for the next one for spin_ns (the
 * loop's next turn usually comes sooner) and gives its core away between looks.
 */
enum { IDLE, POSTED, DONE, STOP };

struct nsqf_sender {
    pthread_t thread;
    int state;                  /* IDLE, POSTED, DONE or STOP */
    int asleep;                 /* the thread waits in futex for a job */
    int waiting;                /* the loop waits in futex for the job's end */
    uint64_t spin_ns;
    const int32_t *fds;
    int n;
    const uint8_t *buf;
    const uint32_t *lens;
    int32_t *sent;
};

#define LOAD(p) __atomic_load_n((p), __ATOMIC_SEQ_CST)
#define STORE(p, v) __atomic_store_n((p), (v), __ATOMIC_SEQ_CST)

static void futex_wait(int *word, int seen)
{
    /* returns at once when *word is no longer seen; spurious returns are fine */
    syscall(SYS_futex, word, FUTEX_WAIT_PRIVATE, seen, NULL, NULL, 0);
}

static void futex_wake(int *word)
{
    syscall(SYS_futex, word, FUTEX_WAKE_PRIVATE, INT_MAX, NULL, NULL, 0);
}

static uint64_t now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
}

/* the next job (POSTED) or STOP, once the state shows one */
static int next_job(nsqf_sender *s)
{
    int st = LOAD(&s->state);
    if (st == POSTED || st == STOP)
        return st;
    if (s->spin_ns) {
        uint64_t end = now_ns() + s->spin_ns;
        do {
            sched_yield();
            st = LOAD(&s->state);
            if (st == POSTED || st == STOP)
                return st;
        } while (now_ns() < end);
    }
    STORE(&s->asleep, 1);
    while ((st = LOAD(&s->state)) != POSTED && st != STOP)
        futex_wait(&s->state, st);
    STORE(&s->asleep, 0);
    return st;
}

static void *sender_run(void *arg)
{
    nsqf_sender *s = arg;
    while (next_job(s) == POSTED) {
        nsqf_send_many(s->fds, s->n, s->buf, s->lens, s->sent);
        STORE(&s->state, DONE);
        if (LOAD(&s->waiting))
            futex_wake(&s->state);
    }
    return NULL;
}

nsqf_sender *nsqf_sender_new(uint64_t spin_ns)
{
    nsqf_sender *s = calloc(1, sizeof *s);
    if (s == NULL)
        return NULL;
    s->state = IDLE;
    s->spin_ns = spin_ns;
    if (pthread_create(&s->thread, NULL, sender_run, s) != 0) {
        free(s);
        return NULL;
    }
    return s;
}

void nsqf_sender_post(nsqf_sender *s, const int32_t *fds, int n, const uint8_t *buf,
                      const uint32_t *lens, int32_t *sent)
{
    s->fds = fds;
    s->n = n;
    s->buf = buf;
    s->lens = lens;
    s->sent = sent;
    STORE(&s->state, POSTED);       /* the job's fields are visible before this */
    if (LOAD(&s->asleep))
        futex_wake(&s->state);
}

void nsqf_sender_wait(nsqf_sender *s)
{
    if (LOAD(&s->state) == POSTED) {
        STORE(&s->waiting, 1);
        while (LOAD(&s->state) == POSTED)
            futex_wait(&s->state, POSTED);
        STORE(&s->waiting, 0);
    }
    if (LOAD(&s->state) == DONE)
        STORE(&s->state, IDLE);
}

int nsqf_sender_busy(nsqf_sender *s)
{
    return LOAD(&s->state) == POSTED;
}

void nsqf_sender_free(nsqf_sender *s)
{
    nsqf_sender_wait(s);
    STORE(&s->state, STOP);
    futex_wake(&s->state);
    pthread_join(s->thread, NULL);
    free(s);
}

#else /* no futex: no sender */

struct nsqf_sender {
    int unused;
};

nsqf_sender *nsqf_sender_new(uint64_t spin_ns)
{
    (void)spin_ns;
    return NULL;
}

void nsqf_sender_post(nsqf_sender *s, const int32_t *fds, int n, const uint8_t *buf,
                      const uint32_t *lens, int32_t *sent)
{
    (void)s; (void)fds; (void)n; (void)buf; (void)lens; (void)sent;
}

void nsqf_sender_wait(nsqf_sender *s)
{
    (void)s;
}

int nsqf_sender_busy(nsqf_sender *s)
{
    (void)s;
    return 0;
}

void nsqf_sender_free(nsqf_sender *s)
{
    (void)s;
}
#endif
