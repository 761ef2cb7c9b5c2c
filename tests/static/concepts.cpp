// Every concept of the library holds for the library's models of it and fails for a near miss —
// a type that lacks one documented member, or one the concept once accepted by mistake.
#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include <torch/torch.h>

#include <unirl/data/jsonl.hpp>
#include <unirl/env.hpp>
#include <unirl/flow.hpp>
#include <unirl/joint.hpp>
#include <unirl/models/hf/causal_lm.hpp>
#include <unirl/parallel/c10d_transport.hpp>
#include <unirl/parallel/colocated.hpp>
#include <unirl/parallel/data_parallel.hpp>
#include <unirl/parallel/rollout_worker.hpp>
#include <unirl/parallel/zero.hpp>
#include <unirl/rewards.hpp>
#include <unirl/token.hpp>
#include <unirl/train/flow_matching.hpp>
#include <unirl/train/sft.hpp>
#include <unirl/vlm.hpp>

using namespace unirl;

namespace near_miss {
// ExecutionPolicy
struct bool_policy {
  static bool select(const torch::Tensor&) { return true; }  // not a backend
};
// TrainableModule / ModelAdapter
struct no_clone {
  std::vector<torch::Tensor> parameters() const { return {}; }
  named_tensors named_parameters() const { return {}; }
  named_tensors named_buffers() const { return {}; }
  void train(bool) {}
  void to(torch::Device) {}
};
struct module : no_clone {
  module clone() const { return {}; }
};
struct untracked : module {
  untracked clone() const { return {}; }
};
struct other_track {
  using rollout_type = env_rollout;
};
struct tracked : module {
  using track = other_track;
  tracked clone() const { return {}; }
};
// CausalLM: a token-track adapter without the KV-cache members
struct lm_without_cache : module {
  using track = token_track;
  lm_without_cache clone() const { return {}; }
  torch::Tensor logits(const torch::Tensor& ids, const torch::Tensor&) const { return ids; }
  std::int64_t vocab_size() const { return 8; }
};
// TokenCritic
struct critic_without_values : module {
  critic_without_values clone() const { return {}; }
};
// RolloutBatch
struct batch_without_select {
  std::int64_t size() const { return 0; }
};
// Environment
struct env_without_step {
  static constexpr std::size_t observation_size = 2;
  using observation_type = std::array<float, 2>;
  using action_space_type = discrete_space;
  using action_type = std::int64_t;
  action_space_type action_space() const { return {}; }
  observation_type reset(std::uint64_t) { return {}; }
};
// ParallelStrategy: the statistics reduction of a scalar only (what the concept once required)
struct scalar_mean_only {
  int rank() const { return 0; }
  int world_size() const { return 1; }
  void all_reduce_gradients(const std::vector<torch::Tensor>&) {}
  void broadcast(const std::vector<torch::Tensor>&, int) {}
  double all_reduce_mean(double v) { return v; }
  bool all_agree(bool ok) { return ok; }
  void sync_weights(const std::vector<torch::Tensor>&) {}
};
// ShardedParallelStrategy: owned_parameters and grad_norm, but no after_optimizer_step (the
// owners' new values would never reach the other ranks)
struct never_gathers {
  int rank() const { return 0; }
  int world_size() const { return 1; }
  void all_reduce_gradients(const std::vector<torch::Tensor>&) {}
  void broadcast(const std::vector<torch::Tensor>&, int) {}
  torch::Tensor all_reduce_mean(const torch::Tensor& v) { return v; }
  bool all_agree(bool ok) { return ok; }
  void sync_weights(const std::vector<torch::Tensor>&) {}
  named_tensors owned_parameters(const named_tensors& p) { return p; }
  torch::Tensor grad_norm(const std::vector<torch::Tensor>&) { return {}; }
};
// GroupAdvantageEstimator
struct double_estimator {
  double operator()(const torch::Tensor&, std::int64_t) const { return 0.0; }
};
// Algorithm: no supports_track
struct algorithm_without_tracks {
  struct options {
    int x = 0;
  };
  explicit algorithm_without_tracks(const options&) {}
  static constexpr bool requires_reference = false, requires_critic = false, requires_ema_rollout = false,
                        requires_group = false, supports_multi_update = true;
};
// Checkpointable
struct saves_only {
  void save(torch::serialize::OutputArchive&) const {}
};
// Reflectable
struct not_adapted {
  int a = 0;
};
// EnvPolicy
struct acts_only {
  env_action act(const torch::Tensor&) const { return {}; }
};
// VectorEnvironment
struct no_episodes {
  std::int64_t num_envs() const { return 1; }
  torch::Tensor observations() const { return {}; }
  torch::Tensor dones() const { return {}; }
  envs::vector_step step(const torch::Tensor&) { return {}; }
  std::int64_t env_steps() const { return 0; }
};
// Rewards
struct scores_doubles {
  double operator()(const token_rollout&) const { return 0.0; }
};
struct texts_only {
  std::vector<std::string> completions;
};
}  // namespace near_miss
BOOST_HANA_ADAPT_STRUCT(near_miss::algorithm_without_tracks::options, x);

