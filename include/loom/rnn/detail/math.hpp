#pragma once

//! @file
//! Scalar math of the provided cells, LOOM_HD for float and double (C math names, which nvcc
//! provides in device code).

#include <loom/config.hpp>

#include <cmath>

namespace loom::rnn::detail {

LOOM_HD inline float tanh_(float x) { return tanhf(x); }
LOOM_HD inline double tanh_(double x) { return tanh(x); }
LOOM_HD inline float sigmoid(float x) { return 1.0f / (1.0f + expf(-x)); }
LOOM_HD inline double sigmoid(double x) { return 1.0 / (1.0 + exp(-x)); }
//! False for NaN and ±inf (written without std::isfinite so it also runs in device code).
LOOM_HD inline bool finite(double x) { return x - x == 0.0; }

}  // namespace loom::rnn::detail
