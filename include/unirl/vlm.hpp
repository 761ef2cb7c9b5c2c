#pragma once
/// \file vlm.hpp
/// Everything the vision-language track needs, with the token track it rides on: the vision
/// towers and the LLaVA projector and loader (`models/vision/`), and the VLM adapter with its
/// image table (`models/vlm/`): a `vlm::vlm<LM>` is a token-track `CausalLM`, so GRPO, PPO, the
/// sampler and the reward composer train it unchanged (docs/vlm.md).
///
/// ```cpp
/// #include <unirl/vlm.hpp>
/// namespace vlm = unirl::models::vlm;
/// auto model = vlm::make_small();                              // CLIP tower + projector + models::gpt
/// auto img = model.images().add(torch::rand({3, 28, 28}));     // image-slot ids of one image
/// std::vector<std::int64_t> prompt = {1};
/// prompt.insert(prompt.end(), img.begin(), img.end());
/// unirl::trainer<vlm::vlm<unirl::models::gpt>, unirl::algo::grpo<>, my_reward> t{model, reward,
///     {.algorithm = {.sampling = {.max_new_tokens = 8}}, .group_size = 8}};
/// auto stats = t.step(unirl::prompt_batch{.tokens = {prompt}});   // stats.extra["vision_tower_calls"] == 1
/// ```
#include <unirl/token.hpp>

#include <unirl/data/canvas.hpp>
#include <unirl/models/hf/causal_lm.hpp>
#include <unirl/models/vision/clip.hpp>
#include <unirl/models/vision/config.hpp>
#include <unirl/models/vision/llava.hpp>
#include <unirl/models/vision/projector.hpp>
#include <unirl/models/vlm/llava.hpp>
#include <unirl/models/vlm/vision_cache.hpp>
#include <unirl/models/vlm/vlm.hpp>
#include <unirl/rewards/actions.hpp>
#include <unirl/rewards/rules.hpp>
