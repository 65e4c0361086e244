// Probe: does an L2 fill-size hint make the SMs' reads of pinned host memory go out larger?
//
// The kernel's loads of host rows sit at ~0.92 of the link for whole 128-byte lines and pay
// per 128-byte read request for short rows (FINDINGS: "what a small row costs"); the copy
// engine reaches 1.00. If the L2 fetched host memory in 256-byte pieces when a load asks for
// it (PTX `ld.global.L2::256B`), a row would take half the read requests. Variants of one
// gather kernel (16-byte words, or 4-byte words for rows that are not a multiple of 16; U
// loads in flight per thread), differing only in the load instruction:
//   plain   ld.global            (what the compiler emits for a plain dereference)
//   l2_128  ld.global.L2::128B
//   l2_256  ld.global.L2::256B
//   nc_256  ld.global.nc.L2::256B
//   na_256  ld.global.L1::no_allocate.L2::256B
//   cv      ld.global.cv         (no caching: every load goes to the host)
// Host rows: a pool of 2N rows; N of them in runs of R, run positions drawn at random (the
// shape of `kvtier bench transfer`'s sets). Each variant's destination is poisoned first and
// every row compared with its source. One JSON object per line, against one contiguous
// cudaMemcpyAsync of the same bytes in the same run.
//
// Build and run on the device:
//   nvcc -O3 -gencode=arch=compute_90,code=sm_90 -o probe_l2 probe_l2_hint.cu && ./probe_l2 1152,132 1,16
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
static const char* FLAVORS[] = {"plain", "l2_128", "l2_256", "nc_256", "na_256", "cv"};
static const int NFLAVORS = 6;

