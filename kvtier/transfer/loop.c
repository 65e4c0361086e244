/* kvtier's compiled submission loop (kvtier/transfer/native.py builds and binds it): one foreign
   call submits a whole operation, or starts a thread that does (kvtier_start). */
#include <pthread.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

typedef int (*copy_fn)(void *, const void *, size_t, int, void *);
typedef int (*batch_fn)(void **, void **, size_t *, size_t, void *, size_t *, size_t, void *);
typedef int (*record_fn)(void *, void *);
typedef int (*wait_fn)(void *, void *, unsigned int);
typedef int (*device_fn)(int);
typedef int (*launch_fn)(void *, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned,
                         void *, void **, void **);

#define P(x) ((void *)(intptr_t)(x))

/* The runtime's entry points, as `Native` binds them once (`launch`: the driver's cuLaunchKernel). */
typedef struct {
    copy_fn copy;
    batch_fn batch; /* NULL where the runtime has none */
    record_fn record;
    wait_fn wait;
    launch_fn launch; /* NULL where no kernel can be launched from here */
    void *attrs;
    int64_t copy_kind;
    device_fn set_device; /* NULL: the submitting thread keeps the runtime's default device */
} kvtier_runtime;

/* One buffer of a pool pair, as `kvtier_run_layers` addresses its rows. */
typedef struct {
    int64_t row_bytes;     /* bytes of one slot's row */
    int64_t region_slots;  /* host slots per region: region = slot / region_slots */
    int64_t page;          /* within a region, slot r is row (r / page) * page_rows + r % page */
    int64_t page_rows;
    int64_t regions;       /* columns of `host` */
    const int64_t *host;   /* [buffer layers, regions]: address of each region's first row per layer */
    const int64_t *device; /* [buffer layers]: address of each layer's first device row */
    const int64_t *local;  /* [model layers]: the buffer's layer of each model layer, or -1 */
} kvtier_buffer;

/* One compiled launch of the row kernel: parameters (src, src offsets, dst, dst offsets, n, row
   vectors) then `extra` null pointers; n and the row vectors take `n_bytes` and `vecs_bytes`
   bytes (4 or 8; 0: folded into the kernel as a constant). */
typedef struct {
    void *func;
    int64_t grid, threads, shared, src_off, dst_off, n, row_vecs, n_bytes, vecs_bytes, extra;
} kvtier_launch;

/* One buffer's share of an operation: `n_runs` copies (`runs` [3, n_runs]: first host slot, first
   device slot, length) and, where `launches` is set, one launch a layer, launches[layer_class[j]]
   on buffer layer j, from the layer's first host region (load: host -> device). */
typedef struct {
    const int64_t *runs;
    int64_t n_runs;
    const kvtier_launch *launches;
    const int64_t *layer_class;
} kvtier_work;

/* The int64 arguments of kvtier_run_layers, in order (see `Native.run`). */
enum { WORK, BUFS, N_BUFS, LAYERS, LOAD, EVENTS, N_EVENTS, STREAMS, N_STREAMS, FORKS, ORDER_EVENT,
       ORDER_STREAM, SMALL };
/* Its own failures, before any runtime call (runtime errors are positive). */
enum { NO_BATCH = -1, NO_MEMORY = -3, NO_LAUNCH = -4 };

/* An operation the loop makes on a thread of its own (kvtier_start): `progress` layers have their
   event recorded, `done` once the loop returned `err`; the caller waits with kvtier_wait and frees
   it with kvtier_finish. */
typedef struct {
    const kvtier_runtime *rt;
    int64_t args[SMALL + 1], device, failed, progress;
    int err, done;
    pthread_mutex_t lock;
    pthread_cond_t moved;
} kvtier_job;

static void job_moved(kvtier_job *job, int64_t progress) {
    if (!job) return;
    pthread_mutex_lock(&job->lock);
    job->progress = progress;
    pthread_cond_broadcast(&job->moved);
    pthread_mutex_unlock(&job->lock);
}

