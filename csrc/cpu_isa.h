// Instruction-set choice shared by the C++ ops with SIMD code (singular_values.cpp,
// sparse_adamw.cpp). Each op detects the best level its own code can use on this CPU; an
// `isa` argument ("auto", "generic", "avx2", "avx512") lets tests and benchmarks run every
// level the CPU supports, and asking for more than the CPU has raises. For the optimizer
// steps "auto" is not the widest level but the one measured fastest here (AutoIsa).
#pragma once

#include <c10/util/Exception.h>

#include <atomic>
#include <cstdlib>
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

// The widest form of the optimizer steps (sparse_adamw.cpp, sparse_adamw_lean.cpp) this CPU
// runs: AVX-512 with PREFETCHW (its weight prefetches), AVX2 with F16C (fp16 conversions).
inline Isa detect_step_isa() {
#ifdef SIFT_X86_SIMD
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512f") && cpu_has_prefetchw()) return Isa::avx512;
  if (__builtin_cpu_supports("avx2") && cpu_has_f16c()) return Isa::avx2;
#endif
  return Isa::generic;
}

inline Isa parse_isa(const std::string& name) {
  if (name == "generic") return Isa::generic;
  if (name == "avx2") return Isa::avx2;
  TORCH_CHECK(name == "avx512", "isa must be one of 'auto', 'generic', 'avx2', 'avx512', got '", name, "'");
  return Isa::avx512;
}

inline Isa isa_from_request(const std::string& request, Isa best) {
  if (request.empty() || request == "auto") return best;
  const Isa want = parse_isa(request);
  TORCH_CHECK(static_cast<int>(want) <= static_cast<int>(best), "isa '", request,
              "' is not supported by this CPU or build (best available: '", isa_name(best), "')");
  return want;
}

// The levels up to `best`, scalar first, comma-separated ("generic,avx2").
inline std::string isa_levels(Isa best) {
  std::string out = "generic";
  if (static_cast<int>(best) >= static_cast<int>(Isa::avx2)) out += ",avx2";
  if (best == Isa::avx512) out += ",avx512";
  return out;
}

// What "auto" means for an optimizer step op whose widest form on this CPU is `widest`:
//   SIFT_CPU_ISA=generic|avx2|avx512 when set: that form (an op without it runs its widest
//     below it; a form this CPU cannot run, `cpu` being the widest it can, raises at the step);
//   else the form sift's loader measured fastest (sift/_simd.py, through the op's `_use_isa`);
//   else, before the loader has measured, the widest.
class AutoIsa {
 public:
  AutoIsa(Isa widest, Isa cpu) : widest_(widest), cpu_(cpu), chosen_(static_cast<int>(widest)) {}

  Isa widest() const { return widest_; }

  void set(const std::string& name) { chosen_.store(static_cast<int>(isa_from_request(name, widest_))); }

  Isa get() const {
    const char* forced = std::getenv("SIFT_CPU_ISA");
    if (forced != nullptr && *forced != '\0' && std::string(forced) != "auto") {
      const Isa want = parse_isa(forced);
      TORCH_CHECK(static_cast<int>(want) <= static_cast<int>(cpu_), "SIFT_CPU_ISA=", forced,
                  " asks for a form this CPU cannot run (widest: '", isa_name(cpu_), "')");
      return static_cast<int>(want) < static_cast<int>(widest_) ? want : widest_;
    }
    return static_cast<Isa>(chosen_.load());
  }

  // The form of a call: `request` "auto" (or empty) is get(), else that form, checked.
  Isa resolve(const std::string& request) const {
    if (request.empty() || request == "auto") return get();
    return isa_from_request(request, widest_);
  }

 private:
  Isa widest_, cpu_;
  std::atomic<int> chosen_;
};

}  // namespace sift
