/* The HOST:PORT argument of the loadtest C programs (an IPv4 address and a port,
 * 0-65535) as a sockaddr_in: included by each, as each is compiled alone. */
#ifndef LOADTEST_HOSTPORT_H
#define LOADTEST_HOSTPORT_H

#include <arpa/inet.h>
#include <netinet/in.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* 0 with *out set, or -1, said on stderr after ``prog``: no colon, a port that is not
 * 0-65535, not an IPv4 address */
static int parse_hostport(const char *prog, const char *arg, struct sockaddr_in *out) {
    char host[256];
    snprintf(host, sizeof host, "%s", arg);
    char *colon = strrchr(host, ':');
    if (!colon)
        goto bad;
    *colon = 0;
    char *end;
    long port = strtol(colon + 1, &end, 10);
    if (end == colon + 1 || *end || port < 0 || port > 65535)
        goto bad;
    memset(out, 0, sizeof *out);
    out->sin_family = AF_INET;
    out->sin_port = htons((uint16_t)port);
    if (inet_pton(AF_INET, host, &out->sin_addr) == 1)
        return 0;
bad:
    fprintf(stderr, "%s: not an IPv4 HOST:PORT: %s\n", prog, arg);
    return -1;
}

#endif
