// Probe: which mechanisms fill the PCIe link for a scattered reload, outside Python.
//
// One layer of a 131072-token deepseek-v3 prefix (rows of 1152 B, 151 MB) in pinned host
// memory, gathered into device memory at host runs of R rows (runs in random order,
// device side contiguous). Against one contiguous copy of the same bytes, in the same run:
//   dma   copy engine, one copy per run, split over S streams (batch call per stream,
//         or a cudaMemcpyAsync loop): do several copy engines hide the per-copy gap?
//   vec   SM gather, 16-byte loads, U loads in flight per thread (the Triton kernel's shape)
//   bulk  SM gather through the bulk copy unit: cp.async.bulk host -> shared memory, then
//         shared -> device; do bulk reads reach the link with larger requests than loads?
// Every variant's destination is poisoned first and compared with the host rows after.
// Prints one JSON object per line. Args: row_bytes modes runs [host_stride]: with a host row
// stride above row_bytes (rows padded in host memory, e.g. to 128-byte boundaries) only the
// vec variants run.
//
// Build and run on the device: nvcc -O3 -gencode=arch=compute_90,code=sm_90 -o probe probe_pcie.cu && ./probe
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <numeric>
#include <random>
#include <vector>

#include "check.h"

static const int N = 131072;

// ---- SM gather, 16-byte words, U loads in flight per thread -------------------------------
template <int U, class T>
__global__ void __launch_bounds__(1024) gather_vec(T* host, T* dev, const int* __restrict__ src_row,
                           int rows, int words_per_row, bool scatter, int host_stride) {
    // gather: dev[i] = host[src_row[i]]; scatter (device -> host): host[src_row[i]] = dev[i]
    long total = (long)rows * words_per_row;
    long stride = (long)gridDim.x * blockDim.x;
    for (long base = (long)blockIdx.x * blockDim.x + threadIdx.x; base < total; base += stride * U) {
        T v[U];
        long from[U], to[U];
#pragma unroll
        for (int u = 0; u < U; ++u) {
            long c = base + u * stride;
            from[u] = -1;
            if (c < total) {
                int r = (int)(c / words_per_row), w = (int)(c % words_per_row);
                long h = (long)src_row[r] * host_stride + w;
                from[u] = scatter ? c : h;
                to[u] = scatter ? h : c;
                v[u] = scatter ? dev[from[u]] : host[from[u]];
            }
        }
#pragma unroll
        for (int u = 0; u < U; ++u)
            if (from[u] >= 0) (scatter ? host : dev)[to[u]] = v[u];
    }
}

// ---- SM gather through the bulk copy unit ----------------------------------------------------
__device__ __forceinline__ uint32_t smem_addr(const void* p) { return (uint32_t)__cvta_generic_to_shared(p); }

__device__ __forceinline__ void bulk_load(void* dst_smem, const void* src, uint32_t bytes, uint64_t* bar) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem_addr(bar)), "r"(bytes)
                 : "memory");
    asm volatile(
        "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(
            smem_addr(dst_smem)),
        "l"(src), "r"(bytes), "r"(smem_addr(bar))
        : "memory");
}

__device__ __forceinline__ void bar_wait(uint64_t* bar, uint32_t parity) {
    asm volatile(
        "{\n .reg .pred p;\n WAIT_%=:\n"
        " mbarrier.try_wait.parity.shared::cta.b64 p, [%0], %1;\n"
        " @!p bra WAIT_%=;\n}" ::"r"(smem_addr(bar)),
        "r"(parity)
        : "memory");
}

__device__ __forceinline__ void bulk_store(void* dst, const void* src_smem, uint32_t bytes) {
    asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;" ::"l"(dst), "r"(smem_addr(src_smem)),
                 "r"(bytes)
                 : "memory");
    asm volatile("cp.async.bulk.commit_group;" ::: "memory");
}

