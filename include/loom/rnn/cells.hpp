#pragma once

//! @file
//! Recurrent cells h_t = f(h_{t-1}, x_t; θ) for loom::rnn::forward (the Newton solvers), with the structure of
//! their Jacobian ∂f/∂h_{t-1} declared as a loom::scan structure tag, and three provided cells:
//!
//!   para_gru<T>        ParaGRU-style GRU with diagonal recurrence          Jacobian diagonal
//!   para_lstm_cifg<T>  ParaLSTM-CIFG-style LSTM (coupled gates, peepholes)  block_diagonal<2>
//!   tanh_rnn<T>        h' = tanh(W h + x + b) (DEER's case)                  dense
//!
//! Inputs are pre-projected (as in ParaRNN and FlashRNN): x_t already holds W_x x_t for every
//! gate, so the input GEMM runs once outside the solver and the cell's per-step work is O(d)
//! (O(d²) for the dense cell). Parameters live in one flat array (θ, in the backend's memory
//! space) whose layout each cell documents; gradients come back in the same layout.
//!
//! check_jacobian() compares a cell's declared Jacobian with central finite differences of
//! step() (a debug aid; rnn::forward runs it with options.verify_jacobian).

#include <loom/config.hpp>
#include <loom/core/tensor_view.hpp>
#include <loom/rnn/detail/math.hpp>
#include <loom/scan/structure.hpp>

#include <algorithm>
#include <cmath>
#include <concepts>
#include <type_traits>
#include <vector>

namespace loom::rnn {

//! A recurrent cell. Members (step, linearize, vjp LOOM_HD; the cell is trivially copyable and
//! holds pointers into the backend's memory space):
//!   value_type, structure                  element type; loom::scan tag of ∂f/∂h (diagonal,
//!                                          block_diagonal<K>, dense)
//!   state_size(), input_size(), param_size()  d, m, |θ|
//!   step(hp[d], x[m], out[d])              out = f(hp, x)
//!   linearize(hp, x, f[d], a[a_size(d)])   f and A = ∂f/∂hp in the structure's layout
//!   vjp(hp, x, lambda[d], dx[m], dtheta)   dx = (∂f/∂x)ᵀ λ (written); dtheta += (∂f/∂θ)ᵀ λ
//! out, f and a never alias hp or x.
template <class C>
concept cell = std::is_trivially_copyable_v<C> && scan::structure<typename C::structure> &&
    requires(const C& c, const typename C::value_type* in, typename C::value_type* out) {
  typename C::value_type;
  { c.state_size() } -> std::convertible_to<index_t>;
  { c.input_size() } -> std::convertible_to<index_t>;
  { c.param_size() } -> std::convertible_to<index_t>;
  c.step(in, in, out);
  c.linearize(in, in, out, out);
  c.vjp(in, in, in, out, out);
};

//! ParaGRU-style cell (ParaRNN): a GRU whose recurrent weights are diagonal, so channel i of
//! h_t depends on channel i of h_{t-1} only and ∂f/∂h is diagonal. d channels, x_t = [x_z, x_r,
//! x_c] (3d, pre-projected), θ = [a_z, a_r, a_c, b_z, b_r, b_c] (6d):
//!   z = σ(x_z + a_z h + b_z), r = σ(x_r + a_r h + b_r), c = tanh(x_c + a_c (r h) + b_c),
//!   h' = (1 − z) h + z c.
template <class T>
struct para_gru {
  using value_type = T;
  using structure = scan::diagonal;
  const T* theta = nullptr;  //!< [6d]
  index_t d = 0;

  LOOM_HD index_t state_size() const { return d; }
  LOOM_HD index_t input_size() const { return 3 * d; }
  LOOM_HD index_t param_size() const { return 6 * d; }

