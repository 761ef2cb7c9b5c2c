// vlm<LM> takes any language model that models unirl::EmbeddingCausalLM (concepts/embedding_lm.hpp):
// one without a forward from input embeddings (a TorchScript model) is rejected with a message
// naming the concept.
#include <unirl/models/torchscript_lm.hpp>
#include <unirl/vlm.hpp>

#if defined(UNIRL_FAILTEST_KO)
using failtest_vlm_lm = unirl::models::torchscript_lm;
#else
using failtest_vlm_lm = unirl::models::gpt;
#endif

[[maybe_unused]] unirl::models::vlm::vlm<failtest_vlm_lm>* failtest_vlm_pointer = nullptr;
