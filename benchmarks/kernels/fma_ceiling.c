/* How fast can any fp32 GEMM run on this CPU? Two measurements, printed as JSON (benchmarks/gemm_ceiling.py).
 *
 *   fma    : the FMA units' peak: 12 independent chains (distinct values, so no compiler can merge them) of 8-lane
 *            fused multiply-adds, no memory operands.
 *   kernel : the inner loop every BLAS GEMM is built from (BLIS/OpenBLAS "Haswell" 6x16 microkernel): a 6x16 block
 *            of C kept in 12 registers; per k, two 8-float loads of a packed B panel, six broadcasts of a packed A
 *            panel, 12 FMAs. Panels are small enough to stay in L1/L2, so this is the GEMM rate with no memory
 *            traffic, packing or edge handling: a library GEMM cannot beat it by much.
 *
 * usage: fma_ceiling {fma|kernel} <threads> <millions of FMA instructions per thread>
 * Inputs are small dyadic numbers, so the kernel's C (printed as "checksum": the sum of thread 0's C after one
 * repetition of every panel) is exact in fp32 and a test compares it with numpy.
 */
#include <immintrin.h>
#include <omp.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

enum { KC = 256, MR = 6, NR = 16, PANELS = 16 }; /* B: 16 panels x 256 x 16 floats = 256 KiB per thread (L2) */

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

/* C[6][16] (row stride ldc) += A(6 x KC, packed k-major) * B(KC x 16, packed k-major) */
static void kernel_6x16(const float *restrict a, const float *restrict b, float *restrict c, int ldc) {
#define LOAD(i) __m256 c##i##0 = _mm256_loadu_ps(c + i * ldc), c##i##1 = _mm256_loadu_ps(c + i * ldc + 8);
    LOAD(0) LOAD(1) LOAD(2) LOAD(3) LOAD(4) LOAD(5)
    for (int k = 0; k < KC; k++) {
        __m256 b0 = _mm256_load_ps(b + NR * k), b1 = _mm256_load_ps(b + NR * k + 8), x;
#define FMA(i) x = _mm256_broadcast_ss(a + MR * k + i); \
               c##i##0 = _mm256_fmadd_ps(x, b0, c##i##0); c##i##1 = _mm256_fmadd_ps(x, b1, c##i##1);
        FMA(0) FMA(1) FMA(2) FMA(3) FMA(4) FMA(5)
    }
#define STORE(i) _mm256_storeu_ps(c + i * ldc, c##i##0); _mm256_storeu_ps(c + i * ldc + 8, c##i##1);
    STORE(0) STORE(1) STORE(2) STORE(3) STORE(4) STORE(5)
}

static float run_kernel(long reps) {
    float *a = aligned_alloc(64, sizeof(float) * MR * KC);
    float *b = aligned_alloc(64, sizeof(float) * KC * NR * PANELS);
    float *c = aligned_alloc(64, sizeof(float) * MR * NR * PANELS);
    if (!a || !b || !c) {
        fprintf(stderr, "out of memory\n");
        exit(1);
    }
    for (int i = 0; i < MR * KC; i++) a[i] = (float)(i % 7 - 2) * 0.25f;
    for (int i = 0; i < KC * NR * PANELS; i++) b[i] = (float)(i % 5 - 1) * 0.5f;
    for (int i = 0; i < MR * NR * PANELS; i++) c[i] = 0.0f;
    float checksum = 0.0f;
    for (long r = 0; r < reps; r++) {
        for (int p = 0; p < PANELS; p++) kernel_6x16(a, b + KC * NR * p, c + NR * p, NR * PANELS);
        if (r == 0)
            for (int i = 0; i < MR * NR * PANELS; i++) checksum += c[i];
    }
    float keep = c[0];
    free(a); free(b); free(c);
    return checksum + 0.0f * keep;
}

static float run_fma(long n12) {
    /* distinct start values: identical chains would be merged by the compiler into one (then 1 FMA per 12 counted) */
    __m256 x = _mm256_set1_ps(1.0001f), y = _mm256_set1_ps(0.9999f);
#define START(i) __m256 c##i = _mm256_set1_ps(1.0f + 0.01f * i);
    START(0) START(1) START(2) START(3) START(4) START(5) START(6) START(7) START(8) START(9) START(10) START(11)
    for (long i = 0; i < n12; i++) {
        c0 = _mm256_fmadd_ps(c0, y, x); c1 = _mm256_fmadd_ps(c1, y, x); c2 = _mm256_fmadd_ps(c2, y, x);
        c3 = _mm256_fmadd_ps(c3, y, x); c4 = _mm256_fmadd_ps(c4, y, x); c5 = _mm256_fmadd_ps(c5, y, x);
        c6 = _mm256_fmadd_ps(c6, y, x); c7 = _mm256_fmadd_ps(c7, y, x); c8 = _mm256_fmadd_ps(c8, y, x);
        c9 = _mm256_fmadd_ps(c9, y, x); c10 = _mm256_fmadd_ps(c10, y, x); c11 = _mm256_fmadd_ps(c11, y, x);
    }
    __m256 s = _mm256_add_ps(_mm256_add_ps(_mm256_add_ps(c0, c1), _mm256_add_ps(c2, c3)),
                             _mm256_add_ps(_mm256_add_ps(c4, c5), _mm256_add_ps(c6, c7)));
    s = _mm256_add_ps(s, _mm256_add_ps(_mm256_add_ps(c8, c9), _mm256_add_ps(c10, c11)));
    float o[8];
    _mm256_storeu_ps(o, s);
    return o[0];
}

int main(int argc, char **argv) {
    if (argc != 4) {
        fprintf(stderr, "usage: %s {fma|kernel} <threads> <millions of FMA instructions per thread>\n", argv[0]);
        return 2;
    }
    const int kernel = argv[1][0] == 'k', threads = atoi(argv[2]);
    const double mfma = atof(argv[3]);
    const long fma_per_rep = kernel ? (long)KC * 12 * PANELS : 12; /* FMA instructions per repetition */
    const long reps = (long)(mfma * 1e6 / fma_per_rep) + 1;
    float checksum = 0.0f;
    int ran = 0; /* threads that actually ran (OMP_DYNAMIC or OMP_THREAD_LIMIT may give fewer than asked) */
    omp_set_num_threads(threads);
    double t0 = 0, t1 = 0;
#pragma omp parallel
    {
        float r = 0.0f;
#pragma omp barrier
#pragma omp master
        {
            ran = omp_get_num_threads();
            t0 = now();
        }
        r = kernel ? run_kernel(reps) : run_fma(reps);
#pragma omp barrier
#pragma omp master
        {
            t1 = now();
            checksum = r;
        }
    }
    double flops = 16.0 * fma_per_rep * reps * ran; /* 8 lanes x 2 flops per FMA instruction */
    printf("{\"mode\": \"%s\", \"threads\": %d, \"gflops\": %.2f, \"seconds\": %.4f, \"reps\": %ld, "
           "\"checksum\": %.4f}\n", kernel ? "kernel" : "fma", ran, flops / (t1 - t0) / 1e9, t1 - t0, reps,
           checksum);
    return 0;
}
