#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <pthread.h>
#include <setjmp.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/types.h>
#include <sys/uio.h>
#include <time.h>
#include <unistd.h>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#elif defined(__SSE2__)
#include <emmintrin.h>
#endif

/* dst <- src, n bytes, with non-temporal (streaming) stores where the CPU has them and the ranges do not
   overlap: what glibc's memcpy does for one large copy, so the destination is not read first (no RFO). */
static void copy_stream(char *dst, const char *src, size_t n) {
#if defined(__SSE2__)
    if (n >= 256 && (dst + n <= src || src + n <= dst)) {
        size_t head = (16 - ((uintptr_t)dst & 15)) & 15;
        memcpy(dst, src, head);
        dst += head; src += head; n -= head;
        for (; n >= 64; n -= 64, dst += 64, src += 64) {
            __m128i a = _mm_loadu_si128((const __m128i *)src);
            __m128i b = _mm_loadu_si128((const __m128i *)(src + 16));
            __m128i c = _mm_loadu_si128((const __m128i *)(src + 32));
            __m128i d = _mm_loadu_si128((const __m128i *)(src + 48));
            _mm_stream_si128((__m128i *)dst, a);
            _mm_stream_si128((__m128i *)(dst + 16), b);
            _mm_stream_si128((__m128i *)(dst + 32), c);
            _mm_stream_si128((__m128i *)(dst + 48), d);
        }
        memcpy(dst, src, n);
        return;
    }
#endif
    memmove(dst, src, n);
}

/* geo: nbuf rows of (dst addr, dst row stride, src addr, src row stride, row bytes);
   runs: nruns rows of (dst page, src page, pages). Every buffer gets every run. stream: non-temporal stores
   (for copies larger than the cache, as the caller decides). */
void dsakv_copy_runs(int64_t nbuf, const int64_t *geo, int64_t nruns, const int64_t *runs, int stream) {
    void *(*mv)(void *, const void *, size_t) = memmove;
    for (int64_t b = 0; b < nbuf; b++) {
        const int64_t *g = geo + 5 * b;
        char *da = (char *)(intptr_t)g[0];
        const char *sa = (const char *)(intptr_t)g[2];
        int64_t ds = g[1], ss = g[3], w = g[4];
        for (int64_t r = 0; r < nruns; r++) {
            int64_t d = runs[3 * r], s = runs[3 * r + 1], k = runs[3 * r + 2];
            if (ds == w && ss == w) {
                if (stream) copy_stream(da + d * w, sa + s * w, (size_t)(k * w));
                else mv(da + d * w, sa + s * w, (size_t)(k * w));
            } else {
                for (int64_t i = 0; i < k; i++) {
                    if (stream) copy_stream(da + (d + i) * ds, sa + (s + i) * ss, (size_t)w);
                    else mv(da + (d + i) * ds, sa + (s + i) * ss, (size_t)w);
                }
            }
        }
    }
#if defined(__SSE2__)
    if (stream) _mm_sfence();
#endif
}

/* Adds the little-endian u64 words of n bytes at p, the first at stream position *pos (so segments laid end to
   end sum as one stream, the last word zero padded), to *total. */
#if defined(__x86_64__) || defined(__i386__)
/* The u64 word sum of n (a multiple of 128) bytes at p. */
__attribute__((target("avx2"))) static uint64_t sum_avx2(const unsigned char *p, uint64_t n) {
    __m256i a = _mm256_setzero_si256(), b = a, c = a, d = a;
    for (; n; n -= 128, p += 128) {
        a = _mm256_add_epi64(a, _mm256_loadu_si256((const __m256i *)p));
        b = _mm256_add_epi64(b, _mm256_loadu_si256((const __m256i *)(p + 32)));
        c = _mm256_add_epi64(c, _mm256_loadu_si256((const __m256i *)(p + 64)));
        d = _mm256_add_epi64(d, _mm256_loadu_si256((const __m256i *)(p + 96)));
    }
    uint64_t l[4];
    _mm256_storeu_si256((__m256i *)l, _mm256_add_epi64(_mm256_add_epi64(a, b), _mm256_add_epi64(c, d)));
    return l[0] + l[1] + l[2] + l[3];
}
#endif

