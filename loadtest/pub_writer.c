/* pub_writer: publish one prepared command (a PUB or an MPUB) over N connections, DEPTH
 * commands in flight on each, for SECONDS; count the messages answered OK.
 *
 * One thread per connection, blocking sockets, the V2 protocol by hand: each thread
 * writes DEPTH copies of the command, reads DEPTH OK frames, and starts again. The
 * threads share nothing but the stop flag and their counts, so N producers wake and
 * answer on their own, as N separate client processes would (a load generator in one
 * Python process runs its threads one at a time under the interpreter lock). Built by
 * loadtest/bench_io.py's helper (rdy_reader_binary) with the system's C compiler.
 *
 *   pub_writer HOST:PORT CMDFILE PER_CMD CONNS DEPTH SECONDS
 *
 * CMDFILE holds the command's bytes (e.g. "PUB t\n" and its sized body); PER_CMD is the
 * messages one command carries. Prints one line:
 *   "[pub_writer] messages N seconds S"
 * and exits 1 with a reason on stderr if a connection fails or answers other than OK.
 */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <errno.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#include "hostport.h"

#define MAX_CONNS 256
#define OK_LEN 10       /* size (4) + frame type (4) + "OK" */

static const unsigned char OK_FRAME[OK_LEN] = {0, 0, 0, 6, 0, 0, 0, 0, 'O', 'K'};

static struct sockaddr_in addr;
static unsigned char *burst;      /* DEPTH copies of the command */
static size_t burst_len;
static int depth;
static long per_cmd;
static volatile int stop_flag;

struct worker {
    pthread_t thread;
    int fd;
    long messages;
    char error[160];
};

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec + ts.tv_nsec / 1e9;
}

/* all n bytes sent (writing) or received: 0, or -1 on an error or a closed peer */
static int io_all(int fd, unsigned char *p, size_t n, int writing) {
    while (n > 0) {
        ssize_t k = writing ? send(fd, p, n, MSG_NOSIGNAL) : recv(fd, p, n, 0);
        if (k < 0 && errno == EINTR)
            continue;
        if (k <= 0)
            return -1;
        p += k;
        n -= (size_t)k;
    }
    return 0;
}

static void *run(void *arg) {
    struct worker *w = arg;
    size_t want = (size_t)OK_LEN * (size_t)depth;
    unsigned char *got = malloc(want);
    if (got == NULL) {
        snprintf(w->error, sizeof w->error, "out of memory");
        return NULL;
    }
    while (!stop_flag) {
        if (io_all(w->fd, burst, burst_len, 1) < 0) {
            snprintf(w->error, sizeof w->error, "write: %s", strerror(errno));
            break;
        }
        if (io_all(w->fd, got, want, 0) < 0) {
            snprintf(w->error, sizeof w->error, "read: %s",
                     errno ? strerror(errno) : "closed");
            break;
        }
        for (int i = 0; i < depth; i++) {
            if (memcmp(got + (size_t)i * OK_LEN, OK_FRAME, OK_LEN) != 0) {
                snprintf(w->error, sizeof w->error, "an answer other than OK");
                free(got);
                return NULL;
            }
        }
        w->messages += per_cmd * depth;
    }
    free(got);
    return NULL;
}

static unsigned char *read_file(const char *path, size_t *len) {
    FILE *f = fopen(path, "rb");
    if (f == NULL)
        return NULL;
    size_t cap = 1 << 16, n = 0;
    unsigned char *buf = malloc(cap);
    while (buf != NULL) {
        n += fread(buf + n, 1, cap - n, f);
        if (n < cap)
            break;
        cap *= 2;
        unsigned char *more = realloc(buf, cap);
        if (more == NULL)
            free(buf);
        buf = more;
    }
    fclose(f);
    *len = n;
    return buf;
}

int main(int argc, char **argv) {
    if (argc != 7) {
        fprintf(stderr, "usage: pub_writer HOST:PORT CMDFILE PER_CMD CONNS DEPTH SECONDS\n");
        return 2;
    }
    if (parse_hostport("pub_writer", argv[1], &addr) < 0)
        return 2;
    size_t cmd_len;
    unsigned char *cmd = read_file(argv[2], &cmd_len);
    per_cmd = atol(argv[3]);
    int conns = atoi(argv[4]);
    depth = atoi(argv[5]);
    double seconds = atof(argv[6]);
    if (cmd == NULL || cmd_len == 0 || per_cmd < 1 || conns < 1 || conns > MAX_CONNS
        || depth < 1 || depth > 1024 || seconds <= 0) {
        fprintf(stderr, "pub_writer: bad arguments (or an unreadable command file)\n");
        return 2;
    }
    burst_len = cmd_len * (size_t)depth;
    burst = malloc(burst_len);
    if (burst == NULL)
        return 1;
    for (int i = 0; i < depth; i++)
        memcpy(burst + (size_t)i * cmd_len, cmd, cmd_len);

    static struct worker workers[MAX_CONNS];
    unsigned char magic[] = "  V2";
    for (int i = 0; i < conns; i++) {
        int fd = socket(AF_INET, SOCK_STREAM, 0);
        int one = 1;
        if (fd < 0 || connect(fd, (struct sockaddr *)&addr, sizeof addr) < 0) {
            fprintf(stderr, "pub_writer: connect: %s\n", strerror(errno));
            return 1;
        }
        setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
        if (io_all(fd, magic, 4, 1) < 0) {
            fprintf(stderr, "pub_writer: magic: %s\n", strerror(errno));
            return 1;
        }
        workers[i].fd = fd;
    }
    double t0 = now_s();
    for (int i = 0; i < conns; i++)
        pthread_create(&workers[i].thread, NULL, run, &workers[i]);
    struct timespec nap = {(time_t)seconds, (long)((seconds - (time_t)seconds) * 1e9)};
    nanosleep(&nap, NULL);
    stop_flag = 1;
    long total = 0;
    const char *error = NULL;
    for (int i = 0; i < conns; i++) {
        pthread_join(workers[i].thread, NULL);
        total += workers[i].messages;
        if (workers[i].error[0] && error == NULL)
            error = workers[i].error;
    }
    double elapsed = now_s() - t0;
    for (int i = 0; i < conns; i++)
        close(workers[i].fd);
    if (error != NULL) {
        fprintf(stderr, "pub_writer: %s\n", error);
        return 1;
    }
    printf("[pub_writer] messages %ld seconds %.6f\n", total, elapsed);
    return 0;
}
