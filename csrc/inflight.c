/*
 * inflight.c -- the in-flight table of nsqframe.h: offset -> flight slot, open
 * addressing with linear probing and backward-shift removal (no tombstones).
 */
#include <string.h>

#include "nsqframe.h"

static inline uint32_t home(int64_t off, uint32_t mask)
{
    /* Fibonacci hashing: consecutive offsets spread over the table */
    return (uint32_t)(((uint64_t)off * 0x9E3779B97F4A7C15ULL) >> 32) & mask;
}

/* The index of off, or -1. */
static int64_t find(const nsqf_inflight *t, int64_t off)
{
    uint32_t mask = t->cap - 1;
    uint32_t i = home(off, mask);
    for (;;) {
        int64_t k = t->keys[i];
        if (k == off)
            return i;
        if (k < 0)
            return -1;
        i = (i + 1) & mask;
    }
}

/* Put off in slot; returns 1 if it was there already (its old slot loses it). */
static int put(nsqf_inflight *t, int64_t off, int32_t slot)
{
    uint32_t mask = t->cap - 1;
    uint32_t i = home(off, mask);
    for (;;) {
        int64_t k = t->keys[i];
        if (k < 0) {
            t->keys[i] = off;
            t->slots[i] = slot;
            t->used++;
            return 0;
        }
        if (k == off) {
            t->live[t->slots[i]]--;
            t->slots[i] = slot;
            return 1;
        }
        i = (i + 1) & mask;
    }
}

/* Empty index i, moving back the entries of its probe run that may move. */
static void remove_at(nsqf_inflight *t, uint32_t i)
{
    uint32_t mask = t->cap - 1;
    uint32_t j = i;
    for (;;) {
        j = (j + 1) & mask;
        int64_t k = t->keys[j];
        if (k < 0)
            break;
        /* the entry at j may fill i if its home is not cyclically in (i, j] */
        if (((j - home(k, mask)) & mask) >= ((j - i) & mask)) {
            t->keys[i] = k;
            t->slots[i] = t->slots[j];
            i = j;
        }
    }
    t->keys[i] = -1;
    t->used--;
}

int nsqf_if_add(nsqf_inflight *t, const int64_t *firsts, const int64_t *ns,
                const int32_t *slots, const uint64_t *tags, int k)
{
    int again = 0;
    for (int f = 0; f < k; f++) {
        int32_t slot = slots[f];
        t->live[slot] = ns[f];
        t->tags[slot] = tags[f];
        for (int64_t off = firsts[f], end = firsts[f] + ns[f]; off < end; off++)
            again += put(t, off, slot);
    }
    return again;
}

int nsqf_if_fin(nsqf_inflight *t, const uint64_t *tags, const int64_t *offs, int n,
                int32_t *failed, int *nfailed, int32_t *emptied)
{
    int nf = 0, ne = 0;
    for (int i = 0; i < n; i++) {
        int64_t off = offs[i];
        int64_t at = off < 0 ? -1 : find(t, off);
        if (at < 0) {
            failed[nf++] = 2 * i;
            continue;
        }
        int32_t slot = t->slots[at];
        if (t->tags[slot] != tags[i]) {
            failed[nf++] = 2 * i + 1;
            continue;
        }
        remove_at(t, (uint32_t)at);
        if (--t->live[slot] == 0)
            emptied[ne++] = slot;
    }
    *nfailed = nf;
    return ne;
}

int nsqf_if_add1(nsqf_inflight *t, int64_t first, int64_t n, int32_t slot, uint64_t tag)
{
    return nsqf_if_add(t, &first, &n, &slot, &tag, 1);
}

int64_t nsqf_if_fin1(nsqf_inflight *t, uint64_t tag, int64_t off)
{
    int64_t at = off < 0 ? -1 : find(t, off);
    if (at < 0)
        return -1;
    int32_t slot = t->slots[at];
    if (t->tags[slot] != tag)
        return -2;
    remove_at(t, (uint32_t)at);
    return 4 * (int64_t)slot + (--t->live[slot] == 0 ? 2 : 0);
}

int32_t nsqf_if_get(const nsqf_inflight *t, int64_t off)
{
    int64_t at = off < 0 ? -1 : find(t, off);
    return at < 0 ? -1 : t->slots[at];
}

int32_t nsqf_if_pop(nsqf_inflight *t, int64_t off)
{
    int64_t at = off < 0 ? -1 : find(t, off);
    if (at < 0)
        return -1;
    int32_t slot = t->slots[at];
    remove_at(t, (uint32_t)at);
    t->live[slot]--;
    return slot;
}

int nsqf_if_take(nsqf_inflight *t, int64_t first, int64_t n, int32_t slot, int64_t *out)
{
    int got = 0;
    for (int64_t off = first; off < first + n; off++) {
        int64_t at = find(t, off);
        if (at >= 0 && t->slots[at] == slot) {
            remove_at(t, (uint32_t)at);
            t->live[slot]--;
            out[got++] = off;
        }
    }
    return got;
}