static void sum_into(const unsigned char *p, uint64_t n, uint64_t *pos, uint64_t *total) {
    uint64_t t = *total, q = *pos;
    while (n && (q & 7)) { t += (uint64_t)*p++ << (8 * (q & 7)); q++; n--; }
#if defined(__x86_64__) || defined(__i386__)
    if (n >= 128 && __builtin_cpu_supports("avx2")) {
        uint64_t body = n & ~(uint64_t)127;
        t += sum_avx2(p, body);
        p += body; q += body; n -= body;
    }
#endif
    uint64_t a0 = 0, a1 = 0, a2 = 0, a3 = 0;
    for (; n >= 32; n -= 32, p += 32, q += 32) {
        uint64_t w[4];
        memcpy(w, p, 32);
        a0 += w[0]; a1 += w[1]; a2 += w[2]; a3 += w[3];
    }
    for (; n >= 8; n -= 8, p += 8, q += 8) { uint64_t w; memcpy(&w, p, 8); a0 += w; }
    t += a0 + a1 + a2 + a3;
    while (n) { t += (uint64_t)*p++ << (8 * (q & 7)); q++; n--; }
    *total = t;
    *pos = q;
}

/* Wrapping sum of the little-endian u64 words of the segments laid end to end. segs: nseg rows of (addr, bytes). */
uint64_t dsakv_sum64(int64_t nseg, const int64_t *segs) {
    uint64_t total = 0, pos = 0;
    for (int64_t i = 0; i < nseg; i++)
        sum_into((const unsigned char *)(intptr_t)segs[2 * i], (uint64_t)segs[2 * i + 1], &pos, &total);
    return total;
}

/* preadv(fd, segs) from `offset` in windows of at most 256 KiB, each summed (dsakv_sum64) right after it is
   read, while it is still in cache. Returns the bytes read (short at end of file) or -errno; *sum the sum of
   the bytes read. */
int64_t dsakv_read_sum(int fd, int64_t offset, int64_t nseg, const int64_t *segs, uint64_t *sum) {
    enum { WINDOW = 256 * 1024, MAXIOV = 256 };
    struct iovec iov[MAXIOV];
    int64_t got = 0, i = 0;
    uint64_t skip = 0, pos = 0, total = 0; /* skip: bytes of segs[i] already read */
    while (i < nseg) {
        int cnt = 0;
        uint64_t want = 0;
        for (int64_t j = i; j < nseg && cnt < MAXIOV && want < WINDOW; j++, cnt++) {
            uint64_t off = (j == i) ? skip : 0, len = (uint64_t)segs[2 * j + 1] - off;
            if (len > WINDOW - want) len = WINDOW - want;
            char *base = (char *)(intptr_t)segs[2 * j] + off;
            want += len;
            if (cnt && (char *)iov[cnt - 1].iov_base + iov[cnt - 1].iov_len == base) { /* adjacent: one iovec */
                iov[cnt - 1].iov_len += (size_t)len;
                cnt--;
                continue;
            }
            iov[cnt].iov_base = base;
            iov[cnt].iov_len = (size_t)len;
        }
        ssize_t r = preadv(fd, iov, cnt, (off_t)(offset + got));
        if (r < 0) {
            if (errno == EINTR) continue;
            return -(int64_t)errno;
        }
        if (r == 0) break;
        got += r;
        uint64_t left = (uint64_t)r;
        for (int c = 0; c < cnt && left; c++) {
            uint64_t n = iov[c].iov_len < left ? iov[c].iov_len : left;
            sum_into((const unsigned char *)iov[c].iov_base, n, &pos, &total);
            left -= n;
        }
        left = (uint64_t)r;
        while (i < nseg && left >= (uint64_t)segs[2 * i + 1] - skip) {
            left -= (uint64_t)segs[2 * i + 1] - skip;
            skip = 0;
            i++;
        }
        skip += left;
    }
    *sum = total;
    return got;
}

/* ---- copy + word sum in one pass, from a read-only mapping of the page file ---- */