namespace {
using gpt = models::gpt;
using ts_lm = models::torchscript_lm;
using flow_t = models::flow_model<models::mlp_velocity_net>;
using video_t = models::video_flow_model<models::temporal_velocity_net>;
using video_unet_t = models::video_flow_model<models::clip_unet_velocity_net>;
using ddpm_t = models::ddpm_model<models::conv_velocity_net>;
using cat_ac = models::categorical_actor_critic;
using gauss_ac = models::gaussian_actor_critic;
using cart_venv = envs::vector_env<envs::cartpole>;
using pend_venv = envs::vector_env<envs::pendulum>;
using text_reward = rewards::weighted<rewards::exact_answer, rewards::regex_format>;
}  // namespace

// ExecutionPolicy
static_assert(ExecutionPolicy<exec::automatic> && ExecutionPolicy<exec::reference> && ExecutionPolicy<exec::cpu> &&
              ExecutionPolicy<exec::cuda>);
static_assert(!ExecutionPolicy<int> && !ExecutionPolicy<near_miss::bool_policy>);

// TrainableModule, ModelAdapter, CriticFactory
static_assert(TrainableModule<near_miss::module> && !TrainableModule<near_miss::no_clone>);
static_assert(TrainableModule<models::gpt_critic>);
static_assert(ModelAdapter<gpt> && ModelAdapter<ts_lm> && ModelAdapter<flow_t> && ModelAdapter<video_t> &&
              ModelAdapter<video_unet_t> && ModelAdapter<ddpm_t> && ModelAdapter<cat_ac> && ModelAdapter<gauss_ac>);
static_assert(!ModelAdapter<near_miss::untracked> && ModelAdapter<near_miss::tracked>);
static_assert(CriticFactory<gpt>);
static_assert(!CriticFactory<ts_lm> && !CriticFactory<cat_ac> && !CriticFactory<flow_t>);

// CausalLM and its refinements, TokenCritic
static_assert(CausalLM<gpt> && CausalLM<ts_lm>);
static_assert(!CausalLM<near_miss::lm_without_cache> && !CausalLM<flow_t> && !CausalLM<cat_ac>);
static_assert(PackedCausalLM<gpt> && !PackedCausalLM<ts_lm>);
static_assert(PrefixSharingCausalLM<gpt> && !PrefixSharingCausalLM<ts_lm>);
static_assert(TokenCritic<models::gpt_critic> && PackedTokenCritic<models::gpt_critic>);
static_assert(!TokenCritic<near_miss::critic_without_values> && !TokenCritic<gpt>);

// RolloutBatch, Checkpointable, Reflectable
static_assert(RolloutBatch<token_rollout> && RolloutBatch<flow_rollout> && RolloutBatch<env_rollout> &&
              RolloutBatch<rewards::json_batch>);
static_assert(!RolloutBatch<near_miss::batch_without_select> && !RolloutBatch<prompt_batch>);
static_assert(Checkpointable<envs::cartpole> && Checkpointable<envs::pendulum> && Checkpointable<cart_venv> &&
              Checkpointable<pend_venv>);
static_assert(!Checkpointable<near_miss::saves_only> && !Checkpointable<gpt>);  // a model travels as tensors
static_assert(Reflectable<algo::grpo_options> && Reflectable<algo::ppo_token_options> &&
              Reflectable<train::optimizer_options> && Reflectable<trainer_options<algo::grpo<>>>);
