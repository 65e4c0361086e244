// What the CUDA C probes share: the error check (print where and why, then exit), the median
// timing of a stream's work and the parsing of comma lists of ints.
#pragma once
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include <cuda_runtime.h>

#define CK(x)                                                                                  \
    do {                                                                                       \
        cudaError_t e_ = (x);                                                                  \
        if (e_ != cudaSuccess) {                                                               \
            fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(e_)); \
            exit(1);                                                                           \
        }                                                                                      \
    } while (0)

// The median of `repeats` timings of `issue()` on stream `s` (CUDA events `e0`, `e1`; two untimed
// runs first), in ms.
template <class F>
inline double median_ms(cudaStream_t s, cudaEvent_t e0, cudaEvent_t e1, F issue, int repeats) {
    std::vector<float> ms;
    for (int r = 0; r < repeats + 2; ++r) {
        CK(cudaEventRecord(e0, s));
        issue();
        CK(cudaEventRecord(e1, s));
        CK(cudaEventSynchronize(e1));
        float t;
        CK(cudaEventElapsedTime(&t, e0, e1));
        if (r >= 2) ms.push_back(t);
    }
    std::sort(ms.begin(), ms.end());
    return ms[ms.size() / 2];
}

// "1,16,256" -> {1, 16, 256}.
inline std::vector<int> parse_ints(const char* s) {
    std::vector<int> out;
    while (*s) {
        out.push_back(atoi(s));
        while (*s && *s != ',') ++s;
        if (*s) ++s;
    }
    return out;
}