#if defined(__x86_64__) || defined(__i386__)
/* n (a multiple of 128) bytes src -> dst (32-byte aligned) with streaming stores; returns their u64 word sum. */
__attribute__((target("avx2"))) static uint64_t copy_sum_avx2(char *dst, const char *src, uint64_t n) {
    __m256i a = _mm256_setzero_si256(), b = a, c = a, d = a;
    for (; n; n -= 128, src += 128, dst += 128) {
        __m256i w = _mm256_loadu_si256((const __m256i *)src);
        __m256i x = _mm256_loadu_si256((const __m256i *)(src + 32));
        __m256i y = _mm256_loadu_si256((const __m256i *)(src + 64));
        __m256i z = _mm256_loadu_si256((const __m256i *)(src + 96));
        a = _mm256_add_epi64(a, w); b = _mm256_add_epi64(b, x); c = _mm256_add_epi64(c, y); d = _mm256_add_epi64(d, z);
        _mm256_stream_si256((__m256i *)dst, w);
        _mm256_stream_si256((__m256i *)(dst + 32), x);
        _mm256_stream_si256((__m256i *)(dst + 64), y);
        _mm256_stream_si256((__m256i *)(dst + 96), z);
    }
    uint64_t l[4];
    _mm256_storeu_si256((__m256i *)l, _mm256_add_epi64(_mm256_add_epi64(a, b), _mm256_add_epi64(c, d)));
    return l[0] + l[1] + l[2] + l[3];
}
#endif

#if defined(__SSE2__)
static uint64_t copy_sum_sse2(char *dst, const char *src, uint64_t n) { /* as above, 16-byte lanes */
    __m128i a = _mm_setzero_si128(), b = a, c = a, d = a;
    for (; n; n -= 128, src += 128, dst += 128) {
        for (int k = 0; k < 128; k += 64) {
            __m128i w = _mm_loadu_si128((const __m128i *)(src + k));
            __m128i x = _mm_loadu_si128((const __m128i *)(src + k + 16));
            __m128i y = _mm_loadu_si128((const __m128i *)(src + k + 32));
            __m128i z = _mm_loadu_si128((const __m128i *)(src + k + 48));
            a = _mm_add_epi64(a, w); b = _mm_add_epi64(b, x); c = _mm_add_epi64(c, y); d = _mm_add_epi64(d, z);
            _mm_stream_si128((__m128i *)(dst + k), w);
            _mm_stream_si128((__m128i *)(dst + k + 16), x);
            _mm_stream_si128((__m128i *)(dst + k + 32), y);
            _mm_stream_si128((__m128i *)(dst + k + 48), z);
        }
    }
    uint64_t l[2];
    _mm_storeu_si128((__m128i *)l, _mm_add_epi64(_mm_add_epi64(a, b), _mm_add_epi64(c, d)));
    return l[0] + l[1];
}
#endif

/* dst <- src, n bytes, adding their words (stream position *pos, as sum_into) to *total: one pass over the data,
   the destination written with streaming stores (not read first). Where dst and the stream position are not
   equally 8-byte aligned, plain copies of 64 KiB, each summed while in cache. */
static void copy_sum(char *dst, const char *src, uint64_t n, uint64_t *pos, uint64_t *total) {
    if ((((uintptr_t)dst - *pos) & 7) != 0) {
        for (uint64_t k; n; n -= k, dst += k, src += k) {
            k = n < 65536 ? n : 65536;
            memcpy(dst, src, k);
            sum_into((const unsigned char *)dst, k, pos, total);
        }
        return;
    }
    uint64_t head = 0; /* to a 32-byte aligned dst, in whole stream words after the first partial one */
    while (head < n && ((uintptr_t)(dst + head) & 31)) head++;
    if (head) {
        memcpy(dst, src, head);
        sum_into((const unsigned char *)dst, head, pos, total);
        dst += head; src += head; n -= head;
    }
    uint64_t body = n & ~(uint64_t)127;
    if (body) {
        uint64_t t;
#if defined(__x86_64__) || defined(__i386__)
        if (__builtin_cpu_supports("avx2")) t = copy_sum_avx2(dst, src, body);
        else
#endif
#if defined(__SSE2__)
            t = copy_sum_sse2(dst, src, body);
#else
        { memcpy(dst, src, body); t = 0; uint64_t q = 0; sum_into((const unsigned char *)dst, body, &q, &t); }
#endif
        *total += t;
        *pos += body;
        dst += body; src += body; n -= body;
    }
    if (n) {
        memcpy(dst, src, n);
        sum_into((const unsigned char *)dst, n, pos, total);
    }
}

/* A SIGBUS while copying from a mapping (the file was truncated under it) jumps back to the copy's caller, which
   reports -EFAULT; any other SIGBUS goes to the handler installed before (Python's faulthandler, the default). */
static __thread sigjmp_buf *bus_jmp;
static struct sigaction bus_prev;
static pthread_mutex_t bus_mu = PTHREAD_MUTEX_INITIALIZER;