static_assert(!Reflectable<near_miss::not_adapted> && !Reflectable<int>);

// Environments
static_assert(Environment<envs::cartpole> && DiscreteEnvironment<envs::cartpole> &&
              !ContinuousEnvironment<envs::cartpole>);
static_assert(Environment<envs::pendulum> && ContinuousEnvironment<envs::pendulum> &&
              !DiscreteEnvironment<envs::pendulum>);
static_assert(!Environment<near_miss::env_without_step>);
static_assert(VectorEnvironment<cart_venv> && VectorEnvironment<pend_venv>);
static_assert(!VectorEnvironment<near_miss::no_episodes> && !VectorEnvironment<envs::cartpole>);
static_assert(EnvPolicy<cat_ac> && EnvPolicy<gauss_ac>);
static_assert(!EnvPolicy<near_miss::acts_only> && !EnvPolicy<gpt>);

// Flow models, networks and samplers
static_assert(VelocityModel<flow_t> && VelocityModel<video_t> && VelocityModel<video_unet_t>);
static_assert(!VelocityModel<ddpm_t> && !VelocityModel<gpt>);
static_assert(NoiseModel<ddpm_t> && !NoiseModel<flow_t>);
static_assert(ConditionalNet<models::mlp_velocity_net> && ConditionalNet<models::conv_velocity_net> &&
              ConditionalNet<models::temporal_velocity_net> && ConditionalNet<models::clip_unet_velocity_net>);
static_assert(!ConditionalNet<models::gpt_net> && !ConditionalNet<int>);
static_assert(SamplerFor<ode::euler, flow_t> && SamplerFor<sde::flow_grpo, flow_t> &&
              SamplerFor<sde::cps, flow_t> && SamplerFor<sde::dance, video_t> &&
              SamplerFor<sde::ddim, ddpm_t>);
static_assert(!SamplerFor<sde::ddim, flow_t> && !SamplerFor<ode::euler, ddpm_t> &&
              !SamplerFor<sde::flow_grpo, ddpm_t>);

// Rewards
static_assert(RewardFor<rewards::environment_reward, env_rollout> && RewardFor<text_reward, token_rollout>);
static_assert(!RewardFor<rewards::environment_reward, token_rollout> &&
              !RewardFor<near_miss::scores_doubles, token_rollout>);
static_assert(ScorerFor<rewards::exact_answer, token_rollout> && ScorerFor<rewards::regex_format, token_rollout> &&
              ScorerFor<rewards::overlong_penalty, token_rollout> && ScorerFor<rewards::bleu_reward, token_rollout>);
static_assert(!ScorerFor<rewards::exact_answer, flow_rollout>);
static_assert(ReportsComponents<text_reward> && !ReportsComponents<rewards::exact_answer>);
static_assert(HasCompletions<token_rollout> && HasReferences<token_rollout> && HasPrompts<token_rollout> &&
              HasCompletions<rewards::json_batch>);
static_assert(!HasCompletions<flow_rollout> && !HasReferences<near_miss::texts_only> &&
              !HasPrompts<env_rollout>);
static_assert(HasImages<flow_rollout> && !HasImages<token_rollout>);
static_assert(rewards::HasCompletionLengths<token_rollout> && !rewards::HasCompletionLengths<near_miss::texts_only>);

// ParallelStrategy: the trainer reduces its statistics through all_reduce_mean(tensor)
static_assert(ParallelStrategy<parallel::single_device> && ParallelStrategy<parallel::data_parallel<parallel::gloo>>);
static_assert(ParallelStrategy<par::single_device>);  // the former namespace name still works
static_assert(!ParallelStrategy<near_miss::scalar_mean_only> && !ParallelStrategy<int>);
// ShardedParallelStrategy: zero shards the optimizer state; plain data parallelism does not
static_assert(ParallelStrategy<parallel::zero<parallel::gloo>> && ShardedParallelStrategy<parallel::zero<parallel::gloo>>);
static_assert(!ShardedParallelStrategy<parallel::data_parallel<parallel::gloo>> &&
              !ShardedParallelStrategy<parallel::single_device>);
static_assert(ParallelStrategy<near_miss::never_gathers> && !ShardedParallelStrategy<near_miss::never_gathers>);

