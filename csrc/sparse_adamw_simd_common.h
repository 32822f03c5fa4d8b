// What the SIMD forms of the exact and lean CPU steps share: the step's scalars in every lane
// (Coeffs), and 16-bit floats: widen<T> (W values of T, one per 32-bit lane, to fp32) and
// narrow<T> (W floats rounded to T as static_cast<T> rounds). Included by sparse_adamw_simd.h and
// sparse_adamw_lean_simd.h inside an instruction set's namespace, which provides V, VI, W, set1,
// pack16, widen_f16, narrow_f16 and nan_lanes (simd_avx2.h, or the AVX-512 form in
// sparse_adamw.cpp).

typedef uint32_t U32 __attribute__((vector_size(sizeof(V))));

// The step's scalars, in every lane.
struct Coeffs {
  V sign, beta1, beta2, one_minus_b1, one_minus_b2, neg_decay, vstep, vinv, eps;
  Coeffs(const Hyper& h, float step_size, float inv_bc2_sqrt)
      : sign(set1(h.maximize ? -1.0f : 1.0f)),
        beta1(set1(h.beta1)),
        beta2(set1(h.beta2)),
        one_minus_b1(set1(h.one_minus_b1)),
        one_minus_b2(set1(h.one_minus_b2)),
        neg_decay(set1(-(h.lr * h.weight_decay))),
        vstep(set1(step_size)),
        vinv(set1(inv_bc2_sqrt)),
        eps(set1(h.eps)) {}
};

// T is c10::BFloat16 or c10::Half; bf16 is the top half of an fp32, which the lean step's bf16
// moments use too.
template <typename T>
inline V widen(VI x) {
  if constexpr (std::is_same_v<T, c10::Half>) return widen_f16(x);
  else return (V)((U32)x << 16);
}

// W values of x rounded to T (bf16 or fp16) into out, as static_cast<T> rounds.
template <typename T>
inline void narrow(uint16_t* out, V x) {
  if constexpr (std::is_same_v<T, c10::BFloat16>) {
    // c10's round_to_nearest_even: (u + 0x7FFF + ((u >> 16) & 1)) >> 16, and NaN -> 0x7FC0.
    const U32 u = (U32)x, nan = (U32)(x != x);
    const U32 rounded = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
    pack16(out, (VI)((rounded & ~nan) | (nan & 0x7FC0u)));
  } else {
    narrow_f16(out, x);
    // c10's software conversion writes every NaN as sign | 0x7E00, where the hardware keeps
    // part of the payload; nothing to mend when c10 itself converts with F16C.
    const unsigned nan = SIFT_C10_HALF_USES_F16C ? 0u : nan_lanes(x);
    if (nan) {
      const U32 u = (U32)x;
      for (int64_t t = 0; t < W; ++t) {
        if (nan >> t & 1u) out[t] = static_cast<uint16_t>((u[t] >> 16 & 0x8000u) | 0x7E00u);
      }
    }
  }
}