static void on_bus(int sig, siginfo_t *si, void *uc) {
    sigjmp_buf *j = bus_jmp;
    if (j) {
        bus_jmp = NULL;
        siglongjmp(*j, 1);
    }
    if (bus_prev.sa_flags & SA_SIGINFO) {
        if (bus_prev.sa_sigaction) { bus_prev.sa_sigaction(sig, si, uc); return; }
    } else if (bus_prev.sa_handler != SIG_DFL && bus_prev.sa_handler != SIG_IGN) {
        bus_prev.sa_handler(sig);
        return;
    }
    sigaction(SIGBUS, &bus_prev, NULL); /* the fault repeats on return and ends the process, as without us */
}

static int guard_bus(void) {
    struct sigaction cur, sa;
    if (sigaction(SIGBUS, NULL, &cur) != 0) return -1;
    if ((cur.sa_flags & SA_SIGINFO) && cur.sa_sigaction == on_bus) return 0;
    pthread_mutex_lock(&bus_mu);
    int r = 0;
    if (sigaction(SIGBUS, NULL, &cur) == 0 && !((cur.sa_flags & SA_SIGINFO) && cur.sa_sigaction == on_bus)) {
        memset(&sa, 0, sizeof sa);
        sa.sa_sigaction = on_bus;
        sa.sa_flags = SA_SIGINFO;
        sigemptyset(&sa.sa_mask);
        r = sigaction(SIGBUS, &sa, &bus_prev);
    }
    pthread_mutex_unlock(&bus_mu);
    return r;
}

/* Bytes [offset, offset + total segment bytes) of fd (a regular file at least that long, as the caller's fstat
   said) into the segments through a read-only shared mapping of the page cache, summed on the way (copy_sum).
   Returns the bytes copied or -errno: -EFAULT when the file shrank under the mapping (SIGBUS). */
int64_t dsakv_map_sum(int fd, int64_t offset, int64_t nseg, const int64_t *segs, uint64_t *sum) {
    uint64_t want = 0, pos = 0, total = 0;
    for (int64_t i = 0; i < nseg; i++) want += (uint64_t)segs[2 * i + 1];
    *sum = 0;
    if (!want) return 0;
    if (guard_bus() != 0) return -(int64_t)errno;
    size_t maplen = (size_t)offset + want;
    char *map = mmap(NULL, maplen, PROT_READ, MAP_SHARED, fd, 0);
    if (map == MAP_FAILED) return -(int64_t)errno;
    sigjmp_buf jb;
    if (sigsetjmp(jb, 1)) {
        munmap(map, maplen);
        return -EFAULT;
    }
    bus_jmp = &jb;
    const char *src = map + offset;
    for (int64_t i = 0; i < nseg; i++) {
        copy_sum((char *)(intptr_t)segs[2 * i], src, (uint64_t)segs[2 * i + 1], &pos, &total);
        src += segs[2 * i + 1];
    }
    bus_jmp = NULL;
#if defined(__SSE2__)
    _mm_sfence();
#endif
    munmap(map, maplen);
    *sum = total;
    return (int64_t)want;
}

/* ---- the disk tier's batch read (storage/file.py FileStore.get): one call per batch, the GIL released ---- */

enum { PG_OK = 0, PG_MISSING = 1, PG_OPEN = 2, PG_NOTREG = 3, PG_SIZE = 4, PG_HEADER = 5, PG_SHORT = 6,
       PG_CHECKSUM = 7, PG_IOERR = 8, PG_SHRANK = 9 };

typedef struct {
    int dirfd;
    const char *names;          /* page i's path relative to dirfd at names + i * namelen, NUL terminated */
    int64_t namelen;
    const unsigned char *expect; /* page i's expected header prefix at expect + i * cmp_bytes */
    int64_t cmp_bytes, head_bytes, file_bytes;
    uint64_t mix;               /* checksum = word sum ^ (payload bytes * mix), stored at head[cmp_bytes..+8] */
    const int64_t *segoff;      /* page i's segments: segs[segoff[i] .. segoff[i + 1]) rows of (addr, bytes) */
    const int64_t *segs;
    int advise;                 /* posix_fadvise(WILLNEED) each page file as it is opened (one ahead) */
    int map;                    /* copy from a mapping of the file (dsakv_map_sum), else preadv (dsakv_read_sum) */
    unsigned char *heads;       /* page i's header bytes as read go to heads + i * head_bytes */
} pages_job;

