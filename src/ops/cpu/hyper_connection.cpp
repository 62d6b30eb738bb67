#include "ops/cpu/hyper_connection.h"

#include <algorithm>
#include <cmath>
#include <vector>

#include "ops/cpu/linear.h"
#include "ops/cpu/norm.h"

namespace dsv4::ops::cpu {
namespace {

float sigmoid(float x) { return 1.0f / (1.0f + std::exp(-x)); }

// mix [tokens, out] = rms(flatten(streams)) · fnᵀ
std::vector<float> normed_mix(const HyperConnectionParams& p, const float* streams, int64_t tokens, const float* fn,
                              int64_t out) {
  const int64_t width = p.hc * p.hidden;
  std::vector<float> normed(static_cast<size_t>(tokens * width));
  rms_norm(streams, tokens, width, width, nullptr, p.norm_eps, normed.data());
  std::vector<float> mix(static_cast<size_t>(tokens * out));
  linear(normed.data(), tokens, width, fn, out, mix.data());
  return mix;
}

}  // namespace

void hc_pre(const HyperConnectionParams& p, const float* streams, int64_t tokens, const float* fn, const float* base,
            const float* scale, float* collapsed, float* post, float* comb) {
  const int64_t hc = p.hc, D = p.hidden, mix_width = (2 + hc) * hc;
  const std::vector<float> mix = normed_mix(p, streams, tokens, fn, mix_width);
  std::vector<float> pre(static_cast<size_t>(hc));
  for (int64_t t = 0; t < tokens; ++t) {
    const float* m = mix.data() + t * mix_width;
    for (int64_t s = 0; s < hc; ++s) {
      pre[s] = sigmoid(m[s] * scale[0] + base[s]) + p.hc_eps;
      post[t * hc + s] = 2.0f * sigmoid(m[hc + s] * scale[1] + base[hc + s]);
    }
    // comb = softmax over each row, + eps; then column-normalise; then (iters-1) x {row, column}.
    float* c = comb + t * hc * hc;
    for (int64_t j = 0; j < hc; ++j) {
      float row_max = -INFINITY;
      for (int64_t k = 0; k < hc; ++k) {
        c[j * hc + k] = m[2 * hc + j * hc + k] * scale[2] + base[2 * hc + j * hc + k];
        row_max = std::max(row_max, c[j * hc + k]);
      }
      float sum = 0;
      for (int64_t k = 0; k < hc; ++k) sum += (c[j * hc + k] = std::exp(c[j * hc + k] - row_max));
      for (int64_t k = 0; k < hc; ++k) c[j * hc + k] = c[j * hc + k] / sum + p.hc_eps;
    }
    auto normalise_columns = [&] {
      for (int64_t k = 0; k < hc; ++k) {
        float sum = 0;
        for (int64_t j = 0; j < hc; ++j) sum += c[j * hc + k];
        for (int64_t j = 0; j < hc; ++j) c[j * hc + k] /= sum + p.hc_eps;
      }
    };
    auto normalise_rows = [&] {
      for (int64_t j = 0; j < hc; ++j) {
        float sum = 0;
        for (int64_t k = 0; k < hc; ++k) sum += c[j * hc + k];
        for (int64_t k = 0; k < hc; ++k) c[j * hc + k] /= sum + p.hc_eps;
      }
    };
    normalise_columns();
    for (int64_t iter = 1; iter < p.sinkhorn_iters; ++iter) {
      normalise_rows();
      normalise_columns();
    }
    const float* h = streams + t * hc * D;
    float* x = collapsed + t * D;
    for (int64_t d = 0; d < D; ++d) {
      float sum = 0;
      for (int64_t s = 0; s < hc; ++s) sum += pre[s] * h[s * D + d];
      x[d] = sum;
    }
  }
}

void hc_post(const HyperConnectionParams& p, const float* y, const float* streams, int64_t tokens, const float* post,
             const float* comb, float* out) {
  const int64_t hc = p.hc, D = p.hidden;
  for (int64_t t = 0; t < tokens; ++t) {
    const float* h = streams + t * hc * D;
    const float* c = comb + t * hc * hc;
    for (int64_t k = 0; k < hc; ++k) {
      float* o = out + (t * hc + k) * D;
      const float weight = post[t * hc + k];
      for (int64_t d = 0; d < D; ++d) {
        float sum = weight * y[t * D + d];
        for (int64_t j = 0; j < hc; ++j) sum += c[j * hc + k] * h[j * D + d];
        o[d] = sum;
      }
    }
  }
}

void hc_head(const HyperConnectionParams& p, const float* streams, int64_t tokens, const float* fn, const float* base,
             const float* scale, float* out) {
  const int64_t hc = p.hc, D = p.hidden;
  const std::vector<float> mix = normed_mix(p, streams, tokens, fn, hc);
  for (int64_t t = 0; t < tokens; ++t) {
    const float* h = streams + t * hc * D;
    std::vector<float> pre(static_cast<size_t>(hc));
    for (int64_t s = 0; s < hc; ++s) pre[s] = sigmoid(mix[t * hc + s] * scale[0] + base[s]) + p.hc_eps;
    for (int64_t d = 0; d < D; ++d) {
      float sum = 0;
      for (int64_t s = 0; s < hc; ++s) sum += pre[s] * h[s * D + d];
      out[t * D + d] = sum;
    }
  }
}

// ---- Numerics::kDeepSeek (docs/numerics.md) ----

namespace {

// mix [tokens, out] = fp32(Σ_double h·fn) · rsqrt(mean(h²) + norm_eps), model.py Block.hc_pre / ParallelHead.hc_head:
// the fp32 mean (double-accumulated, as rms_norm), + eps and 1/√ in fp32 (torch.rsqrt of an fp32 tensor: 1 / sqrt).
std::vector<float> raw_mix_deepseek(const HyperConnectionParams& p, const float* streams, int64_t tokens,
                                    const float* fn, int64_t out) {
  const int64_t width = p.hc * p.hidden;
  std::vector<float> mix(static_cast<size_t>(tokens * out));
  linear_f64(streams, tokens, width, fn, out, mix.data());
  for (int64_t t = 0; t < tokens; ++t) {
    const float* h = streams + t * width;
    double sum = 0.0;
    for (int64_t i = 0; i < width; ++i) sum += static_cast<double>(h[i]) * h[i];
    const float mean = static_cast<float>(sum / static_cast<double>(width));
    const float rsqrt = 1.0f / std::sqrt(mean + p.norm_eps);
    for (int64_t j = 0; j < out; ++j) mix[t * out + j] *= rsqrt;
  }
  return mix;
}

double sigmoid_f64(double x) { return 1.0 / (1.0 + std::exp(-x)); }

// Σ_s pre[s]·h[s] in fp32 (torch.sum over the stream axis: a sequential sum from 0).
void collapse(const float* pre, const float* h, int64_t hc, int64_t D, float* x) {
  for (int64_t d = 0; d < D; ++d) {
    float sum = 0;
    for (int64_t s = 0; s < hc; ++s) sum += pre[s] * h[s * D + d];
    x[d] = sum;
  }
}

}  // namespace

void hc_pre_deepseek(const HyperConnectionParams& p, double hc_eps, const float* streams, int64_t tokens,
                     const float* fn, const float* base, const float* scale, float* collapsed, float* post,
                     float* comb) {
  const int64_t hc = p.hc, D = p.hidden, mix_width = (2 + hc) * hc;
  const std::vector<float> mix = raw_mix_deepseek(p, streams, tokens, fn, mix_width);
  const double s0 = scale[0], s1 = scale[1], s2 = scale[2];
  std::vector<float> pre(static_cast<size_t>(hc));
  std::vector<double> c(static_cast<size_t>(hc * hc));
  for (int64_t t = 0; t < tokens; ++t) {
    const float* m = mix.data() + t * mix_width;
    for (int64_t s = 0; s < hc; ++s) {
      pre[s] = static_cast<float>(sigmoid_f64(m[s] * s0 + base[s]) + hc_eps);
      post[t * hc + s] = static_cast<float>(2.0 * sigmoid_f64(m[hc + s] * s1 + base[hc + s]));
    }
    // comb: row softmax + eps, column-normalise, then (iters − 1) × {row, column}, every denominator + eps.
    for (int64_t j = 0; j < hc; ++j) {
      double row_max = -INFINITY;
      for (int64_t k = 0; k < hc; ++k) {
        c[j * hc + k] = m[2 * hc + j * hc + k] * s2 + base[2 * hc + j * hc + k];
        row_max = std::max(row_max, c[j * hc + k]);
      }
      double sum = 0;
      for (int64_t k = 0; k < hc; ++k) sum += (c[j * hc + k] = std::exp(c[j * hc + k] - row_max));
      for (int64_t k = 0; k < hc; ++k) c[j * hc + k] = c[j * hc + k] / sum + hc_eps;
    }
    auto normalise_columns = [&] {
      for (int64_t k = 0; k < hc; ++k) {
        double sum = 0;
        for (int64_t j = 0; j < hc; ++j) sum += c[j * hc + k];
        for (int64_t j = 0; j < hc; ++j) c[j * hc + k] /= sum + hc_eps;
      }
    };
    auto normalise_rows = [&] {
      for (int64_t j = 0; j < hc; ++j) {
        double sum = 0;
        for (int64_t k = 0; k < hc; ++k) sum += c[j * hc + k];
        for (int64_t k = 0; k < hc; ++k) c[j * hc + k] /= sum + hc_eps;
      }
    };
    normalise_columns();
    for (int64_t iter = 1; iter < p.sinkhorn_iters; ++iter) {
      normalise_rows();
      normalise_columns();
    }
    for (int64_t i = 0; i < hc * hc; ++i) comb[t * hc * hc + i] = static_cast<float>(c[i]);
    collapse(pre.data(), streams + t * hc * D, hc, D, collapsed + t * D);
  }
}

void hc_post_deepseek(const HyperConnectionParams& p, const float* y, const float* streams, int64_t tokens,
                      const float* post, const float* comb, float* out) {
  const int64_t hc = p.hc, D = p.hidden;
  for (int64_t t = 0; t < tokens; ++t) {
    const float* h = streams + t * hc * D;
    const float* c = comb + t * hc * hc;
    for (int64_t k = 0; k < hc; ++k) {
      float* o = out + (t * hc + k) * D;
      const float weight = post[t * hc + k];
      for (int64_t d = 0; d < D; ++d) {
        float mixed = 0;
        for (int64_t j = 0; j < hc; ++j) mixed += c[j * hc + k] * h[j * D + d];
        const float sublayer = weight * y[t * D + d];
        o[d] = sublayer + mixed;
      }
    }
  }
}

void hc_head_deepseek(const HyperConnectionParams& p, const float* streams, int64_t tokens, const float* fn,
                      const float* base, const float* scale, float* out) {
  const int64_t hc = p.hc, D = p.hidden;
  const std::vector<float> mix = raw_mix_deepseek(p, streams, tokens, fn, hc);
  std::vector<float> pre(static_cast<size_t>(hc));
  for (int64_t t = 0; t < tokens; ++t) {
    for (int64_t s = 0; s < hc; ++s) {
      const float scaled = mix[t * hc + s] * scale[0];
      const float logit = scaled + base[s];
      pre[s] = static_cast<float>(sigmoid_f64(logit)) + p.hc_eps;
    }
    collapse(pre.data(), streams + t * hc * D, hc, D, out + t * D);
  }
}

}  // namespace dsv4::ops::cpu