static void *param(int64_t bytes, int64_t *wide, int32_t *narrow) {
    *narrow = (int32_t)*wide;
    return bytes == 4 ? (void *)narrow : (void *)wide;
}

static int launch_rows(const kvtier_runtime *rt, const kvtier_launch *k, int64_t src, int64_t dst, void *st) {
    int64_t s = src, d = dst, so = k->src_off, dof = k->dst_off, n = k->n, v = k->row_vecs;
    int32_t n32, v32;
    void *null = NULL, *params[16];
    int p = 0;
    params[p++] = &s, params[p++] = &so, params[p++] = &d, params[p++] = &dof;
    params[p++] = param(k->n_bytes, &n, &n32);
    if (k->vecs_bytes) params[p++] = param(k->vecs_bytes, &v, &v32);
    for (int64_t e = 0; e < k->extra && p < 16; e++) params[p++] = &null;
    unsigned grid = (unsigned)k->grid, threads = (unsigned)k->threads, shared = (unsigned)k->shared;
    return rt->launch(k->func, grid, 1, 1, threads, 1, 1, shared, st, params, NULL);
}

/* Move every buffer's work on every model layer. Layer l goes on streams[l % n_streams]; first,
   streams[0] waits for the work queued on `order_stream` (when `order_event` is set) and the
   other streams for streams[0] (forks[0]); at the end they join it (forks[s]). events[l] is
   recorded after layer l (one event: after the last layer); the last is recorded on streams[0]
   after the join. A buffer with more than `small` runs takes one batched call per layer. 0, or the
   first error and its layer (-1: the ordering calls, `layers`: the join and the last record);
   `job` (or NULL) learns each layer whose event is recorded. */
static int run_layers(const kvtier_runtime *rt, const int64_t *args, int64_t *failed_layer, kvtier_job *job) {
    const kvtier_work *work = (const kvtier_work *)P(args[WORK]);
    const kvtier_buffer *bufs = (const kvtier_buffer *)P(args[BUFS]);
    const int64_t *events = (const int64_t *)P(args[EVENTS]), *streams = (const int64_t *)P(args[STREAMS]);
    const int64_t *forks = (const int64_t *)P(args[FORKS]);
    int64_t n_bufs = args[N_BUFS], layers = args[LAYERS], n_events = args[N_EVENTS], k = args[N_STREAMS];
    int64_t small = args[SMALL], most = 0;
    int load = (int)args[LOAD];
    void *order_event = P(args[ORDER_EVENT]), *main = P(streams[0]);
    record_fn record = rt->record;
    wait_fn wait = rt->wait;
    int err = 0;
    int64_t *scratch = NULL; /* a batched call's dst [n], src [n], bytes [n] */
    *failed_layer = -1;
    for (int64_t b = 0; b < n_bufs; b++) { /* before any call, so a failure here submits nothing */
        if (work[b].launches && !rt->launch) return NO_LAUNCH;
        if (work[b].n_runs > small && work[b].n_runs > most) most = work[b].n_runs;
    }
    if (most && !rt->batch) return NO_BATCH;
    if (most && !(scratch = malloc(3 * most * sizeof(int64_t)))) return NO_MEMORY;
    if (order_event && !(err = record(order_event, P(args[ORDER_STREAM])))) err = wait(main, order_event, 0);
    if (k > 1 && !err) err = record(P(forks[0]), main);
    for (int64_t s = 1; s < k && !err; s++) err = wait(P(streams[s]), P(forks[0]), 0);
    for (int64_t l = 0; l < layers && !err; l++) {
        void *stream = P(streams[l % k]);
        *failed_layer = l;
        for (int64_t b = 0; b < n_bufs && !err; b++) {
            const kvtier_buffer *f = bufs + b;
            const kvtier_work *w = work + b;
            const int64_t *runs = w->runs;
            int64_t j = f->local[l], n = w->n_runs;
            if (j < 0) continue;
            const int64_t *host = f->host + j * f->regions;
            int64_t dev = f->device[j], rb = f->row_bytes;
            for (int64_t r = 0; r < n && !err; r++) {
                int64_t h = runs[r], region = h / f->region_slots, rel = h - region * f->region_slots;
                int64_t ha = host[region] + ((rel / f->page) * f->page_rows + rel % f->page) * rb;
                int64_t da = dev + runs[n + r] * rb, bytes = runs[2 * n + r] * rb;
                int64_t dst = load ? da : ha, src = load ? ha : da;
                if (n > small) {
                    scratch[r] = dst, scratch[n + r] = src, scratch[2 * n + r] = bytes;
                } else {
                    err = rt->copy(P(dst), P(src), (size_t)bytes, (int)rt->copy_kind, stream);
                }
            }
            if (!err && n > small) {
                size_t attrs_index = 0;
                void **dsts = (void **)scratch, **srcs = (void **)(scratch + n);
                size_t *sizes = (size_t *)(scratch + 2 * n);
                err = rt->batch(dsts, srcs, sizes, (size_t)n, rt->attrs, &attrs_index, 1, stream);
            }
            if (!err && w->launches) {
                const kvtier_launch *kl = w->launches + w->layer_class[j];
                if (kl->grid) err = launch_rows(rt, kl, load ? host[0] : dev, load ? dev : host[0], stream);
            }
        }
        if (!err && n_events == layers && (k == 1 || l < layers - 1)) err = record(P(events[l]), stream);
        if (!err && n_events == layers && l < layers - 1) job_moved(job, l + 1);
    }
    if (!err) *failed_layer = layers;
    for (int64_t s = 1; s < k && !err; s++)
        if (!(err = record(P(forks[s]), P(streams[s])))) err = wait(main, P(forks[s]), 0);
    if (!err && (k > 1 || n_events != layers)) err = record(P(events[n_events - 1]), main);
    free(scratch);
    return err;
}

