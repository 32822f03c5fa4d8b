// The AVX2 (and F16C) primitives of the CPU steps' SIMD forms (sparse_adamw_simd.h,
// sparse_adamw_lean_simd.h): W = 8 float lanes, masks as 32-bit integer lanes. The memory
// primitives also take Full (all W lanes) for the plain instruction: VMASKMOV is slow on AMD
// cores. Included inside each step's AVX2 namespace, between its `#pragma GCC target("avx2,f16c")`
// and fp-contract off lines, so every function compiles under that target and inlines into the
// body that follows. The AVX-512 form (sparse_adamw.cpp) defines the same names with its own
// intrinsics.
using V = __m256;
using Mask = __m256i;
using VI = __m256i;
constexpr int64_t W = 8;
inline Mask lanes(int64_t n) {
  return _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(n)), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}
inline V set1(float x) { return _mm256_set1_ps(x); }
inline V loadu(const float* p, Mask k) { return _mm256_maskload_ps(p, k); }
inline V loadu(const float* p, Full) { return _mm256_loadu_ps(p); }
inline void storeu(float* p, V x, Mask k) { _mm256_maskstore_ps(p, k, x); }
inline void storeu(float* p, V x, Full) { _mm256_storeu_ps(p, x); }
inline V vsqrt(V x) { return _mm256_sqrt_ps(x); }
inline __m256i load_idx(const int32_t* p, Mask k) { return _mm256_maskload_epi32(p, k); }
inline __m256i load_idx(const int32_t* p, Full) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }
inline V gather(const float* base, __m256i q, Mask k) {
  return _mm256_mask_i32gather_ps(_mm256_setzero_ps(), base, q, _mm256_castsi256_ps(k), 4);
}
// Whole vectors load one lane at a time: on the AMD EPYC (Zen 5) a VPGATHERDD whose lines miss
// held the step back, and eight loads were measured faster (bench/results/README.md).
inline V gather(const float* base, __m256i q, Full) {
  alignas(32) int32_t i[W];
  _mm256_store_si256(reinterpret_cast<__m256i*>(i), q);
  return _mm256_setr_ps(base[i[0]], base[i[1]], base[i[2]], base[i[3]], base[i[4]], base[i[5]], base[i[6]], base[i[7]]);
}
// AVX2 has no scatter: the new weights go out one store each.
template <typename M>
inline void scatter(float* base, const int32_t* idx, __m256i, V x, M, int64_t n) {
  alignas(32) float out[W];
  _mm256_store_ps(out, x);
  for (int64_t t = 0; t < n; ++t) base[idx[t]] = out[t];
}
inline VI load16(const uint16_t* p, int64_t n) {
  if (n == W) return _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  const Tail16<W> tail(p, n);
  return _mm256_cvtepu16_epi32(_mm_load_si128(reinterpret_cast<const __m128i*>(tail.v)));
}
inline VI gather16(const uint16_t* base, __m256i q, Mask k) {
  const VI words = _mm256_mask_i32gather_epi32(_mm256_setzero_si256(), reinterpret_cast<const int*>(base), q, k, 2);
  return _mm256_and_si256(words, _mm256_set1_epi32(0xFFFF));
}
inline VI gather16(const uint16_t* base, __m256i q, Full) {
  alignas(32) int32_t i[W];
  _mm256_store_si256(reinterpret_cast<__m256i*>(i), q);
  return _mm256_setr_epi32(base[i[0]], base[i[1]], base[i[2]], base[i[3]], base[i[4]], base[i[5]], base[i[6]],
                           base[i[7]]);
}
// The low 16 bits of each 32-bit lane, packed in order.
inline __m128i low16(VI x) {
  return _mm256_castsi256_si128(_mm256_permute4x64_epi64(_mm256_packus_epi32(x, x), 0x08));
}
inline void pack16(uint16_t* out, VI x) { _mm_storeu_si128(reinterpret_cast<__m128i*>(out), low16(x)); }
inline V widen_f16(VI x) { return _mm256_cvtph_ps(low16(x)); }
inline void narrow_f16(uint16_t* out, V x) {
  _mm_storeu_si128(reinterpret_cast<__m128i*>(out), _mm256_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT));
}
inline unsigned nan_lanes(V x) { return static_cast<unsigned>(_mm256_movemask_ps(_mm256_cmp_ps(x, x, _CMP_UNORD_Q))); }
// n (<= W) int8 values to fp32 lanes (lanes past n zero), and W int32 lanes in [-128, 127] to
// int8, the first n stored: spelled out, as GCC 12 converts int8 vectors one lane at a time.
inline V widen_i8(const int8_t* p, int64_t n) {
  int64_t bytes = 0;
  std::memcpy(&bytes, p, static_cast<size_t>(n == W ? W : n));
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_cvtsi64_si128(bytes)));
}
inline void narrow_i8(int8_t* out, VI x, int64_t n) {
  const __m128i halves = _mm256_castsi256_si128(_mm256_permute4x64_epi64(_mm256_packs_epi32(x, x), 0x08));
  const int64_t bytes = _mm_cvtsi128_si64(_mm_packs_epi16(halves, halves));
  std::memcpy(out, &bytes, static_cast<size_t>(n == W ? W : n));
}
