#pragma once
// Qwen2.5-0.5B's decoder shapes with a chosen number of layers (random weights): hidden 896,
// 14 query heads / 2 KV heads of 64, MLP 4864, vocabulary 151,936, tied embeddings, rope_theta 1e6.
#include <cstdint>

#include <unirl/models/hf/config.hpp>

namespace unirl_bench {

inline unirl::models::hf::decoder_config qwen_shapes(std::int64_t layers) {
  unirl::models::hf::decoder_config c;
  c.arch = unirl::models::hf::architecture::qwen2;
  c.vocab_size = 151936;
  c.hidden_size = 896;
  c.intermediate_size = 4864;
  c.num_hidden_layers = layers;
  c.num_attention_heads = 14;
  c.num_key_value_heads = 2;
  c.head_dim = 64;
  c.max_position_embeddings = 32768;
  c.rope_theta = 1e6;
  c.tie_word_embeddings = true;
  c.eos_token_id = {151643};
  return c;
}

}  // namespace unirl_bench
