// Decode attention over the paged KV cache on the CPU, reading blocks in place.
//
// The torch fallback gathers every sequence's blocks into a padded [kvh, B, max_k, d] tensor
// for K and for V, every layer, every step: at 64 sequences that copy plus the masked padded
// matmuls were over a third of a decode step on the demo model. Here each (sequence, KV head)
// pair walks its own block table once: scores for the G query heads sharing the KV head,
// softmax, weighted sum of V. No padding, no copies; pairs run in parallel on torch's
// intra-op thread pool. Same contract as kernels/paged_attention.py (the CUDA kernel).
#include <torch/extension.h>

#include <ATen/Parallel.h>

#if defined(__F16C__) || defined(__AVX2__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <array>
#include <cmath>
#include <limits>
#include <type_traits>
#include <vector>

namespace {

// float rows are used in place; half and bfloat16 rows are widened into `buf` first.
inline const float* as_float(const float* row, float*, int64_t) { return row; }
template <typename scalar_t>
inline const float* as_float(const scalar_t* row, float* buf, int64_t D) {
  for (int64_t d = 0; d < D; ++d) buf[d] = static_cast<float>(row[d]);
  return buf;
}
#if defined(__F16C__)
// c10::Half widens bit by bit in software, which does not vectorize: a float16 cache read that
// way took 1.6x as long as a float32 one. F16C widens eight at a time.
inline const float* as_float(const c10::Half* row, float* buf, int64_t D) {
  int64_t d = 0;
  for (; d + 8 <= D; d += 8)
    _mm256_storeu_ps(buf + d, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row + d))));
  for (; d < D; ++d) buf[d] = static_cast<float>(row[d]);
  return buf;
}
#endif

// fp8 (e4m3fn, e5m2) has 256 values: widening is a table lookup.
template <typename fp8_t>
const std::array<float, 256>& fp8_table() {
  static const std::array<float, 256> table = [] {
    std::array<float, 256> t{};
    for (int i = 0; i < 256; ++i) t[i] = static_cast<float>(fp8_t(static_cast<uint8_t>(i), fp8_t::from_bits()));
    return t;
  }();
  return table;
}
template <typename fp8_t>
inline const float* widen_fp8(const fp8_t* row, float* buf, int64_t D) {
  const float* table = fp8_table<fp8_t>().data();
  const uint8_t* bytes = reinterpret_cast<const uint8_t*>(row);
  for (int64_t d = 0; d < D; ++d) buf[d] = table[bytes[d]];
  return buf;
}
#if defined(__F16C__) && defined(__AVX2__)
// Eight at a time through half precision, bit-exact with the table (tests): an fp8 byte moved
// into a half's bit positions is a half of the same value (e5m2: exactly; e4m3fn: times 2^-8,
// its exponent bias being 7 against 15, subnormals included). The table alone made an fp8 cache
// slower to read than a float32 one.
inline __m128i load8_u16(const uint8_t* p) { return _mm_cvtepu8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))); }
inline const float* as_float(const c10::Float8_e5m2* row, float* buf, int64_t D) {
  const uint8_t* bytes = reinterpret_cast<const uint8_t*>(row);
  int64_t d = 0;
  for (; d + 8 <= D; d += 8) _mm256_storeu_ps(buf + d, _mm256_cvtph_ps(_mm_slli_epi16(load8_u16(bytes + d), 8)));
  return d == D ? buf : (widen_fp8(row + d, buf + d, D - d), buf);
}
inline const float* as_float(const c10::Float8_e4m3fn* row, float* buf, int64_t D) {
  const uint8_t* bytes = reinterpret_cast<const uint8_t*>(row);
  const __m128i low7 = _mm_set1_epi16(0x7F), sign = _mm_set1_epi16(0x80);
  const __m256 two8 = _mm256_set1_ps(256.f), nan = _mm256_set1_ps(std::numeric_limits<float>::quiet_NaN());
  int64_t d = 0;
  for (; d + 8 <= D; d += 8) {
    const __m128i x = load8_u16(bytes + d), mag = _mm_and_si128(x, low7);
    const __m128i h = _mm_or_si128(_mm_slli_epi16(_mm_and_si128(x, sign), 8), _mm_slli_epi16(mag, 7));
    const __m256 f = _mm256_mul_ps(_mm256_cvtph_ps(h), two8);
    const __m256 is_nan = _mm256_castsi256_ps(_mm256_cvtepi16_epi32(_mm_cmpeq_epi16(mag, low7)));  // S.1111.111
    _mm256_storeu_ps(buf + d, _mm256_blendv_ps(f, nan, is_nan));
  }
  return d == D ? buf : (widen_fp8(row + d, buf + d, D - d), buf);
}
#else
inline const float* as_float(const c10::Float8_e4m3fn* row, float* buf, int64_t D) { return widen_fp8(row, buf, D); }
inline const float* as_float(const c10::Float8_e5m2* row, float* buf, int64_t D) { return widen_fp8(row, buf, D); }
#endif

