// Fused router: logits -> scores -> (group-limited) top-k ids and weights + dense probs, and
// its backward (see moe_praxis/routing.py for the math; this kernel computes the same).
//
// LANES lanes per token (a power of two <= 32, so 32 / LANES tokens per warp); lane l of a
// token's group holds experts e = l + LANES * j (j < VPT), so the group reads a token's logits
// coalesced. The launcher picks LANES so that VPT is about 8 (E = 64: 8 lanes, 4 tokens per
// warp): the k rounds of arg-max then need log2(LANES) shuffle steps, not 5. (One warp per
// token at E = 64 made the forward instruction-bound on the H200:
// benchmarks/results/kernels_history.md, "router.cu: LANES per token".)
// Group-limited routing needs num_expert_groups <= LANES (the launcher raises LANES).
// Ties in the selection go to the lower expert index (jax.lax.top_k's order). Limits (checked;
// the Python side falls back to the reference beyond them): E <= 512, k <= 8,
// num_expert_groups <= 32.
//
// Forward:  logits [T, E] f32, bias [E] f32 (zeros = no bias: x + 0 == x exactly)
//           -> probs [T, E] f32, ids [T, k] i32, weights [T, k] f32
// Backward: logits [T, E], ids [T, k], dprobs [T, E], dweights [T, k] -> dlogits [T, E] f32
#include "router_kernels.cuh"

