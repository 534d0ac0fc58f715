/* e2e_latency: publish single-message PUBs at a fixed rate over N connections and
 * consume them on M others; report how long each message took from the PUB being
 * written to its delivery being read (end-to-end latency), as percentiles.
 *
 * Each PUB body starts with the CLOCK_MONOTONIC time it was written (8 bytes, big
 * endian), padded to SIZE bytes. Publishes are paced by the clock, not by answers
 * (no coordinated omission): a broker that falls behind shows it as latency. The
 * consumers FIN each message as it is read, at RDY 1000 each. Latencies of the first
 * second are left out (connections warming up). One thread, epoll over every
 * connection, the V2 protocol by hand. Built by loadtest/bench_io.py with the
 * system's C compiler (gcc -O2).
 *
 *   e2e_latency HOST:PORT TOPIC RATE PUBCONNS SUBCONNS SIZE SECONDS
 *
 * Prints one line: "[e2e_latency] sent N received M rate R/s p50 X p99 Y p999 Z max W"
 * with latencies in microseconds.
 */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <errno.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/epoll.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#include "hostport.h"

typedef struct {
    int fd;
    int consumer;
    char *buf;
    size_t len, cap;
    char *out;           /* bytes owed to the socket */
    size_t olen, ocap;
} conn_t;

static int64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

static void die(const char *what) {
    perror(what);
    exit(1);
}

static uint32_t be32(const char *p) {
    const unsigned char *u = (const unsigned char *)p;
    return (uint32_t)u[0] << 24 | (uint32_t)u[1] << 16 | (uint32_t)u[2] << 8 | u[3];
}

static void put32(char *p, uint32_t v) {
    p[0] = (char)(v >> 24); p[1] = (char)(v >> 16); p[2] = (char)(v >> 8); p[3] = (char)v;
}

static void owe(conn_t *c, const char *p, size_t n) {
    if (c->ocap - c->olen < n) {
        while (c->ocap - c->olen < n)
            c->ocap = c->ocap ? c->ocap * 2 : 65536;
        c->out = realloc(c->out, c->ocap);
        if (!c->out)
            die("realloc");
    }
    memcpy(c->out + c->olen, p, n);
    c->olen += n;
}

static void flush_out(conn_t *c) {
    size_t done = 0;
    while (done < c->olen) {
        ssize_t w = send(c->fd, c->out + done, c->olen - done, MSG_NOSIGNAL | MSG_DONTWAIT);
        if (w < 0) {
            if (errno == EAGAIN || errno == EINTR)
                break;
            die("send");
        }
        done += (size_t)w;
    }
    memmove(c->out, c->out + done, c->olen - done);
    c->olen -= done;
}

static void blocking_ok(int fd, const char *what) {
    char head[8], data[256];
    size_t got = 0;
    while (got < 8) {
        ssize_t r = recv(fd, head + got, 8 - got, 0);
        if (r <= 0)
            die(what);
        got += (size_t)r;
    }
    uint32_t size = be32(head);
    if (size < 4 || size - 4 > sizeof data) {
        fprintf(stderr, "%s: frame of %u bytes\n", what, size);
        exit(1);
    }
    got = 0;
    while (got < size - 4) {
        ssize_t r = recv(fd, data + got, size - 4 - got, 0);
        if (r <= 0)
            die(what);
        got += (size_t)r;
    }
    if (be32(head + 4) != 0 || size != 6 || memcmp(data, "OK", 2) != 0) {
        fprintf(stderr, "%s: %.*s\n", what, (int)(size - 4), data);
        exit(1);
    }
}

static int cmp_i64(const void *a, const void *b) {
    int64_t x = *(const int64_t *)a, y = *(const int64_t *)b;
    return (x > y) - (x < y);
}