// Blocks are scattered, so the hardware prefetcher cannot see the next one coming: the loop is
// bound by memory latency, and asking for block i + 1 while computing block i hides most of it.
template <typename scalar_t>
inline void prefetch_block(const scalar_t* p, int64_t elems) {
  const char* c = reinterpret_cast<const char*>(p);
  for (int64_t off = 0; off < elems * static_cast<int64_t>(sizeof(scalar_t)); off += 64) __builtin_prefetch(c + off);
}

// Calls fn(t - begin, row) for the context's tokens t = begin..L-1 in order, row being token
// t's D values (as float) in one KV head's cache `head`. A block's rows are contiguous (slot
// stride == D), so a narrower cache is widened a block at a time into `buf` (block_size * D
// floats): one long loop instead of one per row.
template <typename scalar_t, typename Fn>
inline void for_each_row(const scalar_t* head, const int32_t* table, int64_t begin, int64_t L, int64_t block_size,
                         int64_t D, float* buf, Fn&& fn) {
  const int64_t num_blocks = (L + block_size - 1) / block_size;
  for (int64_t i = begin / block_size; i < num_blocks; ++i) {
    const int64_t t0 = i * block_size, n = std::min(block_size, L - t0), skip = std::max<int64_t>(begin - t0, 0);
    const scalar_t* block = head + static_cast<int64_t>(table[i]) * block_size * D;
    if (i + 1 < num_blocks) prefetch_block(head + static_cast<int64_t>(table[i + 1]) * block_size * D, block_size * D);
    const float* rows = as_float(block, buf, n * D);
    for (int64_t j = skip; j < n; ++j) fn(t0 + j - begin, rows + j * D);
  }
}

// DIM > 0 fixes the head size at compile time so the inner loops vectorize; 0 is any size.
// Queries and output are float (the caller widens and narrows them: [B, H, d] is small); the
// cache is the KV cache's own dtype, widened a block at a time as it is read.
template <typename scalar_t, int DIM>
void decode(const float* q, const scalar_t* k, const scalar_t* v, float* out, const int32_t* tables,
            const int32_t* lens, int64_t B, int64_t H, int64_t kvh, int64_t dim, int64_t max_blocks,
            int64_t block_size, int64_t head_stride, float scale, int64_t window) {
  const int64_t D = DIM > 0 ? DIM : dim;
  const int64_t G = H / kvh;
  at::parallel_for(0, B * kvh, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qf(G * D), acc(G * D), scores, rows(std::is_same_v<scalar_t, float> ? 0 : block_size * D),
        denom(G);
    for (int64_t w = begin; w < end; ++w) {
      const int64_t b = w / kvh, h = w % kvh;
      const int64_t L = lens[b];
      // Sliding window: the last `window` keys only; n keys in sight.
      const int64_t begin = window > 0 ? std::max<int64_t>(L - window, 0) : 0, n = L - begin;
      const int32_t* table = tables + b * max_blocks;
      const scalar_t* kh = k + h * head_stride;
      const scalar_t* vh = v + h * head_stride;
      for (int64_t g = 0; g < G; ++g)
        for (int64_t d = 0; d < D; ++d) qf[g * D + d] = q[(b * H + h * G + g) * D + d] * scale;
      scores.resize(G * n);
      // Each K row is read once for the G query heads that share this KV head.
      for_each_row(kh, table, begin, L, block_size, D, rows.data(), [&](int64_t t, const float* r) {
        for (int64_t g = 0; g < G; ++g) {
          const float* qg = qf.data() + g * D;
          float s = 0.f;
#pragma omp simd reduction(+ : s)
          for (int64_t d = 0; d < D; ++d) s += qg[d] * r[d];
          scores[g * n + t] = s;
        }
      });
      for (int64_t g = 0; g < G; ++g) {
        float* sg = scores.data() + g * n;
        const float m = *std::max_element(sg, sg + n);
        float sum = 0.f;
        for (int64_t t = 0; t < n; ++t) {
          sg[t] = std::exp(sg[t] - m);
          sum += sg[t];
        }
        denom[g] = sum;
      }
      std::fill(acc.begin(), acc.end(), 0.f);
      for_each_row(vh, table, begin, L, block_size, D, rows.data(), [&](int64_t t, const float* r) {
        for (int64_t g = 0; g < G; ++g) {
          const float p = scores[g * n + t];
          float* ag = acc.data() + g * D;
#pragma omp simd
          for (int64_t d = 0; d < D; ++d) ag[d] += p * r[d];
        }
      });
      for (int64_t g = 0; g < G; ++g)
        for (int64_t d = 0; d < D; ++d)
          out[(b * H + h * G + g) * D + d] = acc[g * D + d] / denom[g];
    }
  });
}