namespace moe {
namespace {

ffi::Error make_params(int64_t tokens, int64_t e, int64_t k, int64_t groups, int64_t group_topk,
                       int64_t mode, bool norm_topk, float scaling, RouterParams* p) {
  if (e < 1 || e > 512) return MOE_INVALID("router: E=" + std::to_string(e) + " must be 1..512");
  if (k < 1 || k > kMaxK || k > e) {
    return MOE_INVALID("router: top_k=" + std::to_string(k) + " must be 1..min(8, E)");
  }
  if (groups < 1 || groups > kMaxGroups || e % groups) {
    return MOE_INVALID("router: num_expert_groups=" + std::to_string(groups) +
                       " must divide E and be <= 32");
  }
  if (groups > 1 && (group_topk < 1 || group_topk > groups || k % group_topk)) {
    return MOE_INVALID("router: group_topk=" + std::to_string(group_topk) + " is invalid");
  }
  if (mode < 0 || mode > 2) return MOE_INVALID("router: mode=" + std::to_string(mode));
  *p = RouterParams{tokens, static_cast<int>(e), static_cast<int>(k), static_cast<int>(groups),
                    static_cast<int>(group_topk), static_cast<int>(mode), norm_topk, scaling};
  return ffi::Error::Success();
}

// (VPT, LANES) for E experts and G groups: LANES = the power of two near E / 8 (at least G),
// VPT = the power of two with LANES * VPT >= E.
struct Shape {
  int vpt, lanes;
};
Shape shape_for(int e, int groups) {
  int lanes = 1;
  while (lanes < 32 && lanes * 8 < e) lanes <<= 1;
  while (lanes < groups) lanes <<= 1;
  int vpt = 1;
  while (vpt * lanes < e) vpt <<= 1;
  return Shape{vpt, lanes};
}

// Launches KERNEL<VPT, LANES> for the shapes shape_for can return (E <= 512, groups <= 32).
#define MOE_ROUTER_LAUNCH(KERNEL, VPT, LANES)                                                \
  KERNEL<VPT, LANES><<<static_cast<unsigned>(ceil_div(t, kWarpsPerBlock * (32 / LANES))),   \
                       kWarpsPerBlock * 32, 0, stream>>>
#define MOE_ROUTER_DISPATCH(KERNEL, SHAPE, ...)                                    \
  do {                                                                             \
    const Shape sh_ = (SHAPE);                                                     \
    const int key_ = sh_.vpt * 64 + sh_.lanes;                                     \
    switch (key_) {                                                                \
      case 1 * 64 + 1: MOE_ROUTER_LAUNCH(KERNEL, 1, 1)(__VA_ARGS__); break;        \
      case 2 * 64 + 1: MOE_ROUTER_LAUNCH(KERNEL, 2, 1)(__VA_ARGS__); break;        \
      case 4 * 64 + 1: MOE_ROUTER_LAUNCH(KERNEL, 4, 1)(__VA_ARGS__); break;        \
      case 8 * 64 + 1: MOE_ROUTER_LAUNCH(KERNEL, 8, 1)(__VA_ARGS__); break;        \
      case 8 * 64 + 2: MOE_ROUTER_LAUNCH(KERNEL, 8, 2)(__VA_ARGS__); break;        \
      case 8 * 64 + 4: MOE_ROUTER_LAUNCH(KERNEL, 8, 4)(__VA_ARGS__); break;        \
      case 8 * 64 + 8: MOE_ROUTER_LAUNCH(KERNEL, 8, 8)(__VA_ARGS__); break;        \
      case 8 * 64 + 16: MOE_ROUTER_LAUNCH(KERNEL, 8, 16)(__VA_ARGS__); break;      \
      case 8 * 64 + 32: MOE_ROUTER_LAUNCH(KERNEL, 8, 32)(__VA_ARGS__); break;      \
      case 16 * 64 + 32: MOE_ROUTER_LAUNCH(KERNEL, 16, 32)(__VA_ARGS__); break;    \
      /* groups > E / 8 raise LANES above E / 8: then VPT < 8 */                   \
      case 1 * 64 + 2: MOE_ROUTER_LAUNCH(KERNEL, 1, 2)(__VA_ARGS__); break;        \
      case 1 * 64 + 4: MOE_ROUTER_LAUNCH(KERNEL, 1, 4)(__VA_ARGS__); break;        \
      case 1 * 64 + 8: MOE_ROUTER_LAUNCH(KERNEL, 1, 8)(__VA_ARGS__); break;        \
      case 1 * 64 + 16: MOE_ROUTER_LAUNCH(KERNEL, 1, 16)(__VA_ARGS__); break;      \
      case 1 * 64 + 32: MOE_ROUTER_LAUNCH(KERNEL, 1, 32)(__VA_ARGS__); break;      \
      case 2 * 64 + 2: MOE_ROUTER_LAUNCH(KERNEL, 2, 2)(__VA_ARGS__); break;        \
      case 2 * 64 + 4: MOE_ROUTER_LAUNCH(KERNEL, 2, 4)(__VA_ARGS__); break;        \
      case 2 * 64 + 8: MOE_ROUTER_LAUNCH(KERNEL, 2, 8)(__VA_ARGS__); break;        \
      case 2 * 64 + 16: MOE_ROUTER_LAUNCH(KERNEL, 2, 16)(__VA_ARGS__); break;      \
      case 2 * 64 + 32: MOE_ROUTER_LAUNCH(KERNEL, 2, 32)(__VA_ARGS__); break;      \
      case 4 * 64 + 2: MOE_ROUTER_LAUNCH(KERNEL, 4, 2)(__VA_ARGS__); break;        \
      case 4 * 64 + 4: MOE_ROUTER_LAUNCH(KERNEL, 4, 4)(__VA_ARGS__); break;        \
      case 4 * 64 + 8: MOE_ROUTER_LAUNCH(KERNEL, 4, 8)(__VA_ARGS__); break;        \
      case 4 * 64 + 16: MOE_ROUTER_LAUNCH(KERNEL, 4, 16)(__VA_ARGS__); break;      \
      case 4 * 64 + 32: MOE_ROUTER_LAUNCH(KERNEL, 4, 32)(__VA_ARGS__); break;      \
      default:                                                                     \
        return MOE_INVALID("router: no kernel for VPT=" + std::to_string(sh_.vpt) + \
                           ", LANES=" + std::to_string(sh_.lanes));                \
    }                                                                              \
  } while (0)

ffi::Error RouterFwdImpl(cudaStream_t stream, ffi::Buffer<ffi::F32> logits,
                         ffi::Buffer<ffi::F32> bias, ffi::Result<ffi::Buffer<ffi::F32>> probs,
                         ffi::Result<ffi::Buffer<ffi::S32>> ids,
                         ffi::Result<ffi::Buffer<ffi::F32>> weights, int64_t top_k,
                         int64_t mode, bool norm_topk, int64_t num_groups, int64_t group_topk,
                         float scaling) {
  if (logits.dimensions().size() != 2) return MOE_INVALID("router: logits must be [T, E]");
  const int64_t t = logits.dimensions()[0], e = logits.dimensions()[1];
  if (bias.element_count() != static_cast<size_t>(e)) {
    return MOE_INVALID("router: bias must have E=" + std::to_string(e) + " elements");
  }
  RouterParams prm;
  if (auto err = make_params(t, e, top_k, num_groups, group_topk, mode, norm_topk, scaling, &prm);
      !err.success())
    return err;
  if (t == 0) return ffi::Error::Success();
  MOE_ROUTER_DISPATCH(router_fwd_kernel, shape_for(e, prm.groups), logits.typed_data(), bias.typed_data(),
                      probs->typed_data(), ids->typed_data(), weights->typed_data(), prm);
  MOE_LAUNCH_CHECK("router_fwd");
  return ffi::Error::Success();
}

ffi::Error RouterBwdImpl(cudaStream_t stream, ffi::Buffer<ffi::F32> logits,
                         ffi::Buffer<ffi::S32> ids, ffi::Buffer<ffi::F32> dprobs,
                         ffi::Buffer<ffi::F32> dweights,
                         ffi::Result<ffi::Buffer<ffi::F32>> dlogits, int64_t top_k,
                         int64_t mode, bool norm_topk, int64_t num_groups, int64_t group_topk,
                         float scaling) {
  if (logits.dimensions().size() != 2) return MOE_INVALID("router bwd: logits must be [T, E]");
  const int64_t t = logits.dimensions()[0], e = logits.dimensions()[1];
  RouterParams prm;
  if (auto err = make_params(t, e, top_k, num_groups, group_topk, mode, norm_topk, scaling, &prm);
      !err.success())
    return err;
  if (ids.element_count() != static_cast<size_t>(t * top_k) ||
      dweights.element_count() != static_cast<size_t>(t * top_k) ||
      dprobs.element_count() != static_cast<size_t>(t * e)) {
    return MOE_INVALID("router bwd: ids/dweights must be [T, k] and dprobs [T, E]");
  }
  if (t == 0) return ffi::Error::Success();
  MOE_ROUTER_DISPATCH(router_bwd_kernel, shape_for(e, prm.groups), logits.typed_data(), ids.typed_data(),
                      dprobs.typed_data(), dweights.typed_data(), dlogits->typed_data(), prm);
  MOE_LAUNCH_CHECK("router_bwd");
  return ffi::Error::Success();
}

}  // namespace
}  // namespace moe

