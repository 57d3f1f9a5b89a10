// The IQ grid types' decoders (gguf_iq_blocks.h) on their own, without torch: a throughput
// benchmark and a dump of decoded CodeBlocks, so that the AVX-512, AVX2 and scalar paths can be
// compared on one machine by building this for each (tests/unit/test_gguf_iq_decoders.py does):
//
//   g++ -O3 -march=native    -std=c++17 -Ihybridllm/layers/csrc benchmarks/bench_iq_decode.cpp
//   g++ -O3 -march=native -mno-avx512vbmi ...  (AVX-512 without VBMI: gathers only)
//   g++ -O3 -march=x86-64-v3 -std=c++17 ...  (AVX2)
//   g++ -O3 -march=x86-64    -std=c++17 ...  (scalar)
//
//   ./a.out bench [seconds a type]   ns per super-block decode, one thread, per type
//   ./a.out dump TYPE COUNT          reads COUNT super-blocks of ggml type id TYPE on stdin and
//                                    writes each CodeBlock's codes (256 B), scales (16 int16),
//                                    d (float) on stdout
#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "gguf_iq_blocks.h"

using namespace hybridllm_gguf;

namespace {

const char* path_name() {
#if defined(__AVX512VBMI__)
  return "avx512vbmi";
#elif defined(__AVX512BW__)
  return "avx512bw";
#elif defined(__AVX2__)
  return "avx2";
#else
  return "scalar";
#endif
}

template <int64_t kType>
int dump(int64_t count) {
  constexpr int64_t kBytes = gguf_type_info(kType).unit_bytes;
  std::vector<uint8_t> in(kBytes * count);
  if (std::fread(in.data(), 1, in.size(), stdin) != in.size()) return 2;
  CodeBlock cb;
  for (int64_t s = 0; s < count; ++s) {
    CodeBlockDecoder<kType>::decode(in.data() + s * kBytes, &cb);
    std::fwrite(cb.codes, 1, sizeof(cb.codes), stdout);
    std::fwrite(cb.scales, 1, sizeof(cb.scales), stdout);
    std::fwrite(&cb.d, 1, sizeof(cb.d), stdout);
  }
  return 0;
}

// Decodes a row of n = 256 super-blocks (L1/L2-resident) over and over for `seconds`: the
// fastest pass's ns a block. The fastest, not the mean: on a shared machine most passes (a few
// microseconds each) run uninterrupted, and the mean measures the other tenants.
template <int64_t kType>
void bench(const char* name, double seconds) {
  constexpr int64_t kBytes = gguf_type_info(kType).unit_bytes;
  constexpr int64_t n = 256;
  std::vector<uint8_t> in(kBytes * n);
  std::mt19937 rng(1);
  for (auto& b : in) b = static_cast<uint8_t>(rng());
  for (int64_t s = 0; s < n; ++s) {  // a normal fp16 d where the format has one at byte 0
    in[s * kBytes] = 0x00;
    in[s * kBytes + 1] = 0x30;
  }
  CodeBlock cb;
  int64_t sink = 0;
  double best = 1e30;
  const auto start = std::chrono::steady_clock::now();
  for (;;) {
    const auto t0 = std::chrono::steady_clock::now();
    for (int64_t s = 0; s < n; ++s) {
      CodeBlockDecoder<kType>::decode(in.data() + s * kBytes, &cb);
      asm volatile("" : : "r"(&cb) : "memory");
      sink += cb.codes[s & 255];
    }
    const auto t1 = std::chrono::steady_clock::now();
    best = std::min(best, std::chrono::duration<double>(t1 - t0).count());
    if (std::chrono::duration<double>(t1 - start).count() > seconds) break;
  }
  std::printf("%-8s %-9s %7.2f ns/super-block  %7.1f M super-blocks/s  (%lld)\n", name,
              path_name(), best * 1e9 / n, n / best * 1e-6, static_cast<long long>(sink & 1));
}

}  // namespace

int main(int argc, char** argv) {
  const std::string mode = argc > 1 ? argv[1] : "bench";
  if (mode == "dump" && argc == 4) {
    const int64_t type = std::atoll(argv[2]), count = std::atoll(argv[3]);
    switch (type) {
      case kIQ2_XXS: return dump<kIQ2_XXS>(count);
      case kIQ2_XS: return dump<kIQ2_XS>(count);
      case kIQ3_XXS: return dump<kIQ3_XXS>(count);
      case kIQ1_S: return dump<kIQ1_S>(count);
      case kIQ3_S: return dump<kIQ3_S>(count);
      case kIQ2_S: return dump<kIQ2_S>(count);
      case kIQ1_M: return dump<kIQ1_M>(count);
      default: return 3;
    }
  }
  if (mode != "bench") {
    std::fprintf(stderr, "usage: %s bench [seconds] | dump TYPE COUNT\n", argv[0]);
    return 1;
  }
  const double seconds = argc > 2 ? std::atof(argv[2]) : 0.5;
  bench<kIQ2_XXS>("IQ2_XXS", seconds);
  bench<kIQ2_XS>("IQ2_XS", seconds);
  bench<kIQ2_S>("IQ2_S", seconds);
  bench<kIQ3_XXS>("IQ3_XXS", seconds);
  bench<kIQ3_S>("IQ3_S", seconds);
  bench<kIQ1_S>("IQ1_S", seconds);
  bench<kIQ1_M>("IQ1_M", seconds);
  return 0;
}