int kvtier_run_layers(const kvtier_runtime *rt, const int64_t *args, int64_t *failed_layer) {
    return run_layers(rt, args, failed_layer, NULL);
}

static void *job_main(void *arg) {
    kvtier_job *job = arg;
    int err = job->rt->set_device ? job->rt->set_device((int)job->device) : 0;
    job->failed = -2;
    if (!err) err = run_layers(job->rt, job->args, &job->failed, job);
    pthread_mutex_lock(&job->lock);
    job->err = err, job->done = 1;
    pthread_cond_broadcast(&job->moved);
    pthread_mutex_unlock(&job->lock);
    return NULL;
}

/* kvtier_run_layers on a new thread (on `device`, where the runtime can set it): the job, or NULL
   where no thread could be started (nothing was called). */
kvtier_job *kvtier_start(const kvtier_runtime *rt, const int64_t *args, int64_t device) {
    kvtier_job *job = calloc(1, sizeof(kvtier_job));
    pthread_t thread;
    if (!job) return NULL;
    job->rt = rt, job->device = device;
    memcpy(job->args, args, sizeof(job->args));
    pthread_mutex_init(&job->lock, NULL);
    pthread_cond_init(&job->moved, NULL);
    if (pthread_create(&thread, NULL, job_main, job)) {
        free(job);
        return NULL;
    }
    pthread_detach(thread);
    return job;
}

/* Block until `job` has recorded the events of `layers` layers or is done: its progress, or -1 once
   done (0 layers: the progress without waiting). */
int64_t kvtier_wait(kvtier_job *job, int64_t layers) {
    pthread_mutex_lock(&job->lock);
    while (!job->done && job->progress < layers) pthread_cond_wait(&job->moved, &job->lock);
    int64_t out = job->done ? -1 : job->progress;
    pthread_mutex_unlock(&job->lock);
    return out;
}

/* Wait for `job` to be done, free it: the loop's result and its failed layer. */
int kvtier_finish(kvtier_job *job, int64_t *failed_layer) {
    kvtier_wait(job, INT64_MAX);
    int err = job->err;
    *failed_layer = job->failed;
    pthread_mutex_destroy(&job->lock);
    pthread_cond_destroy(&job->moved);
    free(job);
    return err;
}
