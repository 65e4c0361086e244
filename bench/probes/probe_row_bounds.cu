// Probe: the most the SMs move of one layer's rows of each spec, outside Python, on one lease.
//
// The goals of `kvtier bench transfer`'s per-spec table (0.92 of the same-run ceiling, 0.88 for
// packed fp8) are set per cell; where a cell falls short, this gives the bound to hold it
// against: the best of a grid sweep of one plain gather (load) or scatter (backup) kernel over
// the same rows, 131072 tokens drawn from a pool of 2 x 131072 in host runs of R (the bench's
// shape), device rows contiguous. A token may have two buffers (`glm-5`: the 1152-byte MLA
// latent row and the 132-byte DSA indexer row); both move in the same kernel, the token's
// words of both in one flattened index, so the two rows' requests are in flight together.
// A-rows are moved in 16-byte words, B-rows in 4-byte words. Each variant's destination is
// poisoned first and every row compared with its source.
//
// Cases: a1152 (deepseek-v3), a656 (packed fp8), a2048 (llama-3.1-8b, one of K and V),
// b132 (the indexer alone), a1152b132 (glm-5).
// One JSON object per line, against one contiguous cudaMemcpyAsync of the token bytes.
//
// Build and run on the device:
//   nvcc -O3 -gencode=arch=compute_90,code=sm_90 -o probe_bounds probe_row_bounds.cu && ./probe_bounds 1,16 [CASE]
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

struct Case {
    const char* name;
    int a_bytes, b_bytes;
};

// gather: da[i] = ha[src[i]], db[i] = hb[src[i]]; scatter: ha[src[i]] = da[i], hb[src[i]] = db[i].
// `wa` 16-byte words of A and `wb` 4-byte words of B a token; U words in flight per thread.
template <int U>
__global__ void __launch_bounds__(1024) move(uint4* ha, uint4* da, uint32_t* hb, uint32_t* db,
                                             const int* __restrict__ src, int rows, int wa, int wb, bool scatter) {
    int w = wa + wb;
    long total = (long)rows * w;
    long stride = (long)gridDim.x * blockDim.x;
    for (long base = (long)blockIdx.x * blockDim.x + threadIdx.x; base < total; base += stride * U) {
        uint4 v[U];
        long to[U];
        bool in_a[U];
#pragma unroll
        for (int u = 0; u < U; ++u) {
            long c = base + u * stride;
            to[u] = -1;
            in_a[u] = false;
            if (c < total) {
                long r = c / w, j = c % w, h = src[r];
                if (j < wa) {
                    in_a[u] = true;
                    long hi = h * wa + j, di = r * wa + j;
                    v[u] = scatter ? da[di] : ha[hi];
                    to[u] = scatter ? hi : di;
                } else {
                    long hi = h * wb + (j - wa), di = r * wb + (j - wa);
                    v[u].x = scatter ? db[di] : hb[hi];
                    to[u] = scatter ? hi : di;
                }
            }
        }
#pragma unroll
        for (int u = 0; u < U; ++u) {
            if (to[u] < 0) continue;
            if (in_a[u])
                (scatter ? ha : da)[to[u]] = v[u];
            else
                (scatter ? hb : db)[to[u]] = v[u].x;
        }
    }
}

