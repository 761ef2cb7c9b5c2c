// A reflected rollout batch must adapt every member: one left out of BOOST_HANA_ADAPT_STRUCT
// would be dropped silently by select / trim / concat, so it is rejected at compile time with a
// message saying the adaptation misses a member.
#include <unirl/core/batch.hpp>

struct image_batch {
  torch::Tensor images;             // (B, C, H, W)
  torch::Tensor policy_version;     // (B,) int64: the field added later
  std::int64_t size() const { return images.size(0); }
};

#if defined(UNIRL_FAILTEST_KO)
BOOST_HANA_ADAPT_STRUCT(image_batch, images);  // policy_version forgotten
#else
BOOST_HANA_ADAPT_STRUCT(image_batch, images, policy_version);
#endif

image_batch pick_first(const image_batch& b) { return unirl::batch::select(b, torch::zeros({1}, torch::kInt64)); }