/* A batch's pages split into contiguous shares, one a thread: every part struct begins with its share. */
typedef struct {
    int64_t lo, hi; /* pages [lo, hi) */
} share;
enum { MAX_SHARES = 16 };

/* Runs fn on `threads` shares of pages [0, n) (clamped to 1..MAX_SHARES and n): parts holds MAX_SHARES structs of
   `size` bytes, each beginning with a share whose lo/hi this sets. Share 0, and any share whose thread did not
   start, runs on the calling thread. Returns the number of shares. */
static int run_shares(int64_t n, int threads, void *parts, size_t size, void *(*fn)(void *)) {
    pthread_t tids[MAX_SHARES];
    int started[MAX_SHARES];
    char *base = parts;
    if (threads < 1) threads = 1;
    if (threads > MAX_SHARES) threads = MAX_SHARES;
    if (threads > n) threads = n > 0 ? (int)n : 1;
    for (int t = 0; t < threads; t++) {
        share *sh = (share *)(base + (size_t)t * size);
        sh->lo = n * t / threads;
        sh->hi = n * (t + 1) / threads;
    }
    for (int t = 1; t < threads; t++) started[t] = pthread_create(&tids[t], NULL, fn, base + (size_t)t * size) == 0;
    fn(base);
    for (int t = 1; t < threads; t++) {
        if (started[t]) pthread_join(tids[t], NULL);
        else fn(base + (size_t)t * size); /* no thread: run its share here */
    }
    return threads;
}

typedef struct {
    int64_t lo, hi;             /* pages [lo, hi): a share, first */
    const pages_job *job;
    int64_t fail, status, aux;  /* first failing page (hi if none), its status and detail (errno, size, bytes) */
} pages_part;

static int open_page(const pages_job *j, int64_t i, int *err) {
    int fd;
    do fd = openat(j->dirfd, j->names + i * j->namelen, O_RDONLY | O_NONBLOCK | O_NOFOLLOW | O_CLOEXEC);
    while (fd < 0 && errno == EINTR);
    *err = fd < 0 ? errno : 0;
    if (fd >= 0 && j->advise) posix_fadvise(fd, 0, (off_t)j->file_bytes, POSIX_FADV_WILLNEED);
    return fd;
}

/* Opens, checks (regular file of file_bytes, header prefix, payload checksum) and reads page files [lo, hi) into
   their segments, stopping at the first that fails. The next page's file is opened (and, with `advise`, its
   readahead started) before this one is read. */
static void *read_part(void *arg) {
    pages_part *pp = (pages_part *)arg;
    const pages_job *j = pp->job;
    int64_t payload = j->file_bytes - j->head_bytes;
    int err = 0, next_err = 0;
    int next = pp->lo < pp->hi ? open_page(j, pp->lo, &next_err) : -1;
    pp->fail = pp->hi;
    for (int64_t i = pp->lo; i < pp->hi; i++) {
        int fd = next;
        err = next_err;
        next = i + 1 < pp->hi ? open_page(j, i + 1, &next_err) : -1;
        int64_t status = PG_OK, aux = 0;
        struct stat st;
        if (fd < 0) {
            status = err == ENOENT ? PG_MISSING : PG_OPEN;
            aux = err;
        } else if (fstat(fd, &st) != 0) {
            status = PG_IOERR;
            aux = errno;
        } else if (!S_ISREG(st.st_mode)) {
            status = PG_NOTREG;
        } else if ((int64_t)st.st_size != j->file_bytes) {
            status = PG_SIZE;
            aux = (int64_t)st.st_size;
        } else {
            ssize_t h;
            unsigned char *hd = j->heads + i * j->head_bytes;
            do h = pread(fd, hd, (size_t)j->head_bytes, 0);
            while (h < 0 && errno == EINTR);
            if (h < 0) {
                status = PG_IOERR;
                aux = errno;
            } else if (h != j->head_bytes || memcmp(hd, j->expect + i * j->cmp_bytes, (size_t)j->cmp_bytes)) {
                status = PG_HEADER;
                aux = h;
            } else {
                uint64_t want, sum = 0;
                memcpy(&want, hd + j->cmp_bytes, 8);
                const int64_t *sg = j->segs + 2 * j->segoff[i];
                int64_t nsg = j->segoff[i + 1] - j->segoff[i];
                int64_t got = j->map ? dsakv_map_sum(fd, j->head_bytes, nsg, sg, &sum)
                                     : dsakv_read_sum(fd, j->head_bytes, nsg, sg, &sum);
                if (got == -EFAULT && j->map) {
                    status = PG_SHRANK;
                } else if (got < 0) {
                    status = PG_IOERR;
                    aux = -got;
                } else if (got != payload) {
                    status = PG_SHORT;
                    aux = got;
                } else if ((sum ^ ((uint64_t)payload * j->mix)) != want) {
                    status = PG_CHECKSUM;
                }
            }
        }
        if (fd >= 0) close(fd);
        if (status != PG_OK) {
            pp->fail = i;
            pp->status = status;
            pp->aux = aux;
            break;
        }
    }
    if (next >= 0) close(next);
    return NULL;
}