int main(int argc, char** argv) {
    std::vector<int> runs_list = parse_ints(argc > 1 ? argv[1] : "1,16");
    const Case cases[] = {{"a1152", 1152, 0}, {"a656", 656, 0}, {"a2048", 2048, 0}, {"b132", 0, 132},
                          {"a1152b132", 1152, 132}};
    const int max_a = 2048, max_b = 132;
    char *ha, *hb, *da, *db;  // host pools of 2N rows a buffer, device rows of N
    CK(cudaHostAlloc(&ha, (size_t)2 * N * max_a, cudaHostAllocDefault));
    CK(cudaHostAlloc(&hb, (size_t)2 * N * max_b, cudaHostAllocDefault));
    CK(cudaMalloc(&da, (size_t)N * max_a));
    CK(cudaMalloc(&db, (size_t)N * max_b));
    std::vector<char> ref_a((size_t)2 * N * max_a), ref_b((size_t)2 * N * max_b);
    std::vector<char> got_a((size_t)N * max_a), got_b((size_t)N * max_b);
    std::mt19937_64 rng(7);
    for (auto* v : {&ref_a, &ref_b})
        for (size_t i = 0; i < v->size() / 8; ++i) ((uint64_t*)v->data())[i] = rng();
    cudaStream_t s;
    cudaEvent_t e0, e1;
    CK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    CK(cudaEventCreate(&e0));
    CK(cudaEventCreate(&e1));
    int* d_src;
    CK(cudaMalloc(&d_src, N * sizeof(int)));
    printf("{\"cudart\": %d}\n", CUDART_VERSION);
    const char* only = argc > 2 ? argv[2] : nullptr;  // a case name: that case alone
    for (const Case& k : cases) {
        if (only && strcmp(only, k.name)) continue;
        size_t token = k.a_bytes + k.b_bytes, bytes = (size_t)N * token;
        // The same-run ceiling: one contiguous copy of the layer's bytes, each direction.
        auto load = [&] { CK(cudaMemcpyAsync(da, ha, bytes, cudaMemcpyHostToDevice, s)); };
        auto backup = [&] { CK(cudaMemcpyAsync(ha, da, bytes, cudaMemcpyDeviceToHost, s)); };
        double ceil_load = median_ms(s, e0, e1, load, 9), ceil_backup = median_ms(s, e0, e1, backup, 9);
        printf("{\"case\": \"%s\", \"ceiling_load_gbps\": %.2f, \"ceiling_backup_gbps\": %.2f}\n", k.name,
               bytes / 1e6 / ceil_load, bytes / 1e6 / ceil_backup);
        int wa = k.a_bytes / 16, wb = k.b_bytes / 4;
        for (int run : runs_list) {
            int slots = 2 * N / run;
            std::vector<int> perm(slots);
            std::iota(perm.begin(), perm.end(), 0);
            std::shuffle(perm.begin(), perm.end(), rng);
            std::vector<int> src(N);
            for (int i = 0; i < N; ++i) src[i] = perm[i / run] * run + i % run;
            CK(cudaMemcpy(d_src, src.data(), N * sizeof(int), cudaMemcpyHostToDevice));
            for (int scatter = 0; scatter < 2; ++scatter) {
                for (int ctas : {4, 8, 16}) {
                    for (int threads : {256, 512, 1024}) {
                        auto issue = [&] {
                            move<8><<<ctas, threads, 0, s>>>((uint4*)ha, (uint4*)da, (uint32_t*)hb, (uint32_t*)db,
                                                             d_src, N, wa, wb, scatter);
                        };
                        // Sources hold the reference bytes, destinations the complement.
                        size_t pa = (size_t)2 * N * k.a_bytes, pb = (size_t)2 * N * k.b_bytes;
                        if (scatter) {
                            for (int i = 0; i < N; ++i) {
                                memcpy(got_a.data() + (size_t)i * k.a_bytes, ref_a.data() + (size_t)i * k.a_bytes,
                                       k.a_bytes);
                                memcpy(got_b.data() + (size_t)i * k.b_bytes, ref_b.data() + (size_t)i * k.b_bytes,
                                       k.b_bytes);
                            }
                            CK(cudaMemcpy(da, got_a.data(), (size_t)N * k.a_bytes, cudaMemcpyHostToDevice));
                            CK(cudaMemcpy(db, got_b.data(), (size_t)N * k.b_bytes, cudaMemcpyHostToDevice));
                            for (size_t i = 0; i < pa; ++i) ha[i] = ~ref_a[i];
                            for (size_t i = 0; i < pb; ++i) hb[i] = ~ref_b[i];
                        } else {
                            memcpy(ha, ref_a.data(), pa);
                            memcpy(hb, ref_b.data(), pb);
                            CK(cudaMemset(da, 0xAB, (size_t)N * k.a_bytes));
                            CK(cudaMemset(db, 0xAB, (size_t)N * k.b_bytes));
                        }
                        issue();
                        CK(cudaStreamSynchronize(s));
                        CK(cudaGetLastError());
                        bool ok = true;
                        if (scatter) {
                            for (int i = 0; i < N && ok; ++i)
                                ok = !memcmp(ha + (size_t)src[i] * k.a_bytes, ref_a.data() + (size_t)i * k.a_bytes,
                                             k.a_bytes) &&
                                     !memcmp(hb + (size_t)src[i] * k.b_bytes, ref_b.data() + (size_t)i * k.b_bytes,
                                             k.b_bytes);
                        } else {
                            CK(cudaMemcpy(got_a.data(), da, (size_t)N * k.a_bytes, cudaMemcpyDeviceToHost));
                            CK(cudaMemcpy(got_b.data(), db, (size_t)N * k.b_bytes, cudaMemcpyDeviceToHost));
                            for (int i = 0; i < N && ok; ++i)
                                ok = !memcmp(got_a.data() + (size_t)i * k.a_bytes,
                                             ref_a.data() + (size_t)src[i] * k.a_bytes, k.a_bytes) &&
                                     !memcmp(got_b.data() + (size_t)i * k.b_bytes,
                                             ref_b.data() + (size_t)src[i] * k.b_bytes, k.b_bytes);
                        }
                        double ms = median_ms(s, e0, e1, issue, 9);
                        double ceiling = scatter ? ceil_backup : ceil_load;
                        printf(
                            "{\"case\": \"%s\", \"direction\": \"%s\", \"host_run\": %d, \"ctas\": %d, "
                            "\"threads\": %d, \"ms\": %.4f, \"gbps\": %.2f, \"of_ceiling\": %.3f, \"identical\": %s}\n",
                            k.name, scatter ? "backup" : "load", run, ctas, threads, ms, bytes / 1e6 / ms,
                            ceiling / ms, ok ? "true" : "false");
                        fflush(stdout);
                    }
                }
            }
        }
    }
    return 0;
}