int nsqf_if_dump(const nsqf_inflight *t, int64_t *offs, int32_t *slots)
{
    int got = 0;
    for (uint32_t i = 0; i < t->cap; i++) {
        if (t->keys[i] >= 0) {
            offs[got] = t->keys[i];
            slots[got] = t->slots[i];
            got++;
        }
    }
    return got;
}

int64_t nsqf_if_min(const nsqf_inflight *t)
{
    int64_t low = -1;
    for (uint32_t i = 0; i < t->cap; i++) {
        int64_t k = t->keys[i];
        if (k >= 0 && (low < 0 || k < low))
            low = k;
    }
    return low;
}

void nsqf_if_rehash(const nsqf_inflight *from, nsqf_inflight *to)
{
    for (uint32_t i = 0; i < from->cap; i++)
        if (from->keys[i] >= 0)
            put(to, from->keys[i], from->slots[i]);
}

int nsqf_if_from(const nsqf_inflight *t, int64_t from, int64_t *out)
{
    int got = 0;
    for (uint32_t i = 0; i < t->cap; i++) {
        int64_t k = t->keys[i];
        if (k >= 0 && k >= from)
            out[got++] = k;
    }
    return got;
}

/* keys[0..n) sorted ascending, stably, in place, with vals (NULL: none) moved along:
 * an LSD radix sort of each key less the lowest, 11 bits a pass and only as many passes
 * as the widest difference needs; tk and tv (NULL with vals) have room for n. */
static void radix(int64_t *keys, int32_t *vals, int64_t *tk, int32_t *tv, int64_t n)
{
    enum { BITS = 11, DIGITS = 1 << BITS };
    if (n <= 1)
        return;
    int64_t lo = keys[0], hi = keys[0];
    for (int64_t i = 1; i < n; i++) {
        if (keys[i] < lo)
            lo = keys[i];
        if (keys[i] > hi)
            hi = keys[i];
    }
    uint64_t span = (uint64_t)(hi - lo);
    int64_t *sk = keys, *dk = tk;
    int32_t *sv = vals, *dv = tv;
    int64_t count[DIGITS];
    for (int shift = 0; shift < 64 && (span >> shift) != 0; shift += BITS) {
        memset(count, 0, sizeof(count));
        for (int64_t i = 0; i < n; i++)
            count[((uint64_t)(sk[i] - lo) >> shift) & (DIGITS - 1)]++;
        int64_t at = 0;
        for (int d = 0; d < DIGITS; d++) {
            int64_t c = count[d];
            count[d] = at;
            at += c;
        }
        for (int64_t i = 0; i < n; i++) {
            int64_t j = count[((uint64_t)(sk[i] - lo) >> shift) & (DIGITS - 1)]++;
            dk[j] = sk[i];
            if (sv != NULL)
                dv[j] = sv[i];
        }
        int64_t *swk = sk;
        sk = dk;
        dk = swk;
        int32_t *swv = sv;
        sv = dv;
        dv = swv;
    }
    if (sk != keys) {
        memcpy(keys, sk, (size_t)n * sizeof(int64_t));
        if (vals != NULL)
            memcpy(vals, sv, (size_t)n * sizeof(int32_t));
    }
}

int64_t nsqf_sort_from(int64_t *a, int64_t *tmp, int64_t n, int64_t from)
{
    int64_t kept = 0;
    for (int64_t i = 0; i < n; i++)
        if (a[i] >= from)
            a[kept++] = a[i];
    radix(a, NULL, tmp, NULL, kept);
    /* the first of each value (m <= i: in place is safe) */
    int64_t m = 0;
    for (int64_t i = 0; i < kept; i++)
        if (m == 0 || a[i] != a[m - 1])
            a[m++] = a[i];
    return m;
}

void nsqf_sort_pairs(int64_t *keys, int32_t *vals, int64_t *tk, int32_t *tv, int64_t n)
{
    radix(keys, vals, tk, tv, n);
}

int nsqf_sort_order(int64_t *keys, int32_t *order, int64_t *tk, int32_t *tv, int64_t n)
{
    int in_order = 1;
    for (int64_t i = 0; i < n; i++) {
        order[i] = (int32_t)i;
        if (i && keys[i] < keys[i - 1])
            in_order = 0;
    }
    if (!in_order)
        radix(keys, order, tk, tv, n);
    return in_order;
}

void nsqf_gather_i32(const int32_t *table, int64_t ntable, const int32_t *idx,
                     int32_t *out, int64_t n)
{
    for (int64_t i = 0; i < n; i++) {
        int32_t k = idx[i];
        out[i] = k >= 0 && k < ntable ? table[k] : 0;
    }
}

int64_t nsqf_intersect_i64(const int64_t *a, int64_t na, const int64_t *b,
                           const int64_t *vb, int64_t nb, int64_t *out_k, int64_t *out_v)
{
    int64_t i = 0, j = 0, n = 0;
    while (i < na && j < nb) {
        if (a[i] < b[j]) {
            i++;
        } else if (a[i] > b[j]) {
            j++;
        } else {
            out_k[n] = a[i];
            out_v[n] = vb[j];
            n++;
            i++;
            j++;
        }
    }
    return n;
}
