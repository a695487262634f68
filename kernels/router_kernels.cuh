// The fused router's device code: the warp-level helpers and the forward and backward kernels
// (kernels/router.cu holds the layout, the limits and the host side: the checks, the shape
// choice, the launches and the FFI handlers). Included by router.cu only, hence the
// anonymous namespace.
#pragma once

#include <cfloat>

#include "moe_common.h"

namespace moe {
namespace {

constexpr int kWarpsPerBlock = 4;
constexpr int kMaxK = 8;
constexpr int kMaxGroups = 32;
constexpr int kNoIndex = 0x7fffffff;
constexpr unsigned kFull = 0xffffffffu;

enum ScoreMode : int { kSoftmaxPre = 0, kSoftmaxPost = 1, kSigmoid = 2 };

struct RouterParams {
  int64_t tokens;
  int e, k, groups, group_topk, mode;
  bool norm_topk;
  float scaling;
};

// Reductions over the LANES lanes of one token (xor offsets < LANES stay inside the group).
template <int LANES>
__device__ __forceinline__ float group_sum(float v) {
#pragma unroll
  for (int o = LANES / 2; o > 0; o >>= 1) v += __shfl_xor_sync(kFull, v, o);
  return v;
}
template <int LANES>
__device__ __forceinline__ float group_max(float v) {
#pragma unroll
  for (int o = LANES / 2; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(kFull, v, o));
  return v;
}
// Arg-max over (value, index) with ties to the lower index.
template <int LANES>
__device__ __forceinline__ void group_argmax(float& v, int& i) {
#pragma unroll
  for (int o = LANES / 2; o > 0; o >>= 1) {
    const float v2 = __shfl_xor_sync(kFull, v, o);
    const int i2 = __shfl_xor_sync(kFull, i, o);
    if (v2 > v || (v2 == v && i2 < i)) {
      v = v2;
      i = i2;
    }
  }
}
// (value, index) packed into one 64-bit key whose unsigned order is "larger value first, then
// lower index": the high word is the float mapped to an order-preserving uint32, the low word
// the bit-inverted index. 0 means "no candidate" (below every float, -inf included).
__device__ __forceinline__ unsigned long long pack_key(float v, int idx) {
  const uint32_t u = __float_as_uint(v);
  const uint32_t ord = (u & 0x80000000u) ? ~u : (u | 0x80000000u);
  return (static_cast<unsigned long long>(ord) << 32) | (0xffffffffu - static_cast<uint32_t>(idx));
}
__device__ __forceinline__ int key_index(unsigned long long key) {
  return key == 0ull ? kNoIndex : static_cast<int>(0xffffffffu - static_cast<uint32_t>(key));
}
__device__ __forceinline__ float key_value(unsigned long long key) {
  const uint32_t ord = static_cast<uint32_t>(key >> 32);
  return __uint_as_float((ord & 0x80000000u) ? (ord & 0x7fffffffu) : ~ord);
}
template <int LANES>
__device__ __forceinline__ unsigned long long group_max_key(unsigned long long k) {
#pragma unroll
  for (int o = LANES / 2; o > 0; o >>= 1) {
    const unsigned long long k2 = __shfl_xor_sync(kFull, k, o);
    k = k2 > k ? k2 : k;
  }
  return k;
}

// Where a token's lanes sit in the warp, and which token they hold.
template <int LANES>
struct TokenLanes {
  int l;       // lane within the token's group
  int base;    // warp lane of the group's lane 0
  int64_t t;   // token (may be >= T: then nothing is loaded or stored)
  bool valid;
  __device__ __forceinline__ TokenLanes(int64_t tokens) {
    const int lane = threadIdx.x & 31;
    l = lane & (LANES - 1);
    base = lane - l;
    t = (static_cast<int64_t>(blockIdx.x) * kWarpsPerBlock + (threadIdx.x >> 5)) * (32 / LANES) +
        lane / LANES;
    valid = t < tokens;
  }
};

// Dense scores of one token: softmax or sigmoid of x (invalid slots: 0).
template <int VPT, int LANES>
__device__ __forceinline__ void dense_scores(const float (&x)[VPT], float (&d)[VPT], int l, int e,
                                             int mode, float& denom) {
  if (mode == kSigmoid) {
    float s = 0.f;
#pragma unroll
    for (int j = 0; j < VPT; ++j) {
      const bool ok = l + LANES * j < e;
      d[j] = ok ? 1.f / (1.f + expf(-x[j])) : 0.f;
      s += d[j];
    }
    denom = group_sum<LANES>(s);  // probs = d / denom
  } else {
    float m = -INFINITY;
#pragma unroll
    for (int j = 0; j < VPT; ++j) {
      if (l + LANES * j < e) m = fmaxf(m, x[j]);
    }
    m = group_max<LANES>(m);
    float s = 0.f;
#pragma unroll
    for (int j = 0; j < VPT; ++j) {
      d[j] = l + LANES * j < e ? expf(x[j] - m) : 0.f;
      s += d[j];
    }
    s = group_sum<LANES>(s);
#pragma unroll
    for (int j = 0; j < VPT; ++j) d[j] = d[j] / s;
    denom = 1.f;
  }
}

template <int VPT, int LANES>
__global__ void __launch_bounds__(kWarpsPerBlock * 32)
    router_fwd_kernel(const float* __restrict__ logits, const float* __restrict__ bias,
                      float* __restrict__ probs, int32_t* __restrict__ ids_out,
                      float* __restrict__ w_out, RouterParams prm) {
  const TokenLanes<LANES> tl(prm.tokens);
  const int l = tl.l;
  const int64_t t = tl.t;
  const int e = prm.e;
  const float* row = logits + t * e;
  float x[VPT], d[VPT], sel[VPT];
#pragma unroll
  for (int j = 0; j < VPT; ++j) {
    const int col = l + LANES * j;
    x[j] = tl.valid && col < e ? row[col] : 0.f;
  }
  float denom;
  dense_scores<VPT, LANES>(x, d, l, e, prm.mode, denom);
  // dense probabilities for the aux loss
  if (tl.valid) {
    float* prow = probs + t * e;
#pragma unroll
    for (int j = 0; j < VPT; ++j) {
      const int col = l + LANES * j;
      if (col < e) prow[col] = prm.mode == kSigmoid ? d[j] / denom : d[j];
    }
  }
  // selection scores (+ bias), payload = what the weight is made of
#pragma unroll
  for (int j = 0; j < VPT; ++j) {
    const int col = l + LANES * j;
    const float base = prm.mode == kSoftmaxPost ? x[j] : d[j];
    sel[j] = col < e ? base + __ldg(bias + col) : -INFINITY;
  }
  // group-limited routing: keep the best `group_topk` groups, scored by their top-m sum;
  // group g's score is kept by lane l == g (groups <= LANES, checked by the launcher)
  if (prm.groups > 1) {
    const int per_group = e / prm.groups;
    const int m = prm.k / prm.group_topk;
    float my_group_score = -INFINITY;
    for (int g = 0; g < prm.groups; ++g) {
      unsigned taken = 0;
      float gs = 0.f;
      for (int r = 0; r < m; ++r) {
        unsigned long long best = 0ull;
#pragma unroll
        for (int j = 0; j < VPT; ++j) {
          const int col = l + LANES * j;
          if (col < e && col / per_group == g && !((taken >> j) & 1u)) {
            const unsigned long long kk = pack_key(sel[j], col);
            best = kk > best ? kk : best;
          }
        }
        best = group_max_key<LANES>(best);
        const int bi = key_index(best);
        gs += key_value(best);
        if (bi != kNoIndex && (bi & (LANES - 1)) == l) taken |= 1u << (bi / LANES);
      }
      if (l == g) my_group_score = gs;
    }
    unsigned keep = 0;
    for (int r = 0; r < prm.group_topk; ++r) {
      const bool cand = l < prm.groups && !((keep >> l) & 1u);
      float bv = cand ? my_group_score : -INFINITY;
      int bi = cand ? l : kNoIndex;
      group_argmax<LANES>(bv, bi);
      if (bi != kNoIndex) keep |= 1u << bi;
    }
#pragma unroll
    for (int j = 0; j < VPT; ++j) {
      const int col = l + LANES * j;
      if (col < e && !((keep >> (col / per_group)) & 1u)) sel[j] = -INFINITY;
    }
  }
  // top-k: k rounds of arg-max over keys packed once (a taken key becomes 0, "no candidate");
  // payload = dense score (pre / sigmoid) or logit (post)
  unsigned long long keys[VPT];
#pragma unroll
  for (int j = 0; j < VPT; ++j) {
    const int col = l + LANES * j;
    keys[j] = col < e ? pack_key(sel[j], col) : 0ull;
  }
  int ids[kMaxK];
  float pay[kMaxK];
#pragma unroll
  for (int r = 0; r < kMaxK; ++r) {
    if (r < prm.k) {
      unsigned long long best = 0ull;
      float bp = 0.f;
#pragma unroll
      for (int j = 0; j < VPT; ++j) {
        if (keys[j] > best) {
          best = keys[j];
          bp = prm.mode == kSoftmaxPost ? x[j] : d[j];
        }
      }
      const unsigned long long win = group_max_key<LANES>(best);
      const int bi = key_index(win);
      // the payload (dense score or logit) comes from the winning lane's own best
      bp = __shfl_sync(kFull, bp, tl.base + (bi == kNoIndex ? 0 : (bi & (LANES - 1))));
      if (bi != kNoIndex && (bi & (LANES - 1)) == l) {
#pragma unroll
        for (int j = 0; j < VPT; ++j) keys[j] = j == bi / LANES ? 0ull : keys[j];
      }
      ids[r] = bi;
      pay[r] = bp;
    }
  }
  // weights
  float w[kMaxK];
  if (prm.mode == kSoftmaxPost) {
    float mx = -INFINITY;
#pragma unroll
    for (int r = 0; r < kMaxK; ++r)
      if (r < prm.k) mx = fmaxf(mx, pay[r]);
    float s = 0.f;
#pragma unroll
    for (int r = 0; r < kMaxK; ++r) {
      w[r] = r < prm.k ? expf(pay[r] - mx) : 0.f;
      s += w[r];
    }
#pragma unroll
    for (int r = 0; r < kMaxK; ++r) w[r] = w[r] / s;
  } else {
    float s = 0.f;
#pragma unroll
    for (int r = 0; r < kMaxK; ++r) {
      w[r] = r < prm.k ? pay[r] : 0.f;
      s += w[r];
    }
    if (prm.norm_topk && prm.k == 1) {
      w[0] = 1.f;  // exactly 1, with exactly zero gradient (as the reference)
    } else if (prm.norm_topk) {
      s += 1e-20f;
#pragma unroll
      for (int r = 0; r < kMaxK; ++r) w[r] = w[r] / s;
    }
  }
  // lane l writes the picks r with r % LANES == l
  if (tl.valid) {
#pragma unroll
    for (int r = 0; r < kMaxK; ++r) {
      if (r < prm.k && (r & (LANES - 1)) == l) {
        ids_out[t * prm.k + r] = ids[r];
        w_out[t * prm.k + r] = w[r] * prm.scaling;
      }
    }
  }
}

template <int VPT, int LANES>
__global__ void __launch_bounds__(kWarpsPerBlock * 32)
    router_bwd_kernel(const float* __restrict__ logits, const int32_t* __restrict__ ids_in,
                      const float* __restrict__ dprobs, const float* __restrict__ dw_in,
                      float* __restrict__ dlogits, RouterParams prm) {
  const TokenLanes<LANES> tl(prm.tokens);
  const int l = tl.l;
  const int64_t t = tl.t;
  const int e = prm.e;
  const float* row = logits + t * e;
  const float* dprow = dprobs + t * e;
  float x[VPT], d[VPT], dp[VPT];
#pragma unroll
  for (int j = 0; j < VPT; ++j) {
    const int col = l + LANES * j;
    const bool ok = tl.valid && col < e;
    x[j] = ok ? row[col] : 0.f;
    dp[j] = ok ? dprow[col] : 0.f;
  }
  float denom;
  dense_scores<VPT, LANES>(x, d, l, e, prm.mode, denom);
  // the k selected ids and their weight cotangents (loads uniform over the token's lanes)
  int ids[kMaxK];
  float dw[kMaxK], u[kMaxK];
#pragma unroll
  for (int r = 0; r < kMaxK; ++r) {
    const bool ok = tl.valid && r < prm.k;
    ids[r] = ok ? ids_in[t * prm.k + r] : -1;
    dw[r] = ok ? dw_in[t * prm.k + r] * prm.scaling : 0.f;
    u[r] = 0.f;
  }
  // gather u_r = (dense or logit)[ids[r]] from the owning lane
#pragma unroll
  for (int r = 0; r < kMaxK; ++r) {
    if (r < prm.k) {
      // every lane picks its slot ids[r] / LANES; the owner lane ids[r] % LANES broadcasts it
      const int id = ids[r] < 0 ? 0 : ids[r];
      const int slot = id / LANES;
      float mine = 0.f;
#pragma unroll
      for (int j = 0; j < VPT; ++j) {
        if (j == slot) mine = prm.mode == kSoftmaxPost ? x[j] : d[j];
      }
      u[r] = __shfl_sync(kFull, mine, tl.base + (id & (LANES - 1)));
    }
  }
  // du_r: cotangent of the selected score (pre / sigmoid) or selected logit (post)
  float du[kMaxK];
  if (prm.mode == kSoftmaxPost) {
    float mx = -INFINITY;
#pragma unroll
    for (int r = 0; r < kMaxK; ++r)
      if (r < prm.k) mx = fmaxf(mx, u[r]);
    float s = 0.f, q[kMaxK];
#pragma unroll
    for (int r = 0; r < kMaxK; ++r) {
      q[r] = r < prm.k ? expf(u[r] - mx) : 0.f;
      s += q[r];
    }
    float qdq = 0.f;
#pragma unroll
    for (int r = 0; r < kMaxK; ++r) {
      q[r] = q[r] / s;
      qdq += q[r] * dw[r];
    }
#pragma unroll
    for (int r = 0; r < kMaxK; ++r) du[r] = q[r] * (dw[r] - qdq);
  } else if (prm.norm_topk && prm.k == 1) {
#pragma unroll
    for (int r = 0; r < kMaxK; ++r) du[r] = 0.f;
  } else if (prm.norm_topk) {
    float wsum = 0.f, dwu = 0.f;
#pragma unroll
    for (int r = 0; r < kMaxK; ++r) {
      wsum += u[r];
      dwu += dw[r] * u[r];
    }
    wsum += 1e-20f;
#pragma unroll
    for (int r = 0; r < kMaxK; ++r) du[r] = dw[r] / wsum - dwu / (wsum * wsum);
  } else {
#pragma unroll
    for (int r = 0; r < kMaxK; ++r) du[r] = dw[r];
  }
  float sel_grad[VPT];
#pragma unroll
  for (int j = 0; j < VPT; ++j) {
    sel_grad[j] = 0.f;
#pragma unroll
    for (int r = 0; r < kMaxK; ++r)
      if (r < prm.k && ids[r] == l + LANES * j) sel_grad[j] += du[r];
  }
  float* drow = dlogits + t * e;
  if (prm.mode == kSigmoid) {
    // probs = d / D;  dd = dprobs / D - sum(dprobs * d) / D^2 + sel_grad;  dx = dd * d (1 - d)
    float pd = 0.f;
#pragma unroll
    for (int j = 0; j < VPT; ++j) pd += dp[j] * d[j];
    pd = group_sum<LANES>(pd);
#pragma unroll
    for (int j = 0; j < VPT; ++j) {
      const int col = l + LANES * j;
      const float dd = dp[j] / denom - pd / (denom * denom) + sel_grad[j];
      if (tl.valid && col < e) drow[col] = dd * d[j] * (1.f - d[j]);
    }
  } else {
    // softmax s = d: dx = s * (ds - sum(s * ds)); post-softmax adds the selected-logit grads
    const bool pre = prm.mode == kSoftmaxPre;
    float sds = 0.f;
#pragma unroll
    for (int j = 0; j < VPT; ++j) sds += d[j] * (dp[j] + (pre ? sel_grad[j] : 0.f));
    sds = group_sum<LANES>(sds);
#pragma unroll
    for (int j = 0; j < VPT; ++j) {
      const int col = l + LANES * j;
      const float ds = dp[j] + (pre ? sel_grad[j] : 0.f);
      float g = d[j] * (ds - sds);
      if (!pre) g += sel_grad[j];
      if (tl.valid && col < e) drow[col] = g;
    }
  }
}

}  // namespace
}  // namespace moe
