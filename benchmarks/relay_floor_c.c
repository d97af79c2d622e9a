/* The floor of a native relay: the least a C epoll program can do to proxy the load benchmark.
 *
 * It is not a router and not used by routerd. It exists to measure what any native data path
 * (one thread, one epoll loop, kernel sockets) must at least spend, on this machine, under
 * benchmarks/routerd_overhead.py's load, beside relay_floor.py (the Python floor): it reads a
 * request head and body (framed by Content-Length), writes them verbatim to a round-robin
 * backend over a kept-alive connection (TCP_NODELAY everywhere), and copies every response
 * read to the client unchanged, one write per read (no header rewriting, no token counting, no
 * JSON, no metrics, no decision). A response ends at a read whose running tail ends in the
 * last-chunk marker "0\r\n\r\n", which is true of that benchmark's backends; the upstream
 * connection then goes back to its backend's idle pool. A client has at most one request in
 * flight; a pipelined next request waits for the current response.
 *
 * Usage: python benchmarks/routerd_overhead.py --router floor-c  (compiles and runs this)
 *        gcc -O2 -o relay_floor_c benchmarks/relay_floor_c.c
 *        ./relay_floor_c PORT BACKEND_PORT [BACKEND_PORT ...]
 */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/epoll.h>
#include <sys/socket.h>
#include <unistd.h>

enum { LISTENER, CLIENT, UP };
typedef struct conn {
    int fd, kind, backend, taillen;
    unsigned ev;              /* epoll events currently registered */
    struct conn *peer;        /* client <-> upstream while a request is in flight */
    struct conn *next;        /* idle pool link (UP) or dead list link */
    char *in; size_t inlen, incap;    /* CLIENT: bytes not yet forwarded */
    char *out; size_t outlen, outcap; /* bytes the kernel did not take yet */
    char tail[5];
} conn;

static int ep, nback, rr;
static int *backs;
static conn **pools;      /* idle upstream connections per backend */
static conn *dead;        /* closed this batch; freed after it */
static char rbuf[65536];

static void die(const char *w) { perror(w); exit(1); }

static void nodelay(int fd) { int one = 1; setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one); }

static void want(conn *c, unsigned ev) {
    if (c->ev == ev) return;
    c->ev = ev;
    struct epoll_event e = {.events = ev, .data.ptr = c};
    if (epoll_ctl(ep, EPOLL_CTL_MOD, c->fd, &e) < 0) die("epoll_ctl mod");
}

static conn *add(int fd, int kind) {
    conn *c = calloc(1, sizeof *c);
    if (!c) die("calloc");
    c->fd = fd; c->kind = kind; c->ev = EPOLLIN;
    struct epoll_event e = {.events = EPOLLIN, .data.ptr = c};
    if (epoll_ctl(ep, EPOLL_CTL_ADD, fd, &e) < 0) die("epoll_ctl add");
    return c;
}

static void grow(char **b, size_t *cap, size_t need) {
    if (need <= *cap) return;
    size_t n = *cap ? *cap : 4096;
    while (n < need) n *= 2;
    if (!(*b = realloc(*b, n))) die("realloc");
    *cap = n;
}

static void unpool(conn *u) {
    for (conn **p = &pools[u->backend]; *p; p = &(*p)->next)
        if (*p == u) { *p = u->next; return; }
}

static void kill_conn(conn *c) {
    if (c->fd < 0) return;
    close(c->fd);  /* also removes it from the epoll set */
    c->fd = -1;
    if (c->kind == UP && !c->peer) unpool(c);
    conn *p = c->peer;
    c->peer = NULL;
    c->next = dead; dead = c;
    if (p) { p->peer = NULL; kill_conn(p); }  /* a client's upstream, or an upstream's client */
}

/* Write what can be written now, buffer the rest and wait for EPOLLOUT. 0, or -1 if c died. */
static int send_all(conn *c, const char *b, size_t n) {
    if (c->outlen == 0) {
        ssize_t w = write(c->fd, b, n);
        if (w < 0 && errno != EAGAIN && errno != EWOULDBLOCK) { kill_conn(c); return -1; }
        if (w > 0) { b += w; n -= (size_t)w; }
        if (n == 0) return 0;
    }
    grow(&c->out, &c->outcap, c->outlen + n);
    memcpy(c->out + c->outlen, b, n);
    c->outlen += n;
    want(c, c->ev | EPOLLOUT);
    return 0;
}

static void flush(conn *c) {
    ssize_t w = write(c->fd, c->out, c->outlen);
    if (w < 0) { if (errno != EAGAIN && errno != EWOULDBLOCK) kill_conn(c); return; }
    memmove(c->out, c->out + w, c->outlen - (size_t)w);
    c->outlen -= (size_t)w;
    if (c->outlen == 0) want(c, c->ev & ~EPOLLOUT);
}