// Each thread runs its own pipeline of `nbuf` row buffers: a buffer is refilled as soon as
// its row has been stored out, so nbuf-1 .. nbuf rows per thread are in flight.
__global__ void gather_bulk(const char* __restrict__ host, char* __restrict__ dev, const int* __restrict__ src_row,
                            int rows, int row_bytes, int nbuf) {
    extern __shared__ __align__(128) char smem[];
    uint64_t* bars = (uint64_t*)smem;  // [blockDim * nbuf]
    char* bufs = smem + ((blockDim.x * nbuf * 8 + 127) / 128) * 128;
    int t = threadIdx.x;
    for (int b = 0; b < nbuf; ++b)
        asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(smem_addr(&bars[t * nbuf + b])));
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    __syncthreads();
    int lane0 = blockIdx.x * blockDim.x + t, lanes = gridDim.x * blockDim.x;
    auto row_of = [&](int i) { return lane0 + i * lanes; };
    auto buf = [&](int b) { return bufs + (long)(t * nbuf + b) * row_bytes; };
    for (int b = 0; b < nbuf && row_of(b) < rows; ++b)
        bulk_load(buf(b), host + (long)src_row[row_of(b)] * row_bytes, row_bytes, &bars[t * nbuf + b]);
    for (int i = 0; row_of(i) < rows; ++i) {
        int b = i % nbuf;
        bar_wait(&bars[t * nbuf + b], (i / nbuf) & 1);
        bulk_store(dev + (long)row_of(i) * row_bytes, buf(b), row_bytes);
        asm volatile("cp.async.bulk.wait_group.read 0;" ::: "memory");
        int next = i + nbuf;
        if (row_of(next) < rows)
            bulk_load(buf(b), host + (long)src_row[row_of(next)] * row_bytes, row_bytes, &bars[t * nbuf + b]);
    }
    asm volatile("cp.async.bulk.wait_group 0;" ::: "memory");
}

// ---- helpers ---------------------------------------------------------------------------------
struct Ctx {
    int row_bytes;
    int stride;  // host row stride in bytes
    char* host;
    char* dev;
    char* host2;  // scatter destination
    std::vector<char> check;
    cudaStream_t main;
    std::vector<cudaStream_t> side;
    cudaEvent_t e0, e1;
    std::vector<cudaEvent_t> joins;
};

template <class F>
static double time_ms(Ctx& c, F issue, int repeats = 7) {
    std::vector<float> ms;
    for (int r = 0; r < repeats + 2; ++r) {
        CK(cudaEventRecord(c.e0, c.main));
        for (auto s : c.side) CK(cudaStreamWaitEvent(s, c.e0));
        issue();
        for (size_t i = 0; i < c.side.size(); ++i) {
            CK(cudaEventRecord(c.joins[i], c.side[i]));
            CK(cudaStreamWaitEvent(c.main, c.joins[i]));
        }
        CK(cudaEventRecord(c.e1, c.main));
        CK(cudaEventSynchronize(c.e1));
        float t;
        CK(cudaEventElapsedTime(&t, c.e0, c.e1));
        if (r >= 2) ms.push_back(t);
    }
    std::sort(ms.begin(), ms.end());
    return ms[ms.size() / 2];
}

// Poison the destination, run once, compare every row with its source. Gather: device row i
// holds host row src_row[i]. Scatter: host2 row src_row[i] holds device row i (= host row i).
template <class F>
static bool verify(Ctx& c, const std::vector<int>& src_row, F issue, bool scatter = false) {
    size_t bytes = (size_t)N * c.row_bytes;
    size_t hs = c.stride;
    if (scatter) {
        for (int i = 0; i < N; ++i)
            CK(cudaMemcpy(c.dev + (size_t)i * c.row_bytes, c.host + i * hs, c.row_bytes, cudaMemcpyHostToDevice));
        memset(c.host2, 0xAB, (size_t)N * hs);
    } else {
        CK(cudaMemset(c.dev, 0xAB, bytes));
    }
    CK(cudaDeviceSynchronize());
    issue();
    for (auto s : c.side) CK(cudaStreamSynchronize(s));
    CK(cudaStreamSynchronize(c.main));
    CK(cudaGetLastError());
    if (!scatter) CK(cudaMemcpy(c.check.data(), c.dev, bytes, cudaMemcpyDeviceToHost));
    for (int i = 0; i < N; ++i) {
        size_t rb = c.row_bytes;
        const char* got = scatter ? c.host2 + (size_t)src_row[i] * hs : c.check.data() + i * rb;
        const char* want = scatter ? c.host + i * hs : c.host + (size_t)src_row[i] * hs;
        if (memcmp(got, want, rb)) return false;
    }
    return true;
}