// Takes references and releases the GIL only around the loop: a Tensor copied or destroyed
// without the GIL while its PyObject is alive takes the GIL back to fix that object's refcount
// (torch's PyObject preservation), and inside tritonserver a response thread may hold it then.
// With the whole call outside the GIL (pybind's call_guard), the by-value arguments and no-op
// `.to()`s did that several times per call.
torch::Tensor paged_decode_attention(const torch::Tensor& q, const torch::Tensor& k_cache, const torch::Tensor& v_cache,
                                     const torch::Tensor& block_tables, const torch::Tensor& context_lens,
                                     int64_t block_size, double scale, int64_t window) {
  TORCH_CHECK(q.device().is_cpu() && k_cache.device().is_cpu() && v_cache.device().is_cpu(), "CPU tensors only");
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 3 && k_cache.sizes() == v_cache.sizes(),
              "q must be [B, H, d] and the caches [kvh, slots, d]");
  TORCH_CHECK(v_cache.scalar_type() == k_cache.scalar_type(), "the K and V caches must share a dtype");
  const auto kv_type = k_cache.scalar_type();
  TORCH_CHECK(kv_type == at::kFloat || kv_type == at::kBFloat16 || kv_type == at::kHalf ||
                  kv_type == at::kFloat8_e4m3fn || kv_type == at::kFloat8_e5m2,
              "KV cache dtype must be float32, bfloat16, float16 or fp8 (e4m3fn, e5m2), not ", kv_type);
  TORCH_CHECK(k_cache.stride(2) == 1 && k_cache.stride(1) == k_cache.size(2) && k_cache.strides() == v_cache.strides(),
              "caches need contiguous slots ([kvh, slots, d] with slot stride d)");
  const int64_t B = q.size(0), H = q.size(1), D = q.size(2), kvh = k_cache.size(0);
  TORCH_CHECK(window >= 0, "window must be >= 0 (0: no sliding window)");
  TORCH_CHECK(k_cache.size(2) == D && H % kvh == 0, "head dims must agree and H % kvh == 0");
  TORCH_CHECK(block_tables.dim() == 2 && block_tables.size(0) == B && context_lens.numel() == B,
              "block_tables [B, max_blocks] and context_lens [B]");
  const torch::Tensor tables = block_tables.scalar_type() == torch::kInt32 && block_tables.is_contiguous()
                                   ? block_tables
                                   : block_tables.to(torch::kInt32).contiguous();
  const torch::Tensor lens = context_lens.scalar_type() == torch::kInt32 && context_lens.is_contiguous()
                                 ? context_lens
                                 : context_lens.to(torch::kInt32).contiguous();
  const int64_t max_blocks = tables.size(1), slots = k_cache.size(1);
  const int32_t* lp = lens.data_ptr<int32_t>();
  const int32_t* tp = tables.data_ptr<int32_t>();
  for (int64_t b = 0; b < B; ++b) {
    TORCH_CHECK(lp[b] >= 1 && lp[b] <= max_blocks * block_size, "context length out of range");
    for (int64_t i = 0; i < (lp[b] + block_size - 1) / block_size; ++i)
      TORCH_CHECK(tp[b * max_blocks + i] >= 0 && (tp[b * max_blocks + i] + 1) * block_size <= slots,
                  "block id out of range");
  }
  // The cache may be narrower than the model (kv_cache_dtype): queries go in as float, the
  // output comes back in the queries' dtype.
  const torch::Tensor qf = q.scalar_type() == torch::kFloat && q.is_contiguous() ? q : q.to(torch::kFloat).contiguous();
  torch::Tensor out = torch::empty_like(qf);
  if (B == 0) return out.to(q.scalar_type());
  {
    py::gil_scoped_release no_gil;  // raw pointers only inside this block
    auto for_cache = [&](auto tag) {
      using scalar_t = decltype(tag);
      auto run = [&](auto dim) {
        decode<scalar_t, decltype(dim)::value>(qf.data_ptr<float>(), k_cache.data_ptr<scalar_t>(),
                                               v_cache.data_ptr<scalar_t>(), out.data_ptr<float>(), tp, lp, B, H, kvh,
                                               D, max_blocks, block_size, k_cache.stride(0), static_cast<float>(scale),
                                               window);
      };
      switch (D) {
        case 32: run(std::integral_constant<int, 32>{}); break;
        case 64: run(std::integral_constant<int, 64>{}); break;
        case 128: run(std::integral_constant<int, 128>{}); break;
        default: run(std::integral_constant<int, 0>{});
      }
    };
    switch (k_cache.scalar_type()) {
      case at::kFloat: for_cache(float{}); break;
      case at::kBFloat16: for_cache(c10::BFloat16{}); break;
      case at::kHalf: for_cache(c10::Half{}); break;
      case at::kFloat8_e4m3fn: for_cache(c10::Float8_e4m3fn{}); break;
      case at::kFloat8_e5m2: for_cache(c10::Float8_e5m2{}); break;
      default: TORCH_CHECK(false, "unsupported KV cache dtype ", k_cache.scalar_type());  // checked above
    }
  }
  // With the GIL held again: a no-op for float queries, one small cast otherwise.
  return q.scalar_type() == torch::kFloat ? out : out.to(q.scalar_type());
}