  LOOM_HD void step(const T* hp, const T* x, T* out) const {
    for (index_t i = 0; i < d; ++i) {
      const T h = hp[i];
      const T z = detail::sigmoid(x[i] + theta[i] * h + theta[3 * d + i]);
      const T r = detail::sigmoid(x[d + i] + theta[d + i] * h + theta[4 * d + i]);
      const T c = detail::tanh_(x[2 * d + i] + theta[2 * d + i] * (r * h) + theta[5 * d + i]);
      out[i] = (T(1) - z) * h + z * c;
    }
  }
  LOOM_HD void linearize(const T* hp, const T* x, T* f, T* a) const {
    for (index_t i = 0; i < d; ++i) {
      const T h = hp[i], az = theta[i], ar = theta[d + i], ac = theta[2 * d + i];
      const T z = detail::sigmoid(x[i] + az * h + theta[3 * d + i]);
      const T r = detail::sigmoid(x[d + i] + ar * h + theta[4 * d + i]);
      const T c = detail::tanh_(x[2 * d + i] + ac * (r * h) + theta[5 * d + i]);
      f[i] = (T(1) - z) * h + z * c;
      const T dz = z * (T(1) - z) * az, dr = r * (T(1) - r) * ar;
      const T dc = (T(1) - c * c) * ac * (r + h * dr);
      a[i] = (T(1) - z) + (c - h) * dz + z * dc;
    }
  }
  LOOM_HD void vjp(const T* hp, const T* x, const T* lambda, T* dx, T* dtheta) const {
    for (index_t i = 0; i < d; ++i) {
      const T h = hp[i], ac = theta[2 * d + i];
      const T z = detail::sigmoid(x[i] + theta[i] * h + theta[3 * d + i]);
      const T r = detail::sigmoid(x[d + i] + theta[d + i] * h + theta[4 * d + i]);
      const T c = detail::tanh_(x[2 * d + i] + ac * (r * h) + theta[5 * d + i]);
      const T l = lambda[i];
      const T gz = l * (c - h) * z * (T(1) - z);  // through the pre-activation of z
      const T gc = l * z * (T(1) - c * c);        // through the pre-activation of c
      const T gr = gc * ac * h * r * (T(1) - r);  // through the pre-activation of r
      dx[i] = gz;
      dx[d + i] = gr;
      dx[2 * d + i] = gc;
      dtheta[i] += gz * h;
      dtheta[d + i] += gr * h;
      dtheta[2 * d + i] += gc * r * h;
      dtheta[3 * d + i] += gz;
      dtheta[4 * d + i] += gr;
      dtheta[5 * d + i] += gc;
    }
  }
};

//! ParaLSTM-CIFG-style cell (ParaRNN): an LSTM with coupled input-forget gate (i = 1 − f),
//! diagonal recurrences and peepholes. u units; the state interleaves (c, h) per unit,
//! [c_0, h_0, c_1, h_1, ...] (d = 2u), so ∂f/∂h is block-diagonal with 2 × 2 blocks.
//! x_t = [x_f, x_z, x_o] (3u, pre-projected), θ = [a_f, p_f, b_f, a_z, b_z, a_o, p_o, b_o] (8u):
//!   f = σ(x_f + a_f h + p_f c + b_f), z = tanh(x_z + a_z h + b_z), c' = f c + (1 − f) z,
//!   o = σ(x_o + a_o h + p_o c' + b_o), h' = o tanh(c').
template <class T>
struct para_lstm_cifg {
  using value_type = T;
  using structure = scan::block_diagonal<2>;
  const T* theta = nullptr;  //!< [8u]
  index_t units = 0;

  LOOM_HD index_t state_size() const { return 2 * units; }
  LOOM_HD index_t input_size() const { return 3 * units; }
  LOOM_HD index_t param_size() const { return 8 * units; }

 private:
  struct gates {
    T f, z, cn, o, tc;
  };
  LOOM_HD gates forward(const T* hp, const T* x, index_t i) const {
    const index_t u = units;
    const T c = hp[2 * i], h = hp[2 * i + 1];
    gates g;
    g.f = detail::sigmoid(x[i] + theta[i] * h + theta[u + i] * c + theta[2 * u + i]);
    g.z = detail::tanh_(x[u + i] + theta[3 * u + i] * h + theta[4 * u + i]);
    g.cn = g.f * c + (T(1) - g.f) * g.z;
    g.o = detail::sigmoid(x[2 * u + i] + theta[5 * u + i] * h + theta[6 * u + i] * g.cn + theta[7 * u + i]);
    g.tc = detail::tanh_(g.cn);
    return g;
  }