#define MOE_ROUTER_ATTRS                   \
  .Attr<int64_t>("top_k")                  \
      .Attr<int64_t>("mode")               \
      .Attr<bool>("norm_topk")             \
      .Attr<int64_t>("num_groups")         \
      .Attr<int64_t>("group_topk")         \
      .Attr<float>("scaling")

XLA_FFI_DEFINE_HANDLER_SYMBOL(MoeRouterFwd, moe::RouterFwdImpl,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<xla::ffi::Buffer<xla::ffi::F32>>()  // logits [T, E]
                                  .Arg<xla::ffi::Buffer<xla::ffi::F32>>()  // bias [E]
                                  .Ret<xla::ffi::Buffer<xla::ffi::F32>>()  // probs [T, E]
                                  .Ret<xla::ffi::Buffer<xla::ffi::S32>>()  // ids [T, k]
                                  .Ret<xla::ffi::Buffer<xla::ffi::F32>>()  // weights [T, k]
                                      MOE_ROUTER_ATTRS,
                              {xla::ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(MoeRouterBwd, moe::RouterBwdImpl,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<xla::ffi::Buffer<xla::ffi::F32>>()  // logits [T, E]
                                  .Arg<xla::ffi::Buffer<xla::ffi::S32>>()  // ids [T, k]
                                  .Arg<xla::ffi::Buffer<xla::ffi::F32>>()  // dprobs [T, E]
                                  .Arg<xla::ffi::Buffer<xla::ffi::F32>>()  // dweights [T, k]
                                  .Ret<xla::ffi::Buffer<xla::ffi::F32>>()  // dlogits [T, E]
                                      MOE_ROUTER_ATTRS,
                              {xla::ffi::Traits::kCmdBufferCompatible});