// An fp8 tensor's values as float32, with the kernel's own widening: torch's e4m3fn conversion
// on the CPU goes value by value (~2.6 ns each), and prefill reads each sequence's whole context
// through it every layer.
torch::Tensor widen_fp8_tensor(const torch::Tensor& x) {
  TORCH_CHECK(x.device().is_cpu() && (x.scalar_type() == at::kFloat8_e4m3fn || x.scalar_type() == at::kFloat8_e5m2),
              "widen_fp8 takes a CPU fp8 tensor (e4m3fn or e5m2)");
  const torch::Tensor src = x.is_contiguous() ? x : x.contiguous();
  torch::Tensor out = torch::empty(src.sizes(), src.options().dtype(torch::kFloat));
  const int64_t n = src.numel();
  float* dst = out.data_ptr<float>();
  py::gil_scoped_release no_gil;
  auto run = [&](auto tag) {
    using fp8_t = decltype(tag);
    const fp8_t* p = src.data_ptr<fp8_t>();
    at::parallel_for(0, n, 1 << 15, [&](int64_t begin, int64_t end) { as_float(p + begin, dst + begin, end - begin); });
  };
  if (src.scalar_type() == at::kFloat8_e4m3fn)
    run(c10::Float8_e4m3fn{});
  else
    run(c10::Float8_e5m2{});
  return out;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("widen_fp8", &widen_fp8_tensor, "an fp8 CPU tensor's values as float32 (the decode kernel's widening)");
  // The loop runs without the GIL, like torch's own ops: inside tritonserver the response
  // threads share this process with the step loop and must not stall for the attention.
  m.def("paged_decode_attention", &paged_decode_attention,
        "decode attention over a paged KV cache (q [B,H,d], caches [kvh,slots,d]; window > 0: the last window keys)");
}