template <int F>
__device__ __forceinline__ uint4 load16(const uint4* p) {
    uint4 v;
    if constexpr (F == 0) {
        v = *p;
    } else if constexpr (F == 1) {
        asm volatile("ld.global.L2::128B.v4.u32 {%0,%1,%2,%3}, [%4];"
                     : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
    } else if constexpr (F == 2) {
        asm volatile("ld.global.L2::256B.v4.u32 {%0,%1,%2,%3}, [%4];"
                     : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
    } else if constexpr (F == 3) {
        asm volatile("ld.global.nc.L2::256B.v4.u32 {%0,%1,%2,%3}, [%4];"
                     : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
    } else if constexpr (F == 4) {
        asm volatile("ld.global.L1::no_allocate.L2::256B.v4.u32 {%0,%1,%2,%3}, [%4];"
                     : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
    } else {
        asm volatile("ld.global.cv.v4.u32 {%0,%1,%2,%3}, [%4];"
                     : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
    }
    return v;
}

template <int F>
__device__ __forceinline__ uint32_t load4(const uint32_t* p) {
    uint32_t v;
    if constexpr (F == 0) {
        v = *p;
    } else if constexpr (F == 1) {
        asm volatile("ld.global.L2::128B.u32 %0, [%1];" : "=r"(v) : "l"(p));
    } else if constexpr (F == 2) {
        asm volatile("ld.global.L2::256B.u32 %0, [%1];" : "=r"(v) : "l"(p));
    } else if constexpr (F == 3) {
        asm volatile("ld.global.nc.L2::256B.u32 %0, [%1];" : "=r"(v) : "l"(p));
    } else if constexpr (F == 4) {
        asm volatile("ld.global.L1::no_allocate.L2::256B.u32 %0, [%1];" : "=r"(v) : "l"(p));
    } else {
        asm volatile("ld.global.cv.u32 %0, [%1];" : "=r"(v) : "l"(p));
    }
    return v;
}

template <int F>
__device__ __forceinline__ uint4 load(const uint4* p) { return load16<F>(p); }
template <int F>
__device__ __forceinline__ uint32_t load(const uint32_t* p) { return load4<F>(p); }

// dev[i] = host[src_row[i]], `words` words a row; U loads in flight per thread.
template <int F, int U, class T>
__global__ void __launch_bounds__(1024)
    gather(const T* __restrict__ host, T* __restrict__ dev, const int* __restrict__ src_row, int rows, int words) {
    long total = (long)rows * words;
    long stride = (long)gridDim.x * blockDim.x;
    for (long base = (long)blockIdx.x * blockDim.x + threadIdx.x; base < total; base += stride * U) {
        T v[U];
        long to[U];
#pragma unroll
        for (int u = 0; u < U; ++u) {
            long c = base + u * stride;
            to[u] = -1;
            if (c < total) {
                int r = (int)(c / words), w = (int)(c % words);
                v[u] = load<F>(host + (long)src_row[r] * words + w);
                to[u] = c;
            }
        }
#pragma unroll
        for (int u = 0; u < U; ++u)
            if (to[u] >= 0) dev[to[u]] = v[u];
    }
}

template <class T>
static void launch(int flavor, int ctas, int threads, const T* host, T* dev, const int* src, int words,
                   cudaStream_t s) {
    switch (flavor) {
        case 0: gather<0, 8><<<ctas, threads, 0, s>>>(host, dev, src, N, words); break;
        case 1: gather<1, 8><<<ctas, threads, 0, s>>>(host, dev, src, N, words); break;
        case 2: gather<2, 8><<<ctas, threads, 0, s>>>(host, dev, src, N, words); break;
        case 3: gather<3, 8><<<ctas, threads, 0, s>>>(host, dev, src, N, words); break;
        case 4: gather<4, 8><<<ctas, threads, 0, s>>>(host, dev, src, N, words); break;
        default: gather<5, 8><<<ctas, threads, 0, s>>>(host, dev, src, N, words); break;
    }
}

int main(int argc, char** argv) {
    std::vector<int> rows_list = parse_ints(argc > 1 ? argv[1] : "1152,656,132");
    std::vector<int> runs_list = parse_ints(argc > 2 ? argv[2] : "1,16,1024");
    int max_row = *std::max_element(rows_list.begin(), rows_list.end());
    size_t host_bytes = (size_t)2 * N * max_row, dev_bytes = (size_t)N * max_row;
    char *host, *dev;
    CK(cudaHostAlloc(&host, host_bytes, cudaHostAllocDefault));
    CK(cudaMalloc(&dev, dev_bytes));
    std::vector<char> check(dev_bytes);
    std::mt19937_64 rng(7);
    for (size_t i = 0; i < host_bytes / 8; ++i) ((uint64_t*)host)[i] = rng();
    cudaStream_t s;
    cudaEvent_t e0, e1;
    CK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    CK(cudaEventCreate(&e0));
    CK(cudaEventCreate(&e1));
    int* d_src;
    CK(cudaMalloc(&d_src, N * sizeof(int)));
    printf("{\"cudart\": %d}\n", CUDART_VERSION);
    for (int row_bytes : rows_list) {
        size_t bytes = (size_t)N * row_bytes;
        auto copy = [&] { CK(cudaMemcpyAsync(dev, host, bytes, cudaMemcpyHostToDevice, s)); };
        double ceiling = median_ms(s, e0, e1, copy, 7);
        printf("{\"variant\": \"ceiling\", \"row_bytes\": %d, \"ms\": %.4f, \"gbps\": %.2f}\n", row_bytes, ceiling,
               bytes / 1e6 / ceiling);
        bool wide = row_bytes % 16 == 0;
        int words = wide ? row_bytes / 16 : row_bytes / 4;
        for (int run : runs_list) {
            int slots = 2 * N / run;  // run positions in the pool of 2N rows
            std::vector<int> perm(slots);
            std::iota(perm.begin(), perm.end(), 0);
            std::shuffle(perm.begin(), perm.end(), rng);
            std::vector<int> src_row(N);
            for (int i = 0; i < N; ++i) src_row[i] = perm[i / run] * run + i % run;
            CK(cudaMemcpy(d_src, src_row.data(), N * sizeof(int), cudaMemcpyHostToDevice));
            for (int flavor = 0; flavor < NFLAVORS; ++flavor) {
                for (int ctas : {4, 8, 16}) {
                    for (int threads : {512, 1024}) {
                        auto issue = [&] {
                            if (wide)
                                launch(flavor, ctas, threads, (const uint4*)host, (uint4*)dev, d_src, words, s);
                            else
                                launch(flavor, ctas, threads, (const uint32_t*)host, (uint32_t*)dev, d_src, words,
                                       s);
                        };
                        CK(cudaMemset(dev, 0xAB, bytes));
                        issue();
                        CK(cudaStreamSynchronize(s));
                        CK(cudaGetLastError());
                        CK(cudaMemcpy(check.data(), dev, bytes, cudaMemcpyDeviceToHost));
                        bool ok = true;
                        for (int i = 0; i < N && ok; ++i)
                            ok = !memcmp(check.data() + (size_t)i * row_bytes, host + (size_t)src_row[i] * row_bytes,
                                         row_bytes);
                        double ms = median_ms(s, e0, e1, issue, 7);
                        printf(
                            "{\"variant\": \"%s\", \"row_bytes\": %d, \"host_run\": %d, \"ctas\": %d, \"threads\": %d, "
                            "\"ms\": %.4f, \"gbps\": %.2f, \"of_ceiling\": %.3f, \"identical\": %s}\n",
                            FLAVORS[flavor], row_bytes, run, ctas, threads, ms, bytes / 1e6 / ms, ceiling / ms,
                            ok ? "true" : "false");
                        fflush(stdout);
                    }
                }
            }
        }
    }
    return 0;
}