int main(int argc, char **argv) {
    if (argc != 8) {
        fprintf(stderr,
                "usage: e2e_latency HOST:PORT TOPIC RATE PUBCONNS SUBCONNS SIZE SECONDS\n");
        return 2;
    }
    struct sockaddr_in addr;
    if (parse_hostport("e2e_latency", argv[1], &addr) < 0)
        return 2;
    const char *topic = argv[2];
    double rate = atof(argv[3]);
    int npub = atoi(argv[4]), nsub = atoi(argv[5]);
    size_t size = (size_t)atoi(argv[6]);
    double seconds = atof(argv[7]);
    if (size < 8 || npub < 1 || nsub < 1 || rate <= 0)
        return 2;
    int n = npub + nsub;
    conn_t *conns = calloc((size_t)n, sizeof *conns);
    int ep = epoll_create1(0);
    char cmd[512];
    for (int i = 0; i < n; i++) {
        conn_t *c = &conns[i];
        c->consumer = i >= npub;
        c->fd = socket(AF_INET, SOCK_STREAM, 0);
        if (c->fd < 0 || connect(c->fd, (struct sockaddr *)&addr, sizeof addr) < 0)
            die("connect");
        int one = 1;
        setsockopt(c->fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
        if (send(c->fd, "  V2", 4, MSG_NOSIGNAL) != 4)
            die("magic");
        if (c->consumer) {
            int k = snprintf(cmd, sizeof cmd, "SUB %s ch\n", topic);
            if (send(c->fd, cmd, (size_t)k, MSG_NOSIGNAL) != k)
                die("SUB");
            blocking_ok(c->fd, "SUB");
            if (send(c->fd, "RDY 1000\n", 9, MSG_NOSIGNAL) != 9)
                die("RDY");
        }
        c->cap = 1 << 20;
        c->buf = malloc(c->cap);
        struct epoll_event ev = {.events = EPOLLIN, .data.ptr = c};
        if (epoll_ctl(ep, EPOLL_CTL_ADD, c->fd, &ev) < 0)
            die("epoll_ctl");
    }
    size_t maxlat = (size_t)(rate * seconds * 1.2) + 1024;
    int64_t *lat = malloc(maxlat * sizeof *lat);
    size_t nlat = 0;
    char *pub = malloc(64 + strlen(topic) + size);
    int hlen = snprintf(pub, 64 + strlen(topic), "PUB %s\n", topic);
    put32(pub + hlen, (uint32_t)size);
    memset(pub + hlen + 4, 'x', size);
    size_t publen = (size_t)hlen + 4 + size;
    long long sent = 0, received = 0, oks = 0;
    int64_t start = now_ns(), warm = start + 1000000000LL;
    int64_t end = start + (int64_t)(seconds * 1e9);
    double per_ns = rate / 1e9;
    int rr = 0;
    struct epoll_event evs[256];
    for (;;) {
        int64_t t = now_ns();
        if (t >= end)
            break;
        long long due = (long long)((double)(t - start) * per_ns);
        while (sent < due) {
            conn_t *c = &conns[rr];
            rr = (rr + 1) % npub;
            int64_t ts = now_ns();
            char *b = pub + hlen + 4;
            for (int k = 0; k < 8; k++)
                b[k] = (char)(ts >> (56 - 8 * k));
            owe(c, pub, publen);
            sent++;
        }
        for (int i = 0; i < npub; i++)
            if (conns[i].olen)
                flush_out(&conns[i]);
        int64_t next = start + (int64_t)((double)(sent + 1) / per_ns);
        int wait_ms = (int)((next - now_ns()) / 1000000);
        if (wait_ms < 0)
            wait_ms = 0;
        int got = epoll_wait(ep, evs, 256, wait_ms);
        int64_t rt = now_ns();
        for (int k = 0; k < got; k++) {
            conn_t *c = evs[k].data.ptr;
            if (c->cap - c->len < 65536) {
                c->cap *= 2;
                c->buf = realloc(c->buf, c->cap);
            }
            ssize_t r = recv(c->fd, c->buf + c->len, c->cap - c->len, MSG_DONTWAIT);
            if (r == 0) {
                fprintf(stderr, "the broker closed a connection\n");
                return 1;
            }
            if (r < 0)
                continue;
            c->len += (size_t)r;
            size_t pos = 0;
            while (c->len - pos >= 8) {
                uint32_t fsize = be32(c->buf + pos);
                if (c->len - pos < 4 + (size_t)fsize)
                    break;
                uint32_t type = be32(c->buf + pos + 4);
                const char *data = c->buf + pos + 8;
                if (type == 2 && fsize >= 30 + 8) {   /* ts 8, attempts 2, id 16, body */
                    const unsigned char *body = (const unsigned char *)data + 26;
                    int64_t ts = 0;
                    for (int q = 0; q < 8; q++)
                        ts = ts << 8 | body[q];
                    if (ts >= warm && nlat < maxlat)
                        lat[nlat++] = rt - ts;
                    memcpy(cmd, "FIN ", 4);
                    memcpy(cmd + 4, data + 10, 16);
                    cmd[20] = '\n';
                    owe(c, cmd, 21);
                    received++;
                } else if (type == 1) {
                    fprintf(stderr, "error frame: %.*s\n", (int)(fsize - 4), data);
                    return 1;
                } else if (fsize == 15 && memcmp(data, "_heartbeat_", 11) == 0) {
                    owe(c, "NOP\n", 4);
                } else {
                    oks++;
                }
                pos += 4 + (size_t)fsize;
            }
            memmove(c->buf, c->buf + pos, c->len - pos);
            c->len -= pos;
            if (c->olen)
                flush_out(c);
        }
    }
    double dur = (double)(now_ns() - start) / 1e9;
    if (!nlat) {
        fprintf(stderr, "no message received after the first second\n");
        return 1;
    }
    qsort(lat, nlat, sizeof *lat, cmp_i64);
#define PCT(p) (lat[(size_t)((double)(nlat - 1) * (p))] / 1000.0)
    printf("[e2e_latency] sent %lld received %lld oks %lld rate %.1f/s p50 %.1f p99 %.1f "
           "p999 %.1f max %.1f\n", sent, received, oks, (double)sent / dur, PCT(0.50),
           PCT(0.99), PCT(0.999), lat[nlat - 1] / 1000.0);
    for (int i = 0; i < n; i++)
        close(conns[i].fd);
    return 0;
}