/* Reads pages [0, n) (see pages_job) with `threads` threads, each a contiguous share of the pages. Returns k: the
   pages before the first failing one, all read and verified; when k < n, detail = (status, aux) of page k.
   heads: n * head_bytes bytes, page i's header as read at heads + i * head_bytes (pages [0, k], as far as read).
   Then stamps pages [0, k) whose stamp_ns is not 0 (utimensat, no symlink
   follow: the LRU order), ok_stamp[i] = 0 where that failed. */
int64_t dsakv_read_pages(int dirfd, int64_t n, const char *names, int64_t namelen, const unsigned char *expect,
                         int64_t cmp_bytes, int64_t head_bytes, int64_t file_bytes, uint64_t mix,
                         const int64_t *segoff, const int64_t *segs, int advise, int map, int threads,
                         const int64_t *stamp_ns, unsigned char *ok_stamp, int64_t *detail, unsigned char *heads) {
    pages_job job = {dirfd, names, namelen, expect, cmp_bytes, head_bytes, file_bytes, mix, segoff, segs, advise,
                     map, heads};
    pages_part parts[MAX_SHARES];
    if (cmp_bytes + 8 > head_bytes) return -EINVAL;
    for (int t = 0; t < MAX_SHARES; t++) {
        parts[t].job = &job;
        parts[t].status = PG_OK;
        parts[t].aux = 0;
    }
    threads = run_shares(n, threads, parts, sizeof(parts[0]), read_part);
    int64_t k = n;
    detail[0] = PG_OK;
    detail[1] = 0;
    for (int t = 0; t < threads; t++) {
        if (parts[t].fail < parts[t].hi) {
            k = parts[t].fail;
            detail[0] = parts[t].status;
            detail[1] = parts[t].aux;
            break;
        }
    }
    for (int64_t i = 0; i < k; i++) {
        ok_stamp[i] = 1;
        if (!stamp_ns[i]) continue;
        struct timespec ts[2];
        ts[0].tv_sec = ts[1].tv_sec = (time_t)(stamp_ns[i] / 1000000000);
        ts[0].tv_nsec = ts[1].tv_nsec = (long)(stamp_ns[i] % 1000000000);
        if (utimensat(dirfd, names + i * namelen, ts, AT_SYMLINK_NOFOLLOW) != 0) ok_stamp[i] = 0;
    }
    return k;
}
/* ---- the disk tier's batch write (storage/file.py FileStore.put): one call per batch, the GIL released ---- */

typedef struct {
    int dirfd;
    const char *names, *tmps;   /* page i's file and its temporary, relative to dirfd, NUL terminated */
    int64_t namelen, tmplen;
    unsigned char *heads;       /* page i's header at heads + i * head_bytes; its checksum is filled in here */
    int64_t cmp_bytes, head_bytes, payload;
    uint64_t mix;
    const int64_t *segoff, *segs;
    int64_t window;             /* > 0: write_windows of this many file bytes; 0: one pwritev (write_all) */
} wpages_job;

typedef struct {
    int64_t lo, hi;             /* pages [lo, hi): a share, first */
    const wpages_job *job;
    int64_t fail, err;          /* first page not written (hi if none) and its errno */
} wpages_part;

/* header + segments to fd from offset 0 in as few pwritev calls as the iovec limit allows (one for a page: the
   page cache gets large folios, which the mapped read then maps cheaply); 0 or errno. */
