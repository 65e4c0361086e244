// Probe: host cost of submitting one reload of L layers, per mechanism, outside Python.
//
// A reload submits per layer one copy (pinned host -> device) and one event record, so the
// model can wait for layer i alone. On the H200 host those two runtime calls cost ~5 and ~3 us
// from Python. Here, in C, per layer (medians of 20 reloads of L = 61 layers, copies of B bytes
// from distinct offsets of one pinned buffer; the stream drained between reloads):
//   direct     cudaMemcpyAsync + cudaEventRecord
//   graph      a graph of L memcpy nodes and L event-record nodes, instantiated once; per reload
//              cudaGraphExecMemcpyNodeSetParams1D for every copy, then one cudaGraphLaunch
//   graph_fix  the same graph launched with no update (the floor of a launch)
//   loop/batch each layer in k runs (k = 1..16): k cudaMemcpyAsync calls, or one
//              cudaMemcpyBatchAsync of k copies, then the event record
// Each variant's destination is poisoned and checked after one reload. Prints one JSON line each.
//
// Build and run on the device: nvcc -O3 -o probe_graph probe_graph.cu && ./probe_graph [L] [B]
#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "check.h"

static double now_us() {
    return std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

static double median(std::vector<double> v) {
    std::sort(v.begin(), v.end());
    return v[v.size() / 2];
}

int main(int argc, char** argv) {
    int L = argc > 1 ? atoi(argv[1]) : 61;
    size_t B = argc > 2 ? (size_t)atoll(argv[2]) : (size_t)4 << 20;
    char *host, *dev;
    CK(cudaHostAlloc(&host, L * B, cudaHostAllocDefault));
    CK(cudaMalloc(&dev, L * B));
    for (size_t i = 0; i < L * B; ++i) host[i] = (char)(i * 131 + 7);
    cudaStream_t s;
    CK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    std::vector<cudaEvent_t> ev(L);
    for (auto& e : ev) CK(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
    std::vector<char> check(L * B);
    auto verify = [&]() {
        CK(cudaStreamSynchronize(s));
        CK(cudaMemcpy(check.data(), dev, L * B, cudaMemcpyDeviceToHost));
        return memcmp(check.data(), host, L * B) == 0;
    };
    const int reps = 20;

    // Host microseconds per layer to submit one reload (`submit()`), median of `reps`; the
    // destination is poisoned before each and checked after the first (into `ok`).
    bool ok = true;
    auto per_layer = [&](auto submit) {
        std::vector<double> t;
        for (int r = 0; r < reps + 2; ++r) {
            CK(cudaMemsetAsync(dev, 0xAB, L * B, s));
            CK(cudaStreamSynchronize(s));
            double t0 = now_us();
            submit();
            double t1 = now_us();
            if (r == 0) ok = verify();
            CK(cudaStreamSynchronize(s));
            if (r >= 2) t.push_back((t1 - t0) / L);
        }
        return median(t);
    };

    double us = per_layer([&] {
        for (int l = 0; l < L; ++l) {
            CK(cudaMemcpyAsync(dev + l * B, host + l * B, B, cudaMemcpyHostToDevice, s));
            CK(cudaEventRecord(ev[l], s));
        }
    });
    printf("{\"variant\": \"direct\", \"layers\": %d, \"bytes\": %zu, \"us_per_layer\": %.3f, \"identical\": %s}\n", L,
           B, us, ok ? "true" : "false");

    // a layer in k runs: k cudaMemcpyAsync calls, or one cudaMemcpyBatchAsync of k copies (+ the event)
    for (int k : {1, 2, 4, 8, 16}) {
        for (int batch = 0; batch < 2; ++batch) {
            size_t part = B / k;
            std::vector<void*> dsts(k), srcs(k);
            std::vector<size_t> sizes(k, part);
            cudaMemcpyAttributes a = {};
            a.srcAccessOrder = cudaMemcpySrcAccessOrderStream;
            a.flags = cudaMemcpyFlagPreferOverlapWithCompute;
            size_t idx = 0;
            us = per_layer([&] {
                for (int l = 0; l < L; ++l) {
                    for (int j = 0; j < k; ++j) {
                        dsts[j] = dev + l * B + j * part;
                        srcs[j] = host + l * B + j * part;
                    }
                    if (batch)
                        CK(cudaMemcpyBatchAsync(dsts.data(), srcs.data(), sizes.data(), k, &a, &idx, 1, s));
                    else
                        for (int j = 0; j < k; ++j)
                            CK(cudaMemcpyAsync(dsts[j], srcs[j], part, cudaMemcpyHostToDevice, s));
                    CK(cudaEventRecord(ev[l], s));
                }
            });
            printf("{\"variant\": \"%s\", \"runs_per_layer\": %d, \"layers\": %d, \"us_per_layer\": %.3f, "
                   "\"identical\": %s}\n",
                   batch ? "batch" : "loop", k, L, us, ok ? "true" : "false");
        }
    }

    // graph: L memcpy nodes chained with L event-record nodes
    cudaGraph_t g;
    CK(cudaGraphCreate(&g, 0));
    std::vector<cudaGraphNode_t> cp(L), rec(L);
    cudaGraphNode_t prev = nullptr;
    for (int l = 0; l < L; ++l) {
        CK(cudaGraphAddMemcpyNode1D(&cp[l], g, prev ? &prev : nullptr, prev ? 1 : 0, dev + l * B, host + l * B, B,
                                    cudaMemcpyHostToDevice));
        CK(cudaGraphAddEventRecordNode(&rec[l], g, &cp[l], 1, ev[l]));
        prev = rec[l];
    }
    cudaGraphExec_t ge;
    double i0 = now_us();
    CK(cudaGraphInstantiate(&ge, g, 0));
    double instantiate = now_us() - i0;
    for (int fixed = 0; fixed < 2; ++fixed) {
        us = per_layer([&] {
            if (!fixed)
                for (int l = 0; l < L; ++l)
                    CK(cudaGraphExecMemcpyNodeSetParams1D(ge, cp[l], dev + l * B, host + l * B, B,
                                                          cudaMemcpyHostToDevice));
            CK(cudaGraphLaunch(ge, s));
        });
        printf("{\"variant\": \"%s\", \"layers\": %d, \"bytes\": %zu, \"us_per_layer\": %.3f, \"instantiate_us\": %.1f, "
               "\"identical\": %s}\n",
               fixed ? "graph_fix" : "graph", L, B, us, instantiate, ok ? "true" : "false");
    }
    return 0;
}
