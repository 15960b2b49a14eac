#include "schema/rope.h"

#include <algorithm>
#include <cmath>

namespace moelora {

namespace {

std::vector<double> DefaultInvFreq(double theta, int dim) {
  std::vector<double> f;
  for (int i = 0; i < dim; i += 2) f.push_back(1.0 / std::pow(theta, static_cast<double>(i) / dim));
  return f;
}

double YarnMscale(double scale, double m) {
  return scale <= 1 ? 1.0 : 0.1 * m * std::log(scale) + 1.0;
}

}  // namespace

std::vector<double> RopeInvFreq(const RopeSpec& s, double* attention_scaling) {
  const int dim = s.rotary_dim();
  std::vector<double> inv = DefaultInvFreq(s.theta, dim);
  *attention_scaling = 1.0;
  if (s.type == "linear") {
    for (double& f : inv) f /= s.factor;
  } else if (s.type == "yarn") {
    // YaRN (arXiv 2309.00071): interpolate the low frequencies by `factor`, keep the high ones,
    // ramp linearly in between; scale cos/sin by the attention factor.
    const double factor = s.factor;
    if (s.attention_factor) {
      *attention_scaling = *s.attention_factor;
    } else if (s.mscale && s.mscale_all_dim && *s.mscale != 0 && *s.mscale_all_dim != 0) {
      *attention_scaling = YarnMscale(factor, *s.mscale) / YarnMscale(factor, *s.mscale_all_dim);
    } else {
      *attention_scaling = YarnMscale(factor, 1.0);
    }
    const double omax = s.original_max_position_embeddings;
    auto correction_dim = [&](double rotations) {
      return dim * std::log(omax / (rotations * 2 * M_PI)) / (2 * std::log(s.theta));
    };
    double low = correction_dim(s.beta_fast), high = correction_dim(s.beta_slow);
    if (s.truncate) {
      low = std::floor(low);
      high = std::ceil(high);
    }
    low = std::max(low, 0.0);
    high = std::min(high, static_cast<double>(dim - 1));
    if (low == high) high += 0.001;  // as transformers: no singular ramp
    for (size_t j = 0; j < inv.size(); ++j) {
      const double ramp = std::clamp((static_cast<double>(j) - low) / (high - low), 0.0, 1.0);
      const double extrapolation = 1.0 - ramp;  // weight of the unscaled frequency
      const double base = inv[j];
      inv[j] = base / factor * (1.0 - extrapolation) + base * extrapolation;
    }
  } else if (s.type == "llama3") {
    // Llama 3.1: long wavelengths divided by `factor`, short ones kept, smooth in between.
    const double old_len = s.original_max_position_embeddings;
    const double low_wavelen = old_len / s.low_freq_factor;
    const double high_wavelen = old_len / s.high_freq_factor;
    for (double& f : inv) {
      const double wavelen = 2 * M_PI / f;
      if (wavelen > low_wavelen) {
        f = f / s.factor;
      } else if (!(wavelen < high_wavelen)) {
        const double smooth =
            (old_len / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor);
        f = (1 - smooth) * f / s.factor + smooth * f;
      }
    }
  }
  return inv;
}

}  // namespace moelora