// GroupAdvantageEstimator
static_assert(GroupAdvantageEstimator<algo::group_normalized> && GroupAdvantageEstimator<algo::dr_grpo> &&
              GroupAdvantageEstimator<algo::rloo>);
static_assert(!GroupAdvantageEstimator<near_miss::double_estimator> && !GroupAdvantageEstimator<int>);

// Algorithm: every algorithm; a family (ppo<>) is not one itself, its member for a track is
static_assert(Algorithm<algo::grpo<>> && Algorithm<algo::grpo<exec::reference>>);
static_assert(Algorithm<algo::ppo<>::for_track<token_track>> && Algorithm<algo::ppo<exec::cpu, env_track>>);
static_assert(Algorithm<algo::flow_grpo<>> && Algorithm<algo::flow_grpo<sde::dance>> &&
              Algorithm<algo::flow_dppo<>> && Algorithm<algo::ram<>> && Algorithm<algo::diffusion_nft<>>);
static_assert(!Algorithm<algo::ppo<>> && !Algorithm<near_miss::algorithm_without_tracks> && !Algorithm<int>);
static_assert(std::is_same_v<algorithm_for_t<algo::ppo<>, gpt>, algo::ppo<exec::automatic, token_track>>);
static_assert(std::is_same_v<algorithm_for_t<algo::grpo<>, gpt>, algo::grpo<>>);

// AlgorithmFor: each algorithm trains exactly the models of its track its stages can drive
static_assert(AlgorithmFor<algo::grpo<>, gpt> && AlgorithmFor<algo::grpo<>, ts_lm>);
static_assert(!AlgorithmFor<algo::grpo<>, cat_ac> && !AlgorithmFor<algo::grpo<>, flow_t> &&
              !AlgorithmFor<algo::grpo<>, near_miss::lm_without_cache>);
static_assert(AlgorithmFor<algo::ppo<>, gpt> && AlgorithmFor<algo::ppo<>, cat_ac> && AlgorithmFor<algo::ppo<>, gauss_ac>);
static_assert(AlgorithmFor<algo::flow_grpo<>, flow_t> && AlgorithmFor<algo::flow_grpo<sde::ddim>, ddpm_t> &&
              AlgorithmFor<algo::flow_dppo<sde::cps>, video_t>);
static_assert(!AlgorithmFor<algo::flow_grpo<>, ddpm_t> && !AlgorithmFor<algo::flow_grpo<>, gpt>);
static_assert(AlgorithmFor<algo::diffusion_nft<>, flow_t> && AlgorithmFor<algo::diffusion_nft<>, video_t>);
static_assert(!AlgorithmFor<algo::diffusion_nft<>, ddpm_t> &&
              !AlgorithmFor<algo::diffusion_nft<sde::ddim>, ddpm_t>);  // the NFT loss needs velocities
static_assert(AlgorithmFor<algo::ram<>, flow_t> && AlgorithmFor<algo::ram<sde::ddim>, ddpm_t>);
static_assert(!AlgorithmFor<algo::ram<>, ddpm_t>);  // an ODE velocity sampler cannot drive a noise model

// SamplesFrom: the input each algorithm draws from
static_assert(SamplesFrom<algo::grpo<>, gpt, prompt_batch> && SamplesFrom<algo::ppo<>, gpt, prompt_batch>);
static_assert(SamplesFrom<algo::ppo<>, cat_ac, cart_venv> && SamplesFrom<algo::ppo<>, gauss_ac, pend_venv>);
static_assert(SamplesFrom<algo::flow_grpo<>, flow_t, torch::Tensor>);
static_assert(!SamplesFrom<algo::grpo<>, gpt, torch::Tensor> && !SamplesFrom<algo::ppo<>, gpt, cart_venv> &&
              !SamplesFrom<algo::ppo<>, cat_ac, prompt_batch>);

// The execution-policy slot of every algorithm takes only an ExecutionPolicy
template <class E>
concept grpo_takes = requires { typename algo::grpo<E>; };
template <class E>
concept ppo_takes = requires { typename algo::ppo<E>; };
static_assert(grpo_takes<exec::reference> && ppo_takes<exec::cpu>);
static_assert(!grpo_takes<int> && !ppo_takes<int> && !grpo_takes<near_miss::bool_policy>);
static_assert(std::is_same_v<algo::grpo<exec::cuda>::exec_policy, exec::cuda>);

