// Instruction-set choice shared by the C++ ops with SIMD code (singular_values.cpp,
// sparse_adamw.cpp). Each op detects the best level its own code can use on this CPU; an
// `isa` argument ("auto", "generic", "avx2", "avx512") lets tests and benchmarks run every
// level the CPU supports, and asking for more than the CPU has raises.
#pragma once

#include <c10/util/Exception.h>

#include <string>

namespace sift {

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define SIFT_X86_SIMD 1
#include <cpuid.h>
#endif

enum class Isa { generic, avx2, avx512 };

inline const char* isa_name(Isa isa) {
  switch (isa) {
    case Isa::avx512:
      return "avx512";
    case Isa::avx2:
      return "avx2";
    default:
      return "generic";
  }
}

#ifdef SIFT_X86_SIMD
// CPUID bits that __builtin_cpu_supports only knows from GCC 11 or 12 on. F16C comes with
// every AVX2 CPU (Haswell on); PREFETCHW with Broadwell, Zen and every AVX-512 CPU. The OS
// support of the AVX state is checked by __builtin_cpu_supports("avx2") / ("avx512f").
inline bool cpu_has_f16c() {  // CPUID.1:ECX[29]
  unsigned a, b, c, d;
  return __get_cpuid(1, &a, &b, &c, &d) && (c & (1u << 29));
}
inline bool cpu_has_prefetchw() {  // CPUID.80000001H:ECX[8] (PRFCHW)
  unsigned a, b, c, d;
  return __get_cpuid(0x80000001u, &a, &b, &c, &d) && (c & (1u << 8));
}
#endif

inline Isa isa_from_request(const std::string& request, Isa best) {
  if (request.empty() || request == "auto") return best;
  Isa want;
  if (request == "generic")
    want = Isa::generic;
  else if (request == "avx2")
    want = Isa::avx2;
  else if (request == "avx512")
    want = Isa::avx512;
  else
    TORCH_CHECK(false, "isa must be one of 'auto', 'generic', 'avx2', 'avx512', got '", request, "'");
  TORCH_CHECK(static_cast<int>(want) <= static_cast<int>(best), "isa '", request,
              "' is not supported by this CPU or build (best available: '", isa_name(best), "')");
  return want;
}

}  // namespace sift
