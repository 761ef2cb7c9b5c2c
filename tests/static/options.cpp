// Every options type's reflection (its BOOST_HANA_ADAPT_STRUCT, or the hand-written accessor
// table of a template) lists every member of its struct: `member_count` counts the aggregate's
// members by aggregate initialisation, independently of the reflection.
#include <unirl/data/jsonl.hpp>
#include <unirl/env.hpp>
#include <unirl/eval/bleu.hpp>
#include <unirl/eval/ssim.hpp>
#include <unirl/flow.hpp>
#include <unirl/joint.hpp>
#include <unirl/rewards.hpp>
#include <unirl/rewards/server.hpp>
#include <unirl/token.hpp>
#include <unirl/models/hf/pretrained.hpp>
#include <unirl/models/lora.hpp>
#include <unirl/multi_turn.hpp>
#include <unirl/recipes/flow_recipe.hpp>
#include <unirl/recipes/token_recipe.hpp>
#include <unirl/train/flow_matching.hpp>
#include <unirl/train/loss_scaler.hpp>
#include <unirl/train/memory.hpp>
#include <unirl/train/run_directory.hpp>
#include <unirl/train/sft.hpp>
#include <unirl/vlm.hpp>

namespace {
using unirl::options::member_count;
using unirl::options::reflects_every_member;

// The check itself: a struct with a member its reflection forgot is caught.
struct two {
  int a = 0;
  double b = 0;
};
struct three {
  int a = 0;
  double b = 0;
  std::vector<std::string> c{};
};
}  // namespace
BOOST_HANA_ADAPT_STRUCT(two, a, b);
BOOST_HANA_ADAPT_STRUCT(three, a, b);  // `c` forgotten on purpose

static_assert(member_count<two> == 2);
static_assert(member_count<three> == 3);
static_assert(reflects_every_member<two>);
static_assert(!reflects_every_member<three>);

// core / train
static_assert(reflects_every_member<unirl::sampling_options>);
static_assert(reflects_every_member<unirl::train::clip_options>);
static_assert(reflects_every_member<unirl::train::guard_options>);
static_assert(reflects_every_member<unirl::train::optimizer_options>);
static_assert(reflects_every_member<unirl::train::param_group_options>);
static_assert(reflects_every_member<unirl::train::schedule_options>);
static_assert(reflects_every_member<unirl::trainer_options<unirl::algo::grpo<>>>);
static_assert(reflects_every_member<unirl::trainer_options<unirl::algo::ppo<>::for_track<unirl::env_track>>>);
static_assert(reflects_every_member<unirl::trainer_options<unirl::algo::flow_grpo<>>>);

// algorithms
static_assert(reflects_every_member<unirl::algo::grpo_options>);
static_assert(reflects_every_member<unirl::algo::ppo_options>);
static_assert(reflects_every_member<unirl::algo::ppo_token_options>);
static_assert(reflects_every_member<unirl::algo::ppo_env_options>);
static_assert(reflects_every_member<unirl::algo::basic_ppo_options<unirl::algo::ppo_token_options>>);
static_assert(reflects_every_member<unirl::algo::basic_ppo_options<unirl::algo::ppo_env_options>>);
static_assert(reflects_every_member<unirl::algo::flow_advantage_options>);
static_assert(reflects_every_member<unirl::algo::flow_grpo_options>);
static_assert(reflects_every_member<unirl::algo::flow_dppo_options>);
static_assert(reflects_every_member<unirl::algo::ram_options>);
static_assert(reflects_every_member<unirl::algo::diffusion_nft_options>);
static_assert(reflects_every_member<unirl::flow_sampler_options>);

// models, envs, eval, data
static_assert(reflects_every_member<unirl::models::gpt_options>);
static_assert(reflects_every_member<unirl::models::actor_critic_options>);
static_assert(reflects_every_member<unirl::models::flow_model_options>);
static_assert(reflects_every_member<unirl::models::ddpm_schedule>);
static_assert(reflects_every_member<unirl::models::flow_net_options>);
static_assert(reflects_every_member<unirl::envs::vector_env_options>);
static_assert(reflects_every_member<unirl::eval::bleu_options>);
static_assert(reflects_every_member<unirl::eval::ssim_options>);
static_assert(reflects_every_member<unirl::data::jsonl_options>);