// A flow sampler carries its own options: the algorithms' `sampler` option is `Sampler::options`.
namespace custom {
struct one_step_options {
  std::int64_t steps = 1;
};
}  // namespace custom
BOOST_HANA_ADAPT_STRUCT(custom::one_step_options, steps);
namespace custom {
struct one_step {
  using options = one_step_options;
  options opts;
  explicit one_step(const options& o = {}) : opts(o) {}
  template <class M>
  step_coefficients coefficients(M&, double t, double t_next) const {
    return flow_math::euler(t, t_next);
  }
  template <VelocityModel M>
  torch::Tensor predict(M& m, const torch::Tensor& x, double t, const torch::Tensor& cond) const {
    return m.velocity(x, torch::full({x.size(0)}, t, x.options()), cond);
  }
  template <class M>
  std::vector<double> timesteps(M&) const { return {1.0, 0.0}; }
  logprob_reduction reduction() const { return logprob_reduction::mean; }
};
}  // namespace custom
static_assert(std::is_same_v<decltype(algo::ram<custom::one_step>::options{}.sampler), custom::one_step_options>);
static_assert(std::is_same_v<algo::flow_grpo<>::options, algo::flow_grpo_options>);
static_assert(SamplerFor<custom::one_step, flow_t> && AlgorithmFor<algo::ram<custom::one_step>, flow_t>);
static_assert(unirl::options::reflects_every_member<algo::ram<custom::one_step>::options>);

// The Hugging Face models (models/hf/), the hidden-state refinement, and the shipped models of
// the concepts above that the sections there do not name.
namespace near_miss {
// HiddenStateCausalLM: a complete CausalLM with hidden states but no LM head weight
struct lm_without_head : module {
  using track = token_track;
  struct cache_type {};
  lm_without_head clone() const { return {}; }
  torch::Tensor logits(const torch::Tensor& ids, const torch::Tensor&) const { return ids; }
  cache_type make_cache(std::int64_t, std::int64_t) const { return {}; }
  torch::Tensor logits_cached(const torch::Tensor& ids, const torch::Tensor&, cache_type&) const { return ids; }
  std::int64_t vocab_size() const { return 8; }
  torch::Tensor hidden_states(const torch::Tensor& ids, const torch::Tensor&) const { return ids; }
};
struct lm_with_head : lm_without_head {
  lm_with_head clone() const { return {}; }
  torch::Tensor lm_head_weight() const { return {}; }
};
}  // namespace near_miss
namespace {
using hf_lm = models::hf::causal_lm;
using hf_critic = models::hf::causal_lm_critic;
}  // namespace

// TrainableModule / ModelAdapter / CriticFactory: every shipped model
static_assert(TrainableModule<gpt> && TrainableModule<ts_lm> && TrainableModule<hf_lm> && TrainableModule<hf_critic> &&
              TrainableModule<cat_ac> && TrainableModule<gauss_ac> && TrainableModule<flow_t> &&
              TrainableModule<ddpm_t>);
static_assert(ModelAdapter<hf_lm> && !ModelAdapter<hf_critic> && !ModelAdapter<models::gpt_critic>);
static_assert(CriticFactory<hf_lm> && !CriticFactory<near_miss::tracked>);

// CausalLM and every refinement: the Hugging Face decoder models all of them
static_assert(CausalLM<hf_lm> && PackedCausalLM<hf_lm> && PrefixSharingCausalLM<hf_lm> && HiddenStateCausalLM<hf_lm>);
static_assert(!CausalLM<hf_critic> && !PackedCausalLM<near_miss::lm_without_cache> &&
              !PrefixSharingCausalLM<near_miss::lm_with_head>);
static_assert(HiddenStateCausalLM<near_miss::lm_with_head> && CausalLM<near_miss::lm_without_head>);
static_assert(!HiddenStateCausalLM<near_miss::lm_without_head> && !HiddenStateCausalLM<gpt> &&
              !HiddenStateCausalLM<ts_lm> && !HiddenStateCausalLM<near_miss::lm_without_cache>);