 public:
  LOOM_HD void step(const T* hp, const T* x, T* out) const {
    for (index_t i = 0; i < units; ++i) {
      const gates g = forward(hp, x, i);
      out[2 * i] = g.cn;
      out[2 * i + 1] = g.o * g.tc;
    }
  }
  LOOM_HD void linearize(const T* hp, const T* x, T* f, T* a) const {
    const index_t u = units;
    for (index_t i = 0; i < u; ++i) {
      const gates g = forward(hp, x, i);
      const T c = hp[2 * i];
      f[2 * i] = g.cn;
      f[2 * i + 1] = g.o * g.tc;
      const T sf = g.f * (T(1) - g.f), so = g.o * (T(1) - g.o);
      const T df_dc = sf * theta[u + i], df_dh = sf * theta[i];
      const T dz_dh = (T(1) - g.z * g.z) * theta[3 * u + i];
      const T dcn_dc = g.f + (c - g.z) * df_dc;
      const T dcn_dh = (c - g.z) * df_dh + (T(1) - g.f) * dz_dh;
      const T do_dc = so * theta[6 * u + i] * dcn_dc;
      const T do_dh = so * (theta[5 * u + i] + theta[6 * u + i] * dcn_dh);
      const T dt = T(1) - g.tc * g.tc;
      T* blk = a + 4 * i;  // rows (c', h'), columns (c, h)
      blk[0] = dcn_dc;
      blk[1] = dcn_dh;
      blk[2] = do_dc * g.tc + g.o * dt * dcn_dc;
      blk[3] = do_dh * g.tc + g.o * dt * dcn_dh;
    }
  }
  LOOM_HD void vjp(const T* hp, const T* x, const T* lambda, T* dx, T* dtheta) const {
    const index_t u = units;
    for (index_t i = 0; i < u; ++i) {
      const gates g = forward(hp, x, i);
      const T c = hp[2 * i], h = hp[2 * i + 1];
      const T lc = lambda[2 * i], lh = lambda[2 * i + 1];
      const T go = lh * g.tc * g.o * (T(1) - g.o);  // pre-activation of o
      const T gcn = lc + lh * g.o * (T(1) - g.tc * g.tc) + go * theta[6 * u + i];
      const T gf = gcn * (c - g.z) * g.f * (T(1) - g.f);  // pre-activation of f
      const T gz = gcn * (T(1) - g.f) * (T(1) - g.z * g.z);
      dx[i] = gf;
      dx[u + i] = gz;
      dx[2 * u + i] = go;
      dtheta[i] += gf * h;
      dtheta[u + i] += gf * c;
      dtheta[2 * u + i] += gf;
      dtheta[3 * u + i] += gz * h;
      dtheta[4 * u + i] += gz;
      dtheta[5 * u + i] += go * h;
      dtheta[6 * u + i] += go * g.cn;
      dtheta[7 * u + i] += go;
    }
  }
};

//! Dense tanh RNN (DEER): h' = tanh(W h + x + b); d channels, x_t pre-projected (d),
//! θ = [W (d × d, row-major), b (d)]. ∂f/∂h = diag(1 − h'²) W is dense: each Newton step's
//! scan composes d × d matrices (O(d³) per step); prefer quasi_newton for large d.
template <class T>
struct tanh_rnn {
  using value_type = T;
  using structure = scan::dense;
  const T* theta = nullptr;  //!< [d * d + d]
  index_t d = 0;

  LOOM_HD index_t state_size() const { return d; }
  LOOM_HD index_t input_size() const { return d; }
  LOOM_HD index_t param_size() const { return d * d + d; }