// rewards
static_assert(reflects_every_member<unirl::rewards::weighted_options>);
static_assert(reflects_every_member<unirl::rewards::exact_answer_options>);
static_assert(reflects_every_member<unirl::rewards::regex_format_options>);
static_assert(reflects_every_member<unirl::rewards::overlong_options>);
static_assert(reflects_every_member<unirl::rewards::iou_options>);
static_assert(reflects_every_member<unirl::rewards::bleu_reward_options>);
static_assert(reflects_every_member<unirl::rewards::alignment_options>);
static_assert(reflects_every_member<unirl::rewards::learned_reward_options>);
static_assert(reflects_every_member<unirl::rewards::remote_options>);
static_assert(reflects_every_member<unirl::rewards::server_options>);

// memory, precision, supervised stages, LoRA, Hugging Face I/O, recipes
static_assert(reflects_every_member<unirl::train::memory_options>);
static_assert(reflects_every_member<unirl::train::loss_scale_options>);
static_assert(reflects_every_member<unirl::train::run_directory_options>);
static_assert(reflects_every_member<unirl::train::sft_options>);
static_assert(reflects_every_member<unirl::train::flow_matching_options>);
static_assert(reflects_every_member<unirl::train::supervised_options<unirl::train::sft_options>>);
static_assert(reflects_every_member<unirl::train::supervised_options<unirl::train::flow_matching_options>>);
static_assert(reflects_every_member<unirl::lora::options>);
static_assert(reflects_every_member<unirl::lora::adapter_options>);
static_assert(reflects_every_member<unirl::models::hf::from_pretrained_options>);
static_assert(reflects_every_member<unirl::models::hf::save_pretrained_options>);
static_assert(reflects_every_member<unirl::recipes::token_recipe>);
static_assert(reflects_every_member<unirl::recipes::sft_recipe>);
static_assert(reflects_every_member<unirl::recipes::reward_recipe>);
static_assert(reflects_every_member<unirl::recipes::checkpoint_recipe>);
static_assert(reflects_every_member<unirl::recipes::flow_recipe>);
static_assert(reflects_every_member<unirl::recipes::image_reward_recipe>);
static_assert(reflects_every_member<unirl::recipes::environment_recipe>);

// multi-turn agents
static_assert(reflects_every_member<unirl::agents::agent_options>);
static_assert(reflects_every_member<unirl::agents::toolbox_options>);
static_assert(reflects_every_member<unirl::agents::tool_call_limits>);
static_assert(reflects_every_member<unirl::agents::episode_grpo_options>);
static_assert(reflects_every_member<unirl::agents::episode_ppo_options>);

// vision-language models
static_assert(reflects_every_member<unirl::models::vlm::vlm_options>);
static_assert(reflects_every_member<unirl::models::vlm::small_vlm_options>);
static_assert(reflects_every_member<unirl::models::vision::save_llava_options>);
static_assert(reflects_every_member<unirl::data::canvas_options>);
static_assert(reflects_every_member<unirl::data::canvas_grid_options>);
static_assert(reflects_every_member<unirl::rewards::click_reward_options>);
static_assert(reflects_every_member<unirl::envs::canvas_click_options>);
static_assert(reflects_every_member<unirl::rewards::clip_config>);
static_assert(reflects_every_member<unirl::rewards::encoder_train_options>);
static_assert(reflects_every_member<unirl::rewards::classifier_config>);
static_assert(reflects_every_member<unirl::rewards::answer_class_options>);

// joint training
static_assert(reflects_every_member<unirl::joint::link_options>);
static_assert(reflects_every_member<unirl::joint::stage>);
static_assert(reflects_every_member<unirl::joint::chain_options>);
static_assert(reflects_every_member<unirl::joint::multitask_options>);