static_assert(TokenCritic<hf_critic> && PackedTokenCritic<hf_critic>);
static_assert(!TokenCritic<hf_lm> && !PackedTokenCritic<near_miss::critic_without_values>);

// The algorithms train the Hugging Face model as they train the built-in GPT
static_assert(AlgorithmFor<algo::grpo<>, hf_lm> && AlgorithmFor<algo::ppo<>, hf_lm> &&
              AlgorithmFor<algo::grpo<exec::reference>, hf_lm>);
static_assert(SamplesFrom<algo::grpo<>, hf_lm, prompt_batch> && !SamplesFrom<algo::grpo<>, hf_lm, cart_venv>);

// Checkpointable: the data sets resume where they stopped
static_assert(Checkpointable<data::jsonl_dataset> && !Checkpointable<rewards::exact_answer>);

// Every shipped reward on the batches it scores
static_assert(ScorerFor<rewards::iou_reward, token_rollout> && ScorerFor<rewards::iou_reward, rewards::json_batch> &&
              !ScorerFor<rewards::iou_reward, env_rollout> && !ScorerFor<rewards::iou_reward, near_miss::texts_only>);
static_assert(ScorerFor<rewards::exact_answer, rewards::json_batch> && !ScorerFor<rewards::regex_format, env_rollout>);
static_assert(RewardFor<rewards::learned_reward<rewards::torchscript_model>, flow_rollout> &&
              !RewardFor<rewards::learned_reward<rewards::torchscript_model>, token_rollout>);
static_assert(RewardFor<rewards::remote_scorer, token_rollout> && RewardFor<rewards::remote_scorer, flow_rollout>);
namespace {
struct encode_images {
  torch::Tensor operator()(const flow_rollout& b) const { return b.samples(); }
};
using image_alignment = rewards::embedding_alignment<encode_images, encode_images>;
}  // namespace
static_assert(RewardFor<image_alignment, flow_rollout> && !RewardFor<image_alignment, token_rollout>);

// SupervisedObjective: the SFT and flow-matching losses on the models they train; an objective
// without options, or one on the wrong kind of model, is not one
namespace near_miss {
struct objective_without_options {
  using batch_type = train::sft_batch;
  static constexpr std::string_view name = "x";
  supervised_loss loss(gpt&, const train::sft_batch&) const { return {}; }
};
struct objective_wrong_result {
  struct options {};
  using batch_type = train::sft_batch;
  static constexpr std::string_view name = "x";
  explicit objective_wrong_result(options) {}
  double loss(gpt&, const train::sft_batch&) const { return 0; }
};
}  // namespace near_miss
static_assert(SupervisedObjective<train::sft_objective<gpt>, gpt> &&
              SupervisedObjective<train::sft_objective<hf_lm>, hf_lm> &&
              SupervisedObjective<train::flow_matching_objective<flow_t>, flow_t>);
static_assert(!SupervisedObjective<near_miss::objective_without_options, gpt> &&
              !SupervisedObjective<near_miss::objective_wrong_result, gpt> &&
              !SupervisedObjective<train::sft_objective<gpt>, flow_t>);

// The VLM adapter: a CausalLM with each refinement exactly when its language model has it, a
// critic on the multimodal backbone, trained by the token track's algorithms unchanged
namespace {
using vlm_gpt = models::vlm::vlm<gpt>;
using vlm_hf = models::vlm::vlm<hf_lm>;
}  // namespace
static_assert(CausalLM<vlm_gpt> && PackedCausalLM<vlm_gpt> && PrefixSharingCausalLM<vlm_gpt> &&
              !HiddenStateCausalLM<vlm_gpt>);
static_assert(CausalLM<vlm_hf> && PackedCausalLM<vlm_hf> && PrefixSharingCausalLM<vlm_hf> && HiddenStateCausalLM<vlm_hf>);
static_assert(CriticFactory<vlm_gpt> && CriticFactory<vlm_hf>);
static_assert(TokenCritic<models::vlm::vlm_critic<gpt>> && PackedTokenCritic<models::vlm::vlm_critic<hf_lm>>);
static_assert(!TokenCritic<vlm_gpt> && !ModelAdapter<models::vlm::vlm_critic<gpt>> &&
              !CausalLM<models::vlm::vlm_critic<hf_lm>>);