static void report(const char* variant, int row_bytes, int run, const char* extra, double ms, double ceiling_ms,
                   bool ok) {
    double gb = (double)N * row_bytes / 1e9;
    printf(
        "{\"variant\": \"%s\", \"row_bytes\": %d, \"host_run\": %d, %s\"ms\": %.4f, \"gbps\": %.2f, "
        "\"of_ceiling\": %.3f, \"identical\": %s}\n",
        variant, row_bytes, run, extra, ms, gb / (ms / 1e3), ceiling_ms / ms, ok ? "true" : "false");
    fflush(stdout);
}

int main(int argc, char** argv) {
    int row_bytes = argc > 1 ? atoi(argv[1]) : 1152;
    const char* modes = argc > 2 ? argv[2] : "dma,vec,bulk";
    std::vector<int> runs_list;
    for (const char* r = argc > 3 ? argv[3] : "256,64,16,4,1"; *r;) {
        runs_list.push_back(atoi(r));
        while (*r && *r != ',') ++r;
        if (*r) ++r;
    }
    int stride = argc > 4 ? atoi(argv[4]) : row_bytes;
    if (stride < row_bytes) stride = row_bytes;
    if (stride != row_bytes) modes = "vec";
    size_t bytes = (size_t)N * row_bytes, host_bytes = (size_t)N * stride;
    Ctx c;
    c.row_bytes = row_bytes;
    c.stride = stride;
    CK(cudaHostAlloc(&c.host, host_bytes, cudaHostAllocDefault));
    CK(cudaMalloc(&c.dev, bytes));
    CK(cudaHostAlloc(&c.host2, host_bytes, cudaHostAllocDefault));
    c.check.resize(bytes);
    std::mt19937_64 rng(7);
    for (size_t i = 0; i < host_bytes / 8; ++i) ((uint64_t*)c.host)[i] = rng();
    CK(cudaStreamCreateWithFlags(&c.main, cudaStreamNonBlocking));
    CK(cudaEventCreate(&c.e0));
    CK(cudaEventCreate(&c.e1));
    int* d_src;
    CK(cudaMalloc(&d_src, N * sizeof(int)));
    int sms;
    CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
    int engines;
    CK(cudaDeviceGetAttribute(&engines, cudaDevAttrAsyncEngineCount, 0));
    printf("{\"sms\": %d, \"async_engines\": %d, \"cudart\": %d, \"host_stride\": %d}\n", sms, engines,
           CUDART_VERSION, stride);

    double ceiling = time_ms(c, [&] { CK(cudaMemcpyAsync(c.dev, c.host, bytes, cudaMemcpyHostToDevice, c.main)); });
    report("ceiling", row_bytes, N, "", ceiling, ceiling, true);
    double ceiling_d2h =
        time_ms(c, [&] { CK(cudaMemcpyAsync(c.host2, c.dev, bytes, cudaMemcpyDeviceToHost, c.main)); });
    report("ceiling_d2h", row_bytes, N, "", ceiling_d2h, ceiling_d2h, true);

    for (int run : runs_list) {
        int nruns = N / run;
        std::vector<int> perm(nruns);
        std::iota(perm.begin(), perm.end(), 0);
        std::shuffle(perm.begin(), perm.end(), rng);
        std::vector<int> src_row(N);
        for (int i = 0; i < N; ++i) src_row[i] = perm[i / run] * run + i % run;
        CK(cudaMemcpy(d_src, src_row.data(), N * sizeof(int), cudaMemcpyHostToDevice));

        // copy engine: one copy per run over S streams
        std::vector<void*> dsts(nruns), srcs(nruns), srcs2(nruns);
        std::vector<size_t> sizes(nruns, (size_t)run * row_bytes);
        for (int k = 0; k < nruns; ++k) {
            dsts[k] = c.dev + (size_t)k * run * row_bytes;
            srcs[k] = c.host + (size_t)perm[k] * run * row_bytes;
            srcs2[k] = c.host2 + (size_t)perm[k] * run * row_bytes;
        }
        if (run >= 4 && strstr(modes, "dma")) {
            for (int S : {1, 2, 4, 8}) {
                while ((int)c.side.size() < S - 1) {
                    cudaStream_t s;
                    cudaEvent_t e;
                    CK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
                    CK(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
                    c.side.push_back(s);
                    c.joins.push_back(e);
                }
                std::vector<cudaStream_t> side_all = c.side;
                c.side.resize(S - 1);
                for (int mode = 1; mode < 3; ++mode) {  // 0: the cudaMemcpyAsync loop (call 1: 0.66 at runs of 256)
                    int batch = mode > 0;
                    bool d2h = mode == 2;
                    auto issue = [&] {
                        // contiguous chunks of the run list per stream
                        for (int s = 0; s < S; ++s) {
                            cudaStream_t st = s == 0 ? c.main : c.side[s - 1];
                            int lo = (int)((long)nruns * s / S), hi = (int)((long)nruns * (s + 1) / S);
                            if (batch) {
                                cudaMemcpyAttributes a = {};
                                a.srcAccessOrder = cudaMemcpySrcAccessOrderStream;
                                a.flags = cudaMemcpyFlagPreferOverlapWithCompute;
                                size_t idx = 0;
                                auto& to = d2h ? srcs2 : dsts;
                                auto& from = d2h ? dsts : srcs;
                                CK(cudaMemcpyBatchAsync(to.data() + lo, from.data() + lo, sizes.data() + lo,
                                                        hi - lo, &a, &idx, 1, st));
                            } else {
                                for (int k = lo; k < hi; ++k)
                                    CK(cudaMemcpyAsync(dsts[k], srcs[k], sizes[k], cudaMemcpyHostToDevice, st));
                            }
                        }
                    };
                    bool ok = verify(c, src_row, issue, d2h);
                    double ms = time_ms(c, issue);
                    char extra[64];
                    snprintf(extra, sizeof extra, "\"streams\": %d, ", S);
                    report(d2h ? "dma_batch_d2h" : batch ? "dma_batch" : "dma_loop", row_bytes, run, extra, ms,
                           d2h ? ceiling_d2h : ceiling, ok);
                }
                c.side = side_all;
            }
        }
        std::vector<cudaStream_t> side_all = c.side;
        c.side.clear();
        bool wide = row_bytes % 16 == 0;
        int words = wide ? row_bytes / 16 : row_bytes / 4;
        int hstride = wide ? stride / 16 : stride / 4;
        for (int scatter = 0; scatter < 2 && strstr(modes, "vec"); ++scatter) {
            for (int ctas : {4, 8, 16}) {
                for (int threads : {256, 512, 1024}) {
                    auto issue = [&] {
                        char* h = scatter ? c.host2 : c.host;
                        if (wide)
                            gather_vec<8><<<ctas, threads, 0, c.main>>>((uint4*)h, (uint4*)c.dev, d_src, N, words,
                                                                         scatter, hstride);
                        else
                            gather_vec<8><<<ctas, threads, 0, c.main>>>((uint32_t*)h, (uint32_t*)c.dev, d_src, N,
                                                                        words, scatter, hstride);
                    };
                    bool ok = verify(c, src_row, issue, scatter);
                    double ms = time_ms(c, issue);
                    char extra[96];
                    snprintf(extra, sizeof extra, "\"ctas\": %d, \"threads\": %d, \"in_flight\": 8, \"stride\": %d, ",
                             ctas, threads, stride);
                    report(scatter ? "vec_scatter" : "vec", row_bytes, run, extra, ms,
                           scatter ? ceiling_d2h : ceiling, ok);
                }
            }
        }
        for (int ctas : {8, 16}) {
            if (!strstr(modes, "bulk") || row_bytes % 16) break;
            for (int threads : {32, 64, 128}) {
                for (int nbuf : {2, 4}) {
                    size_t sm = ((threads * nbuf * 8 + 127) / 128) * 128 + (size_t)threads * nbuf * row_bytes;
                    if (sm > 220 * 1024) continue;
                    CK(cudaFuncSetAttribute(gather_bulk, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)sm));
                    auto issue = [&] {
                        gather_bulk<<<ctas, threads, sm, c.main>>>(c.host, c.dev, d_src, N, row_bytes, nbuf);
                    };
                    bool ok = verify(c, src_row, issue);
                    double ms = time_ms(c, issue);
                    char extra[128];
                    snprintf(extra, sizeof extra, "\"ctas\": %d, \"threads\": %d, \"nbuf\": %d, ", ctas, threads,
                             nbuf);
                    report("bulk", row_bytes, run, extra, ms, ceiling, ok);
                }
            }
        }
        c.side = side_all;
    }
    return 0;
}