  LOOM_HD void step(const T* hp, const T* x, T* out) const {
    for (index_t i = 0; i < d; ++i) {
      T s = x[i] + theta[d * d + i];
      const T* w = theta + i * d;
      for (index_t j = 0; j < d; ++j) s += w[j] * hp[j];
      out[i] = detail::tanh_(s);
    }
  }
  LOOM_HD void linearize(const T* hp, const T* x, T* f, T* a) const {
    step(hp, x, f);
    for (index_t i = 0; i < d; ++i) {
      const T g = T(1) - f[i] * f[i];
      for (index_t j = 0; j < d; ++j) a[i * d + j] = g * theta[i * d + j];
    }
  }
  LOOM_HD void vjp(const T* hp, const T* x, const T* lambda, T* dx, T* dtheta) const {
    for (index_t i = 0; i < d; ++i) {
      T s = x[i] + theta[d * d + i];
      const T* w = theta + i * d;
      for (index_t j = 0; j < d; ++j) s += w[j] * hp[j];
      const T y = detail::tanh_(s);
      const T g = lambda[i] * (T(1) - y * y);
      dx[i] = g;
      for (index_t j = 0; j < d; ++j) dtheta[i * d + j] += g * hp[j];
      dtheta[d * d + i] += g;
    }
  }
};

//! What check_jacobian found: the largest |declared − finite difference| over the entries the
//! structure stores, and the largest |finite difference| outside them (should be ~0).
struct jacobian_check {
  double max_error = 0;    //!< inside the declared structure
  double max_outside = 0;  //!< where the structure declares zeros
  bool ok(double tol) const { return max_error <= tol && max_outside <= tol; }
};

//! Compares the declared ∂f/∂h of `c` at (hp, x) with central finite differences of step()
//! (step eps, relative to |hp|), entry by entry of the full d × d matrix. Host only: θ, hp and x
//! must be host-accessible. Work: O(d) calls of step() plus one linearize().
template <cell C>
jacobian_check check_jacobian(const C& c, const typename C::value_type* hp, const typename C::value_type* x,
                              double eps = 1e-6) {
  using T = typename C::value_type;
  using St = typename C::structure;
  const index_t d = c.state_size();
  std::vector<T> f(static_cast<std::size_t>(d)), a(static_cast<std::size_t>(St::a_size(d)));
  std::vector<T> hpert(hp, hp + d), fp(f.size()), fm(f.size());
  c.linearize(hp, x, f.data(), a.data());
  // declared(i, j): the entry of A at row i, column j, or "not stored"
  auto declared = [&](index_t i, index_t j, bool& stored) -> double {
    stored = true;
    if constexpr (St::a_rank == 1) {
      stored = i == j;
      return stored ? static_cast<double>(a[0]) : 0.0;
    } else if constexpr (St::a_rank == 2) {
      stored = i == j;
      return stored ? static_cast<double>(a[static_cast<std::size_t>(i)]) : 0.0;
    } else if constexpr (St::a_rank == 4) {
      constexpr index_t k = St::block;
      stored = i / k == j / k;
      return stored ? static_cast<double>(a[static_cast<std::size_t>((i / k) * k * k + (i % k) * k + j % k)]) : 0.0;
    } else {
      return static_cast<double>(a[static_cast<std::size_t>(i * d + j)]);
    }
  };
  jacobian_check r;
  for (index_t j = 0; j < d; ++j) {
    const T h = hp[j];
    const double step = eps * (1.0 + std::abs(static_cast<double>(h)));
    hpert[static_cast<std::size_t>(j)] = static_cast<T>(h + step);
    c.step(hpert.data(), x, fp.data());
    hpert[static_cast<std::size_t>(j)] = static_cast<T>(h - step);
    c.step(hpert.data(), x, fm.data());
    hpert[static_cast<std::size_t>(j)] = h;
    for (index_t i = 0; i < d; ++i) {
      const double fd = (static_cast<double>(fp[static_cast<std::size_t>(i)]) -
                         static_cast<double>(fm[static_cast<std::size_t>(i)])) /
                        (2 * step);
      bool stored = false;
      const double dec = declared(i, j, stored);
      if (stored)
        r.max_error = std::max(r.max_error, std::abs(dec - fd));
      else
        r.max_outside = std::max(r.max_outside, std::abs(fd));
    }
  }
  return r;
}

}  // namespace loom::rnn
