// The sampling step's ops on the CPU, with the semantics of kernels/reference.py: penalties,
// grammar bitmask, the top-k/top-p/min-p filter and the draw.
//
// The torch reference defines these ops over whole [B, V] tensors: top-k/top-p sort every row,
// the draw runs Philox4x32-10 as int64 tensor ops for every token of every row, and the
// penalties and the bitmask make several full-size temporaries. At 64 sampled rows of a 4k
// vocabulary that was 25 ms a step (a greedy decode step of the demo model is ~5 ms); at a 152k
// vocabulary (Qwen2) the draw alone took 4 s. Here each row is handled on its own: top-k is a
// selection, top-p walks the largest values in descending order only as far as the mass it
// needs, and the draw computes noise only for tokens still finite after filtering (20 of them
// under top_k = 20). The Philox stream is the same bit for bit as the reference's and Triton's
// tl.rand, and the noise's log() is torch's own, so a seed draws the reference's token exactly.
#include <torch/extension.h>

#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <limits>
#include <optional>
#include <vector>

namespace {

constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// Rows run in parallel on torch's intra-op pool, outside the GIL (raw pointers only). Each task
// has one default-constructed Scratch for the buffers its rows reuse: fn(row, scratch).
template <typename Scratch, typename Fn>
void for_rows_with(int64_t B, Fn&& fn) {
  py::gil_scoped_release no_gil;
  at::parallel_for(0, B, 1, [&](int64_t begin, int64_t end) {
    Scratch scratch;
    for (int64_t b = begin; b < end; ++b) fn(b, scratch);
  });
}

struct NoScratch {};

template <typename Fn>
void for_rows(int64_t B, Fn&& fn) {
  for_rows_with<NoScratch>(B, [&](int64_t b, NoScratch&) { fn(b); });
}

void check_logits(const torch::Tensor& logits) {
  TORCH_CHECK(logits.device().is_cpu() && logits.dim() == 2 && logits.scalar_type() == torch::kFloat32,
              "logits must be a float32 [B, V] CPU tensor");
}

// The first index of the row's largest value (torch.argmax; 0 when every value is -inf).
inline int64_t argmax_row(const float* x, int64_t V) {
  int64_t best_j = 0;
  float best = kNegInf;
  for (int64_t j = 0; j < V; ++j)
    if (x[j] > best) best = x[j], best_j = j;
  return best_j;
}

// ---------------------------------------------------------------- penalties
// One token's logit under repetition (seen in prompt or output), then frequency and presence
// (output only), each rounded as the reference's separate tensor ops are (the file builds with
// -ffp-contract=off). `count`: the token's occurrences in the output.
inline float penalize(float v, int32_t count, bool in_prompt, float rep, float freq, float pres) {
  if (rep != 1.0f && (count > 0 || in_prompt)) v = v > 0 ? v / rep : v * rep;
  if (freq != 0.0f) v = v - freq * static_cast<float>(count);
  if (pres != 0.0f) v = v - pres * (count > 0 ? 1.0f : 0.0f);
  return v;
}

torch::Tensor apply_penalties(const torch::Tensor& logits, const torch::Tensor& counts, const torch::Tensor& prompt_mask,
                              const torch::Tensor& frequency, const torch::Tensor& presence,
                              const torch::Tensor& repetition) {
  check_logits(logits);
  const int64_t B = logits.size(0), V = logits.size(1);
  const torch::Tensor x = logits.contiguous(), cnt = counts.to(torch::kInt32).contiguous(),
                      pm = prompt_mask.to(torch::kBool).contiguous();
  const torch::Tensor f = frequency.to(torch::kFloat32).contiguous(), pr = presence.to(torch::kFloat32).contiguous(),
                      r = repetition.to(torch::kFloat32).contiguous();
  TORCH_CHECK(cnt.sizes() == x.sizes() && pm.sizes() == x.sizes(), "counts and prompt mask must be [B, V]");
  TORCH_CHECK(f.numel() == B && pr.numel() == B && r.numel() == B, "one frequency, presence and repetition penalty per row");
  torch::Tensor out = torch::empty_like(x);
  const float* xp = x.data_ptr<float>();
  const int32_t* cp = cnt.data_ptr<int32_t>();
  const bool* pp = pm.data_ptr<bool>();
  const float *fp = f.data_ptr<float>(), *prp = pr.data_ptr<float>(), *rp = r.data_ptr<float>();
  float* op = out.data_ptr<float>();
  for_rows(B, [&](int64_t b) {
    const float rep = rp[b], freq = fp[b], pres = prp[b];
    const float* xr = xp + b * V;
    const int32_t* cr = cp + b * V;
    const bool* pmr = pp + b * V;
    float* o = op + b * V;
    for (int64_t i = 0; i < V; ++i) o[i] = penalize(xr[i], cr[i], pmr[i], rep, freq, pres);
  });
  return out;
}

// The count tables' checks and a row's penalty statistics, read in place by slot (-1: none).
struct PenaltyTables {
  const int32_t* counts;
  const bool* prompt;
  const int64_t* slots;
  const float *freq, *pres, *rep;
};

PenaltyTables penalty_tables(const torch::Tensor& counts_table, const torch::Tensor& prompt_table,
                             const torch::Tensor& slots, const torch::Tensor& frequency, const torch::Tensor& presence,
                             const torch::Tensor& repetition, int64_t B, int64_t V) {
  TORCH_CHECK(counts_table.scalar_type() == torch::kInt32 && prompt_table.scalar_type() == torch::kBool &&
                  counts_table.is_contiguous() && prompt_table.is_contiguous() && counts_table.dim() == 2 &&
                  counts_table.size(1) == V && prompt_table.sizes() == counts_table.sizes(),
              "count tables must be contiguous int32 and bool [slots, V]");
  for (const torch::Tensor* t : {&slots, &frequency, &presence, &repetition})
    TORCH_CHECK(t->is_contiguous() && t->numel() == B, "one slot and one of each penalty per row");
  TORCH_CHECK(slots.scalar_type() == torch::kInt64 && frequency.scalar_type() == torch::kFloat32 &&
                  presence.scalar_type() == torch::kFloat32 && repetition.scalar_type() == torch::kFloat32,
              "slots int64, penalties float32");
  const int64_t S = counts_table.size(0);
  const int64_t* sp = slots.data_ptr<int64_t>();
  for (int64_t b = 0; b < B; ++b) TORCH_CHECK(sp[b] >= -1 && sp[b] < S, "slot out of range");
  return {counts_table.data_ptr<int32_t>(), prompt_table.data_ptr<bool>(), sp, frequency.data_ptr<float>(),
          presence.data_ptr<float>(), repetition.data_ptr<float>()};
}

// apply_penalties in place, each row's statistics read from the tables by slot: no [rows, V]
// gather of the tables and no fresh output (each fresh 64 x 152k buffer costs ~9 ms of page
// faults). For the sampler's own copy of the logits.
//
// With `seen` ([slots, cap] int32: each slot's distinct prompt and output ids, the first
// seen_len[slot] of its row), a row visits only those tokens: penalize() leaves every other
// token as it is, bit for bit, so the result is the same, at a cost of the tokens a sequence has
// seen instead of the vocabulary (64 rows at 152k, 400 seen tokens each: 3.1 ms dense, 0.11 ms
// this way). A row that has seen a large part of the vocabulary takes the dense pass, which
// reads memory in order.
void apply_penalties_by_slot_(torch::Tensor& logits, const torch::Tensor& counts_table, const torch::Tensor& prompt_table,
                              const torch::Tensor& slots, const torch::Tensor& frequency, const torch::Tensor& presence,
                              const torch::Tensor& repetition, const std::optional<torch::Tensor>& seen,
                              const std::optional<torch::Tensor>& seen_len) {
  check_logits(logits);
  TORCH_CHECK(logits.is_contiguous(), "logits must be contiguous (changed in place)");
  const int64_t B = logits.size(0), V = logits.size(1);
  const PenaltyTables t = penalty_tables(counts_table, prompt_table, slots, frequency, presence, repetition, B, V);
  TORCH_CHECK(seen.has_value() == seen_len.has_value(), "seen and seen_len come together");
  const int32_t* sp = nullptr;
  const int64_t* lp = nullptr;
  int64_t cap = 0;
  if (seen.has_value()) {
    TORCH_CHECK(seen->scalar_type() == torch::kInt32 && seen->is_contiguous() && seen->dim() == 2 &&
                    seen->size(0) == counts_table.size(0) && seen_len->scalar_type() == torch::kInt64 &&
                    seen_len->is_contiguous() && seen_len->numel() == counts_table.size(0),
                "seen must be contiguous int32 [slots, cap] and seen_len int64 [slots]");
    sp = seen->data_ptr<int32_t>();
    lp = seen_len->data_ptr<int64_t>();
    cap = seen->size(1);
    for (int64_t b = 0; b < B; ++b) {
      if (t.slots[b] < 0) continue;
      const int64_t n = lp[t.slots[b]];
      TORCH_CHECK(n >= 0 && n <= cap, "seen_len out of range");
      const int32_t* ids = sp + t.slots[b] * cap;
      for (int64_t j = 0; j < n; ++j) TORCH_CHECK(ids[j] >= 0 && ids[j] < V, "seen token id out of range");
    }
  }
  float* xp = logits.data_ptr<float>();
  for_rows(B, [&](int64_t b) {
    if (t.slots[b] < 0) return;
    float* xr = xp + b * V;
    const int32_t* cr = t.counts + t.slots[b] * V;
    const bool* pmr = t.prompt + t.slots[b] * V;
    const float rep = t.rep[b], freq = t.freq[b], pres = t.pres[b];
    if (sp != nullptr && lp[t.slots[b]] * 8 < V) {
      const int32_t* ids = sp + t.slots[b] * cap;
      for (int64_t j = 0; j < lp[t.slots[b]]; ++j) {
        const int32_t i = ids[j];
        xr[i] = penalize(xr[i], cr[i], pmr[i], rep, freq, pres);
      }
      return;
    }
    for (int64_t i = 0; i < V; ++i) xr[i] = penalize(xr[i], cr[i], pmr[i], rep, freq, pres);
  });
}

// The greedy token of each row under its penalties, without writing the penalized row: the
// same float operations as apply_penalties, then argmax (lowest index on ties). The penalty
// statistics are read in place from the engine's [slots, V] tables; slot -1: no penalties.
torch::Tensor penalized_argmax(const torch::Tensor& logits, const torch::Tensor& counts_table,
                               const torch::Tensor& prompt_table, const torch::Tensor& slots,
                               const torch::Tensor& frequency, const torch::Tensor& presence,
                               const torch::Tensor& repetition) {
  check_logits(logits);
  const int64_t B = logits.size(0), V = logits.size(1);
  const PenaltyTables t = penalty_tables(counts_table, prompt_table, slots, frequency, presence, repetition, B, V);
  const torch::Tensor x = logits.contiguous();
  torch::Tensor out = torch::empty({B}, torch::kInt64);
  const float* xp = x.data_ptr<float>();
  int64_t* op = out.data_ptr<int64_t>();
  for_rows(B, [&](int64_t b) {
    const float* xr = xp + b * V;
    if (t.slots[b] < 0) {
      op[b] = argmax_row(xr, V);
      return;
    }
    const int32_t* cr = t.counts + t.slots[b] * V;
    const bool* pmr = t.prompt + t.slots[b] * V;
    const float rep = t.rep[b], freq = t.freq[b], pres = t.pres[b];
    int64_t best_j = 0;
    float best = kNegInf;
    for (int64_t i = 0; i < V; ++i) {
      const float v = penalize(xr[i], cr[i], pmr[i], rep, freq, pres);
      if (v > best) best = v, best_j = i;
    }
    op[b] = best_j;
  });
  return out;
}

// ---------------------------------------------------------------- grammar bitmask
// xgrammar's layout: bit j of word i allows token 32 * i + j; tokens past the mask are left alone.
torch::Tensor apply_token_bitmask(const torch::Tensor& logits, const torch::Tensor& bitmask, const torch::Tensor& row_mask) {
  check_logits(logits);
  const int64_t B = logits.size(0), V = logits.size(1);
  const torch::Tensor bm = bitmask.to(torch::kInt32).contiguous(), rm = row_mask.to(torch::kBool).contiguous();
  TORCH_CHECK(bm.dim() == 2 && bm.size(0) == B && rm.numel() == B, "bitmask [B, words] and row_mask [B]");
  const int64_t W = bm.size(1), cover = std::min(V, 32 * W);
  torch::Tensor out = logits.contiguous().clone();
  const int32_t* bp = bm.data_ptr<int32_t>();
  const bool* rmp = rm.data_ptr<bool>();
  float* op = out.data_ptr<float>();
  for_rows(B, [&](int64_t b) {
    if (!rmp[b]) return;
    const uint32_t* words = reinterpret_cast<const uint32_t*>(bp + b * W);
    float* o = op + b * V;
    for (int64_t j = 0; j < cover; ++j)
      if (!((words[j >> 5] >> (j & 31)) & 1u)) o[j] = kNegInf;
  });
  return out;
}

// ---------------------------------------------------------------- top-k / top-p / min-p
struct Entry {
  float x;  // logit
  float e;  // exp(x - max), the reference's value
};

// Every token whose logit is >= the `want`-th largest (ties included), unordered, in one pass:
// tokens below a running threshold are skipped, and when the buffer fills it is cut back to its
// `want` largest and the threshold rises to the smallest of those. On a 152k vocabulary that is
// a few hundred insertions instead of sorting or selecting over the whole row. Returns whether
// the buffer holds the whole row (no threshold was ever set).
bool top_candidates(const float* x, const float* e, int64_t V, int64_t want, std::vector<Entry>& buf) {
  auto greater = [](const Entry& a, const Entry& b) { return a.x > b.x; };
  size_t cap = static_cast<size_t>(std::max<int64_t>(4 * want, 1024));
  float thr = kNegInf;
  bool cut = false;
  buf.clear();
  for (int64_t i = 0; i < V; ++i) {
    if (!(x[i] >= thr)) continue;  // NaN too: std::nth_element must never compare one (UB)
    buf.push_back(Entry{x[i], e != nullptr ? e[i] : 0.0f});
    if (buf.size() >= cap) {
      std::nth_element(buf.begin(), buf.begin() + (want - 1), buf.end(), greater);
      thr = buf[want - 1].x;
      buf.erase(std::remove_if(buf.begin(), buf.end(), [&](const Entry& a) { return a.x < thr; }), buf.end());
      cut = true;
      if (buf.size() >= cap / 2) cap *= 2;  // mostly ties at the threshold: make room
    }
  }
  return !cut;
}

// One row: writes x or -inf per token (see reference.top_k_top_p_min_p for the contract). `e` is
// exp(x - max) per token (null when no filter needs masses), and may be `out` itself: the last
// pass reads a token's mass before it writes that token. m: the row's max.
void filter_row(const float* x, const float* e, float* out, int64_t V, float m, int64_t k, float top_p, float min_p,
                std::vector<Entry>& buf) {
  const bool k_on = k > 0 && k < V, p_on = top_p < 1.0f, min_on = min_p > 0.0f;
  auto greater = [](const Entry& a, const Entry& b) { return a.x > b.x; };

  // A token survives iff x >= lo (top-k and top-p thresholds; both keep ties) and passes min-p.
  float lo = kNegInf;
  if (k_on) {
    top_candidates(x, e, V, k, buf);
    // Fewer than k comparable tokens (NaN logits are skipped): top-k keeps them all. Reading
    // buf[k - 1] past the end crashed the server on a NaN-weighted adapter (QA).
    if (static_cast<int64_t>(buf.size()) >= k) {
      std::nth_element(buf.begin(), buf.begin() + (k - 1), buf.end(), greater);
      lo = buf[k - 1].x;
    }
  }
  if (p_on) {
    // Eight running sums: one would wait on the previous add every token. (The reference's
    // torch sum has its own order too; only the threshold's last bits can differ.)
    double part[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    int64_t i8 = 0;
    for (; i8 + 8 <= V; i8 += 8)
      for (int j = 0; j < 8; ++j) part[j] += static_cast<double>(e[i8 + j]);
    for (; i8 < V; ++i8) part[0] += static_cast<double>(e[i8]);
    const double total = ((part[0] + part[1]) + (part[2] + part[3])) + ((part[4] + part[5]) + (part[6] + part[7]));
    const double thr = static_cast<double>(top_p) * total;
    // Walk the distinct values downwards, summing their masses in that order (as the
    // reference's cumulative sum over the sorted row): a group is kept while the mass strictly
    // above it is below the threshold, so the group that crosses it is kept, ties included.
    // The candidates hold every token >= their smallest value; if the walk needs more, it
    // starts again over eight times as many.
    for (int64_t want = k_on ? k : 64;; want = std::min<int64_t>(V, 8 * want)) {
      const bool whole_row = top_candidates(x, e, V, want, buf);
      std::sort(buf.begin(), buf.end(), greater);
      double above = 0.0;
      float p_lo = std::numeric_limits<float>::infinity();  // nothing kept yet
      bool decided = false;
      for (size_t i = 0; i < buf.size();) {
        const float v = buf[i].x;
        // Below top-k's threshold nothing more can survive; -inf tokens come out -inf either way.
        if (v == kNegInf || v < lo || !(above < thr)) {
          decided = true;
          break;
        }
        p_lo = v;
        for (; i < buf.size() && buf[i].x == v; ++i) above += static_cast<double>(buf[i].e);
      }
      if (decided || whole_row || want >= V) {
        lo = std::max(lo, p_lo);
        break;
      }
    }
  }
  for (int64_t i = 0; i < V; ++i) {
    const float xi = x[i];
    const bool keep = (xi >= lo && (!min_on || e[i] >= min_p)) || xi == m;
    out[i] = keep ? xi : kNegInf;
  }
}

torch::Tensor top_k_top_p_min_p(const torch::Tensor& logits, const torch::Tensor& top_k, const torch::Tensor& top_p,
                                const torch::Tensor& min_p) {
  check_logits(logits);
  const int64_t B = logits.size(0), V = logits.size(1);
  const torch::Tensor k = top_k.to(torch::kInt64).contiguous(), p = top_p.to(torch::kFloat32).contiguous(),
                      mp = min_p.to(torch::kFloat32).contiguous();
  TORCH_CHECK(k.numel() == B && p.numel() == B && mp.numel() == B, "one top_k, top_p and min_p per row");
  const bool masses = (p < 1.0f).any().item<bool>() || (mp > 0.0f).any().item<bool>();
  torch::Tensor x, m, out;
  {
    py::gil_scoped_release no_gil;
    x = logits.contiguous();
    // The row max and the masses exp(x - max) come from the same torch ops as the reference's,
    // so top-p and min-p compare the very same floats (and torch's exp is vectorized). The
    // masses are computed in place and the output overwrites them token by token: each fresh
    // [B, V] buffer costs its page faults (9 ms at 64 x 152k), more than the exp itself.
    m = std::get<0>(x.max(1, true));
    if (masses) {
      out = x - torch::where(m > kNegInf, m, torch::zeros_like(m));
      out.exp_();
    } else {
      out = torch::empty_like(x);
    }
  }
  const float *xp = x.data_ptr<float>(), *mptr = m.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const float* ep = masses ? op : nullptr;  // read before the same token's output is written
  const int64_t* kp = k.data_ptr<int64_t>();
  const float *pp = p.data_ptr<float>(), *mpp = mp.data_ptr<float>();
  for_rows_with<std::vector<Entry>>(B, [&](int64_t b, std::vector<Entry>& vals) {
    filter_row(xp + b * V, ep != nullptr ? ep + b * V : nullptr, op + b * V, V, mptr[b], kp[b], pp[b], mpp[b], vals);
  });
  return out;
}

// ---------------------------------------------------------------- draw
// Philox4x32-10 (triton.language.random's rounds and constants); returns the first output word.
inline uint32_t philox_first(uint32_t c0, uint32_t c1, uint32_t k0, uint32_t k1) {
  uint32_t c2 = 0, c3 = 0;
  for (int r = 0; r < 10; ++r) {
    const uint64_t pb = static_cast<uint64_t>(0xCD9E8D57u) * c2, pa = static_cast<uint64_t>(0xD2511F53u) * c0;
    const uint32_t hi_b = static_cast<uint32_t>(pb >> 32), lo_b = static_cast<uint32_t>(pb);
    const uint32_t hi_a = static_cast<uint32_t>(pa >> 32), lo_a = static_cast<uint32_t>(pa);
    const uint32_t n0 = hi_b ^ c1 ^ k0, n2 = hi_a ^ c3 ^ k1;
    c0 = n0;
    c1 = lo_b;
    c2 = n2;
    c3 = lo_a;
    k0 += 0x9E3779B9u;
    k1 += 0xBB67AE85u;
  }
  return c0;
}

// tl.rand's uint -> [0, 1) float, as reference.philox_uniform: one IEEE multiply.
inline float uniform(uint32_t r) {
  int32_t v = static_cast<int32_t>(r);
  if (v < 0) v = -v - 1;  // ~v, without overflow at INT32_MIN
  return static_cast<float>(v) * 4.6566127342e-10f;
}

// Scratch for one task's rows: the finite tokens of the row and their noise.
struct DrawScratch {
  std::vector<int32_t> tokens;
  std::vector<float> noise;
};

int64_t draw_row(const float* x, int64_t V, int64_t seed, int64_t offset, bool greedy, DrawScratch& sc) {
  if (greedy) return argmax_row(x, V);
  // -inf + noise stays -inf: filtered tokens need no noise (under top-k 20, 20 of a row do).
  sc.tokens.clear();
  for (int64_t j = 0; j < V; ++j)
    if (x[j] != kNegInf) sc.tokens.push_back(static_cast<int32_t>(j));
  const int64_t n = static_cast<int64_t>(sc.tokens.size());
  const uint64_t s = static_cast<uint64_t>(seed);
  const uint32_t k0 = static_cast<uint32_t>(s), k1 = static_cast<uint32_t>(s >> 32);
  const uint32_t c1 = static_cast<uint32_t>(static_cast<uint64_t>(offset));
  sc.noise.resize(n);
  for (int64_t t = 0; t < n; ++t) sc.noise[t] = uniform(philox_first(static_cast<uint32_t>(sc.tokens[t]), c1, k0, k1));
  // g = -log(-log(u)) with torch's own log, as the reference computes it: the same noise bit
  // for bit (and vectorized), so a seed draws the reference's token even at a near-tie.
  if (n > 0) torch::from_blob(sc.noise.data(), {n}, torch::kFloat32).log_().neg_().log_().neg_();
  int64_t best_j = 0;
  float best = kNegInf;
  for (int64_t t = 0; t < n; ++t) {
    const float val = x[sc.tokens[t]] + sc.noise[t];
    if (val > best) best = val, best_j = sc.tokens[t];
  }
  return best_j;
}

torch::Tensor sample(const torch::Tensor& logits, const torch::Tensor& seeds, const torch::Tensor& offsets,
                     const torch::Tensor& greedy_mask) {
  check_logits(logits);
  const int64_t B = logits.size(0), V = logits.size(1);
  TORCH_CHECK(V < (int64_t{1} << 32), "the Philox counter holds the token index in 32 bits");
  const torch::Tensor x = logits.contiguous();
  const torch::Tensor sd = seeds.to(torch::kInt64).contiguous(), off = offsets.to(torch::kInt64).contiguous(),
                      gr = greedy_mask.to(torch::kBool).contiguous();
  TORCH_CHECK(sd.numel() == B && off.numel() == B && gr.numel() == B, "one seed, offset and greedy flag per row");
  torch::Tensor out = torch::empty({B}, torch::kInt64);
  const float* xp = x.data_ptr<float>();
  const int64_t *sp = sd.data_ptr<int64_t>(), *offp = off.data_ptr<int64_t>();
  const bool* gp = gr.data_ptr<bool>();
  int64_t* op = out.data_ptr<int64_t>();
  for_rows_with<DrawScratch>(B, [&](int64_t b, DrawScratch& sc) { op[b] = draw_row(xp + b * V, V, sp[b], offp[b], gp[b], sc); });
  return out;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("apply_penalties", &apply_penalties, "repetition, then frequency and presence penalties");
  m.def("apply_penalties_by_slot_", &apply_penalties_by_slot_, "apply_penalties in place, statistics read by slot",
        py::arg("logits"), py::arg("counts_table"), py::arg("prompt_table"), py::arg("slots"), py::arg("frequency"),
        py::arg("presence"), py::arg("repetition"), py::arg("seen") = py::none(), py::arg("seen_len") = py::none());
  m.def("penalized_argmax", &penalized_argmax, "greedy token per row under its penalties (tables read by slot)");
  m.def("apply_token_bitmask", &apply_token_bitmask, "grammar bitmask: a 0 bit sets the token's logit to -inf");
  m.def("top_k_top_p_min_p", &top_k_top_p_min_p, "joint top-k / top-p / min-p filter (removed tokens -inf)");
  m.def("sample", &sample, "Gumbel-max draw with Philox noise keyed by (seed, offset, token)");
}