static int64_t write_all(int fd, const unsigned char *head, int64_t head_bytes, int64_t nseg, const int64_t *segs,
                         int64_t want) {
    enum { MAXIOV = 1024 };
    struct iovec iov[MAXIOV];
    int64_t done = 0, i = 0;
    uint64_t skip = 0;  /* bytes of the current entry already written; entry -1 is the header */
    int in_head = 1;
    while (done < want) {
        int cnt = 0;
        if (in_head) {
            iov[cnt].iov_base = (void *)(head + skip);
            iov[cnt].iov_len = (size_t)((uint64_t)head_bytes - skip);
            cnt++;
        }
        for (int64_t k = i; k < nseg && cnt < MAXIOV; k++) {
            uint64_t off = (!in_head && k == i) ? skip : 0;
            char *base = (char *)(intptr_t)segs[2 * k] + off;
            size_t len = (size_t)((uint64_t)segs[2 * k + 1] - off);
            if (cnt && (char *)iov[cnt - 1].iov_base + iov[cnt - 1].iov_len == base) iov[cnt - 1].iov_len += len;
            else { iov[cnt].iov_base = base; iov[cnt].iov_len = len; cnt++; }
        }
        ssize_t r = pwritev(fd, iov, cnt, (off_t)done);
        if (r < 0) {
            if (errno == EINTR) continue;
            return errno;
        }
        if (r == 0) return EIO;
        done += r;
        uint64_t left = (uint64_t)r; /* advance (in_head, i, skip) by r bytes */
        if (in_head) {
            uint64_t h = (uint64_t)head_bytes - skip;
            if (left < h) { skip += left; continue; }
            left -= h;
            in_head = 0;
            skip = 0;
        }
        while (i < nseg && left >= (uint64_t)segs[2 * i + 1] - skip) {
            left -= (uint64_t)segs[2 * i + 1] - skip;
            skip = 0;
            i++;
        }
        skip += left;
    }
    return 0;
}

/* pwritev of all of iov[0, cnt) at off, resumed after short writes (iov is consumed); 0 or errno. */
static int64_t pwritev_all(int fd, struct iovec *iov, int cnt, int64_t off) {
    int c0 = 0;
    while (c0 < cnt) {
        ssize_t r = pwritev(fd, iov + c0, cnt - c0, (off_t)off);
        if (r < 0) {
            if (errno == EINTR) continue;
            return errno;
        }
        if (r == 0) return EIO;
        off += r;
        while (c0 < cnt && (size_t)r >= iov[c0].iov_len) { r -= (ssize_t)iov[c0].iov_len; c0++; }
        if (c0 < cnt) { iov[c0].iov_base = (char *)iov[c0].iov_base + r; iov[c0].iov_len -= (size_t)r; }
    }
    return 0;
}

/* The payload in windows that end on multiples of `window` file bytes (so page-cache folios stay large), each
   summed just before it is written (the kernel's copy then reads it from cache: one pass over memory), then the
   record with the checksum at offset 0; 0 or errno. */
static int64_t write_windows(int fd, unsigned char *head, int64_t head_bytes, int64_t cmp_bytes, uint64_t mix,
                             int64_t nseg, const int64_t *segs, int64_t payload, int64_t window) {
    enum { MAXIOV = 1024 };
    struct iovec iov[MAXIOV];
    uint64_t pos = 0, total = 0, off = 0; /* off: bytes of segs[k] already written */
    int64_t a = 0, k = 0;
    while (a < payload) {
        int64_t b = ((head_bytes + a) / window + 1) * window - head_bytes;
        if (b > payload) b = payload;
        int cnt = 0;
        int64_t need = b - a;
        while (need > 0 && k < nseg && cnt < MAXIOV) {
            uint64_t len = (uint64_t)segs[2 * k + 1] - off;
            if (len > (uint64_t)need) len = (uint64_t)need;
            char *base = (char *)(intptr_t)segs[2 * k] + off;
            if (cnt && (char *)iov[cnt - 1].iov_base + iov[cnt - 1].iov_len == base) iov[cnt - 1].iov_len += len;
            else { iov[cnt].iov_base = base; iov[cnt].iov_len = len; cnt++; }
            need -= (int64_t)len;
            off += len;
            if (off == (uint64_t)segs[2 * k + 1]) { k++; off = 0; }
        }
        if (need > 0 && k >= nseg) return EINVAL; /* segments shorter than the payload */
        b -= need;                                /* the iovec limit: a shorter window */
        for (int c = 0; c < cnt; c++) sum_into((const unsigned char *)iov[c].iov_base, iov[c].iov_len, &pos, &total);
        int64_t err = pwritev_all(fd, iov, cnt, head_bytes + a);
        if (err) return err;
        a = b;
    }
    uint64_t c = total ^ ((uint64_t)payload * mix);
    memcpy(head + cmp_bytes, &c, 8);
    iov[0].iov_base = head;
    iov[0].iov_len = (size_t)head_bytes;
    return pwritev_all(fd, iov, 1, 0);
}