static conn *upstream(int k) {
    conn *u = pools[k];
    if (u) { pools[k] = u->next; u->next = NULL; return u; }
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    if (fd < 0) return NULL;
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = htons(backs[k])};
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    /* Loopback: a blocking connect completes at once; go non-blocking after it. */
    if (connect(fd, (struct sockaddr *)&a, sizeof a) < 0) { close(fd); return NULL; }
    fcntl(fd, F_SETFL, fcntl(fd, F_GETFL) | O_NONBLOCK);
    nodelay(fd);
    u = add(fd, UP);
    u->backend = k;
    return u;
}

/* Forward the client's next request if a whole one is buffered and none is in flight. */
static void dispatch(conn *c) {
    if (c->peer || c->fd < 0) return;
    char *h = memmem(c->in, c->inlen, "\r\n\r\n", 4);
    if (!h) return;
    size_t head = (size_t)(h - c->in) + 4, body = 0;
    char *cl = memmem(c->in, head, "Content-Length: ", 16);
    if (cl) body = strtoul(cl + 16, NULL, 10);
    if (c->inlen < head + body) return;
    int k = rr = (rr + 1) % nback;
    conn *u = upstream(k);
    if (!u) { kill_conn(c); return; }
    u->peer = c; c->peer = u; u->taillen = 0;
    size_t n = head + body;
    if (send_all(u, c->in, n) < 0) return;
    memmove(c->in, c->in + n, c->inlen - n);
    c->inlen -= n;
}

static void on_client_read(conn *c) {
    grow(&c->in, &c->incap, c->inlen + 16384);
    ssize_t r = read(c->fd, c->in + c->inlen, c->incap - c->inlen);
    if (r == 0 || (r < 0 && errno != EAGAIN && errno != EWOULDBLOCK)) { kill_conn(c); return; }
    if (r < 0) return;
    c->inlen += (size_t)r;
    dispatch(c);
}

static void on_up_read(conn *u) {
    ssize_t r = read(u->fd, rbuf, sizeof rbuf);
    if (r == 0 || (r < 0 && errno != EAGAIN && errno != EWOULDBLOCK)) { kill_conn(u); return; }
    if (r < 0) return;
    conn *c = u->peer;
    if (!c) return;  /* bytes on an idle connection: nobody to give them to */
    if (send_all(c, rbuf, (size_t)r) < 0) return;  /* killed c and u */
    /* Keep the last 5 bytes of the response so the end marker is seen across reads. */
    if (r >= 5) { memcpy(u->tail, rbuf + r - 5, 5); u->taillen = 5; }
    else {
        int keep = u->taillen + (int)r > 5 ? 5 - (int)r : u->taillen;
        memmove(u->tail, u->tail + u->taillen - keep, (size_t)keep);
        memcpy(u->tail + keep, rbuf, (size_t)r);
        u->taillen = keep + (int)r;
    }
    if (u->taillen == 5 && memcmp(u->tail, "0\r\n\r\n", 5) == 0) {
        u->peer = NULL; c->peer = NULL; u->taillen = 0;
        u->next = pools[u->backend]; pools[u->backend] = u;
        dispatch(c);
    }
}

int main(int argc, char **argv) {
    if (argc < 3) { fprintf(stderr, "usage: %s PORT BACKEND_PORT [BACKEND_PORT ...]\n", argv[0]); return 2; }
    signal(SIGPIPE, SIG_IGN);
    nback = argc - 2;
    backs = calloc((size_t)nback, sizeof *backs);
    pools = calloc((size_t)nback, sizeof *pools);
    for (int i = 0; i < nback; i++) backs[i] = atoi(argv[i + 2]);
    int ls = socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK, 0), one = 1;
    if (ls < 0) die("socket");
    setsockopt(ls, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = htons(atoi(argv[1]))};
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    if (bind(ls, (struct sockaddr *)&a, sizeof a) < 0) die("bind");
    if (listen(ls, 1024) < 0) die("listen");
    if ((ep = epoll_create1(0)) < 0) die("epoll_create1");
    conn *lc = add(ls, LISTENER);
    struct epoll_event evs[256];
    for (;;) {
        int n = epoll_wait(ep, evs, 256, -1);
        if (n < 0) { if (errno == EINTR) continue; die("epoll_wait"); }
        for (int i = 0; i < n; i++) {
            conn *c = evs[i].data.ptr;
            unsigned e = evs[i].events;
            if (c == lc) {
                int fd;
                while ((fd = accept4(ls, NULL, NULL, SOCK_NONBLOCK)) >= 0) { nodelay(fd); add(fd, CLIENT); }
                continue;
            }
            if (c->fd >= 0 && (e & EPOLLOUT)) flush(c);
            if (c->fd >= 0 && (e & (EPOLLIN | EPOLLHUP | EPOLLERR))) {
                if (c->kind == CLIENT) on_client_read(c); else on_up_read(c);
            }
        }
        while (dead) { conn *d = dead; dead = d->next; free(d->in); free(d->out); free(d); }
    }
}