static_assert(AlgorithmFor<algo::grpo<>, vlm_gpt> && AlgorithmFor<algo::ppo<>, vlm_gpt> &&
              AlgorithmFor<algo::grpo<>, vlm_hf> && AlgorithmFor<algo::ppo<>, vlm_hf>);
static_assert(SamplesFrom<algo::grpo<>, vlm_gpt, prompt_batch> && !SamplesFrom<algo::grpo<>, vlm_gpt, cart_venv>);

// Joint training: a flow trainer can end a chain, a joint::link is what a chain switches, a chain
// is itself a stepped, checkpointable trainer; near misses lack one member each
namespace near_miss {
struct flow_score {
  torch::Tensor operator()(const flow_rollout& b) { return b.samples().flatten(1).mean(1); }
};
struct first_condition {
  joint::decoded operator()(const token_rollout& b) const { return {b.completion_ids.select(1, 0), b.completion_ids.select(1, 0) >= 0}; }
};
using flow_trainer = trainer<flow_t, algo::flow_grpo<>, flow_score>;
using flow_link = joint::link<flow_trainer, first_condition>;
using lm_trainer = trainer<gpt, algo::grpo<>, flow_link>;
// stepped, but not checkpointable
struct unsaved_trainer {
  step_stats step(const torch::Tensor&) { return {}; }
};
// stepped and checkpointable, but no rollout / last_rewards: cannot end a chain
struct stepped_only : unsaved_trainer {
  void save(torch::serialize::OutputArchive&) const {}
  void load(torch::serialize::InputArchive&) {}
};
// a link that cannot report its mode
struct mute_link {
  void set_mode(generator_mode) {}
  const std::optional<step_stats>& generator_stats() const { static std::optional<step_stats> s; return s; }
};
}  // namespace near_miss
static_assert(SteppedTrainer<near_miss::flow_trainer, torch::Tensor> && SteppedTrainer<near_miss::stepped_only, torch::Tensor> &&
              SteppedTrainer<near_miss::lm_trainer, prompt_batch> &&
              SteppedTrainer<joint::chain<near_miss::lm_trainer, near_miss::flow_trainer>, prompt_batch>);
static_assert(!SteppedTrainer<near_miss::unsaved_trainer, torch::Tensor> &&
              !SteppedTrainer<near_miss::flow_trainer, prompt_batch>);
static_assert(GeneratorTrainer<near_miss::flow_trainer> && !GeneratorTrainer<near_miss::stepped_only> &&
              !GeneratorTrainer<near_miss::lm_trainer>);  // an LM trainer steps on prompts, not condition tensors
static_assert(GeneratorLink<near_miss::flow_link> && !GeneratorLink<near_miss::mute_link> &&
              !GeneratorLink<near_miss::flow_score>);

// RolloutTransport: the colocated queue and the c10d world; a near miss whose pop loses the
// batch's policy version (the learner could not tell how stale it is)
namespace near_miss {
struct unversioned_transport {
  std::int64_t max_staleness() const { return 0; }
  void publish(const std::vector<torch::Tensor>&, std::int64_t) {}
  std::int64_t fetch(const std::vector<torch::Tensor>&, std::int64_t, std::int64_t) { return 0; }
  bool push(versioned_batch<token_rollout>) { return true; }
  std::optional<token_rollout> pop(std::int64_t) { return std::nullopt; }
};
}  // namespace near_miss
static_assert(RolloutTransport<parallel::colocated_transport<token_rollout>, token_rollout> &&
              RolloutTransport<parallel::c10d_transport<token_rollout>, token_rollout> &&
              RolloutTransport<parallel::colocated_transport<flow_rollout>, flow_rollout>);
static_assert(!RolloutTransport<near_miss::unversioned_transport, token_rollout> &&
              !RolloutTransport<parallel::colocated_transport<flow_rollout>, token_rollout>);
// The wire format carries every member type of the library's rollout batches (instantiated here,
// so a new member type the wire cannot carry fails this build; round trips: unit_distributed).
[[maybe_unused]] inline constexpr auto wire_token = &parallel::wire::decode<token_rollout>;
[[maybe_unused]] inline constexpr auto wire_flow = &parallel::wire::decode<flow_rollout>;
[[maybe_unused]] inline constexpr auto wire_env = &parallel::wire::encode<env_rollout>;