/* Page i: a new temporary (its directory made if missing), the payload's checksum (dsakv_sum64) into its
   header, header + payload in one pwritev (write_all), renamed into place; 0 or errno (the temporary removed). */
static int64_t write_page(const wpages_job *j, int64_t i) {
    const char *name = j->names + i * j->namelen, *tmp = j->tmps + i * j->tmplen;
    int fd = openat(j->dirfd, tmp, O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
    if (fd < 0 && errno == ENOENT) {
        char dir[256];
        const char *slash = strchr(name, '/');
        size_t len = slash ? (size_t)(slash - name) : 0;
        if (len && len < sizeof dir) {
            memcpy(dir, name, len);
            dir[len] = 0;
            if (mkdirat(j->dirfd, dir, 0777) != 0 && errno != EEXIST) return errno;
            fd = openat(j->dirfd, tmp, O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
        }
    }
    if (fd < 0) return errno;
    int64_t err = 0;
    unsigned char *head = j->heads + i * j->head_bytes;
    int64_t nseg = j->segoff[i + 1] - j->segoff[i];
    const int64_t *sg = j->segs + 2 * j->segoff[i];
    if (j->window > 0) {
        err = write_windows(fd, head, j->head_bytes, j->cmp_bytes, j->mix, nseg, sg, j->payload, j->window);
    } else {
        uint64_t c = dsakv_sum64(nseg, sg) ^ ((uint64_t)j->payload * j->mix);
        memcpy(head + j->cmp_bytes, &c, 8);
        err = write_all(fd, head, j->head_bytes, nseg, sg, j->head_bytes + j->payload);
    }
    if (close(fd) != 0 && !err) err = errno;
    if (!err && renameat(j->dirfd, tmp, j->dirfd, name) != 0) err = errno;
    if (err) unlinkat(j->dirfd, tmp, 0);
    return err;
}

static void *write_part(void *arg) {
    wpages_part *pp = (wpages_part *)arg;
    pp->fail = pp->hi;
    for (int64_t i = pp->lo; i < pp->hi; i++) {
        int64_t err = write_page(pp->job, i);
        if (err) {
            pp->fail = i;
            pp->err = err;
            break;
        }
    }
    return NULL;
}

/* Writes pages [0, n) (see wpages_job) with `threads` threads, each a contiguous share. Returns k: pages [0, k)
   are in place; when k < n, *err is page k's errno, and the pages after k that other threads wrote are removed
   again (a batch writes a prefix, as the Python loop does). */
int64_t dsakv_write_pages(int dirfd, int64_t n, const char *names, int64_t namelen, const char *tmps,
                          int64_t tmplen, unsigned char *heads, int64_t cmp_bytes, int64_t head_bytes,
                          int64_t payload, uint64_t mix, const int64_t *segoff, const int64_t *segs,
                          int64_t window, int threads, int64_t *err) {
    wpages_job job = {dirfd, names, tmps, namelen, tmplen, heads, cmp_bytes, head_bytes, payload, mix, segoff, segs,
                      window};
    wpages_part parts[MAX_SHARES];
    if (cmp_bytes + 8 > head_bytes) return -EINVAL;
    for (int t = 0; t < MAX_SHARES; t++) {
        parts[t].job = &job;
        parts[t].err = 0;
    }
    threads = run_shares(n, threads, parts, sizeof(parts[0]), write_part);
    int64_t k = n;
    *err = 0;
    for (int t = 0; t < threads; t++) {
        if (k < n) { /* after the first failure: undo what later shares wrote */
            for (int64_t i = parts[t].lo; i < parts[t].fail; i++) unlinkat(dirfd, names + i * namelen, 0);
        } else if (parts[t].fail < parts[t].hi) {
            k = parts[t].fail;
            *err = parts[t].err;
        }
    }
    return k;
}
