// Top-k / top-p cut points for the sampler (layers/sampler.py), found without sorting the
// vocabulary: torch's sort of 32 rows x 49k logits takes ~60 ms on 2 cores, more than the decode
// step that made them. Per row, each token's weight w = exp(logit - max) in (0, 1] falls in a bin
// by its binade and top 4 mantissa bits (a larger w never in a later bin, and since exp is
// monotone, a larger logit neither); one pass counts and weighs the bins, a walk over the bins
// from the top finds the one where the count reaches k (or the mass reaches top_p of the row's),
// and only that bin's tokens are ordered. The cut is a logit: tokens at or above it are kept, so
// ties at the k-th value, or at the token that completes the mass, stay together. One call does a
// row's weights, its cuts and the masked copy, while the row is in the core's cache.
#include "torch_lite.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <utility>
#include <vector>

#include "cpu_common.h"

namespace {

constexpr int kSubBits = 4;                      // mantissa bits per binade
constexpr int kBins = 48 << kSubBits;            // w down to 2^-48 (logit - max > -33)
constexpr int kRest = kBins;                     // every smaller w (and w = 0: logits at -inf)
constexpr float kNone = -std::numeric_limits<float>::infinity();

inline int bin_of(float w) {
  uint32_t b;
  std::memcpy(&b, &w, sizeof b);
  const int64_t d = (static_cast<int64_t>(0x3F800000) - static_cast<int64_t>(b)) >> (23 - kSubBits);
  return d <= 0 ? 0 : d >= kBins ? kRest : static_cast<int>(d);  // (NaN: bin 0, garbage in)
}

// The k-th largest logit of the row (1 <= k < V).
float kth_largest(const float* l, const float* w, int64_t V, int64_t k, std::vector<float>& scratch) {
  int64_t count[kBins + 1] = {};
  for (int64_t i = 0; i < V; ++i) ++count[bin_of(w[i])];
  int b = 0;
  int64_t before = 0;
  while (b < kRest && before + count[b] < k) before += count[b++];
  scratch.clear();
  for (int64_t i = 0; i < V; ++i)
    if (bin_of(w[i]) == b) scratch.push_back(l[i]);
  const int64_t j = k - before - 1;  // the bin's (j + 1)-th largest
  std::nth_element(scratch.begin(), scratch.begin() + j, scratch.end(), std::greater<float>());
  return scratch[j];
}

// The largest logit t such that the tokens at or above t (among those at or above `floor`) hold
// at least p of their mass: the sorted walk's last kept token (kept while the mass before it is
// below p; the first always).
float top_p_cut(const float* l, const float* w, int64_t V, float p, float floor,
                std::vector<std::pair<float, float>>& scratch) {
  double mass[kBins + 1] = {}, total = 0.0;
  int64_t count[kBins + 1] = {};
  for (int64_t i = 0; i < V; ++i)
    if (l[i] >= floor) {
      const int b = bin_of(w[i]);
      mass[b] += w[i];
      ++count[b];
      total += w[i];
    }
  const double target = static_cast<double>(p) * total;
  double before = 0.0;
  int b = 0;
  while (b <= kRest && !(count[b] > 0 && before + mass[b] >= target)) before += mass[b++];
  if (b > kRest) return floor;  // not reached (rounding): keep them all
  scratch.clear();
  for (int64_t i = 0; i < V; ++i)
    if (l[i] >= floor && bin_of(w[i]) == b) scratch.emplace_back(l[i], w[i]);
  std::sort(scratch.begin(), scratch.end(), [](const auto& x, const auto& y) { return x.first > y.first; });
  for (const auto& [li, wi] : scratch) {
    before += wi;
    if (before >= target) return li;
  }
  return scratch.back().first;
}

// Each row's weights exp(logit - max), in `w`.
void row_weights(const float* l, int64_t V, float* w) {
  float m = -std::numeric_limits<float>::infinity();
  for (int64_t i = 0; i < V; ++i) m = std::max(m, l[i]);
  if (!(m > -3.0e38f)) m = 0.f;  // a row of -inf: weights 0 (not isfinite: the build's -ffast-math folds it)
  int64_t i = 0;
#if defined(__AVX512F__)
  const __m512 vm = _mm512_set1_ps(m);
  for (; i + 16 <= V; i += 16) _mm512_storeu_ps(w + i, tm_cpu::exp16(_mm512_sub_ps(_mm512_loadu_ps(l + i), vm)));
#endif
  for (; i < V; ++i) w[i] = std::exp(l[i] - m);
}

}  // namespace

// logits [R, V] float32; top_k int64 [R] (>= V: none) or None; top_p float32 [R] (>= 1: none) or
// None. Returns the logits with every token below its row's cut at -inf: the top-k cut first,
// then top-p over the tokens it keeps.
at::Tensor top_k_top_p(at::Tensor logits, c10::optional<at::Tensor> top_k, c10::optional<at::Tensor> top_p) {
  TORCH_CHECK(logits.dim() == 2 && logits.scalar_type() == at::kFloat, "top_k_top_p: float32 logits [R, V]");
  const auto l = logits.contiguous();
  const int64_t R = l.size(0), V = l.size(1);
  const auto k = top_k.has_value() ? top_k->to(at::kLong).contiguous() : at::Tensor();
  const auto p = top_p.has_value() ? top_p->to(at::kFloat).contiguous() : at::Tensor();
  TORCH_CHECK((!k.defined() || k.numel() == R) && (!p.defined() || p.numel() == R), "top_k_top_p: one k / p a row");
  auto out = tm_cpu::empty_like(l);
  at::parallel_for(0, R, 1, [&](int64_t r0, int64_t r1) {
    std::vector<float> w(V), ks;
    std::vector<std::pair<float, float>> ps;
    for (int64_t r = r0; r < r1; ++r) {
      const float* lr = l.data_ptr<float>() + r * V;
      float* o = out.data_ptr<float>() + r * V;
      const int64_t kr = k.defined() ? std::max<int64_t>(1, k.data_ptr<int64_t>()[r]) : V;
      const float pr = p.defined() ? p.data_ptr<float>()[r] : 1.f;
      float cut = kNone;
      if (kr < V || pr < 1.f) {
        row_weights(lr, V, w.data());
        if (kr < V) cut = kth_largest(lr, w.data(), V, kr, ks);
        if (pr < 1.f) cut = std::max(cut, top_p_cut(lr, w.data(), V, pr, cut, ps));
      }
      for (int64_t i = 0; i < V; ++i) o[i] = lr[i] >= cut ? lr[i] : kNone;
    }
  });
  return out;
}
