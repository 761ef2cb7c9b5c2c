#pragma once
/// \file tokenizers.hpp
/// Byte-level BPE tokenizers (Hugging Face tokenizer.json, GPT-2 vocab.json + merges.txt), chat
/// templates and a small BPE trainer; LibTorch-free. See bpe.hpp, chat.hpp, train.hpp.
///
/// ```cpp
/// #include <unirl/tokenizers/tokenizers.hpp>
/// auto tok = unirl::tokenizers::bpe_tokenizer::from_dir("Qwen2.5-0.5B-Instruct");
/// auto prompt = unirl::tokenizers::apply_chat_template(unirl::tokenizers::chat_format::qwen2_5, {{"user", "Hi"}});
/// auto ids = tok.encode(prompt);
/// ```
#include <unirl/tokenizers/bpe.hpp>
#include <unirl/tokenizers/chat.hpp>
#include <unirl/tokenizers/pre_tokenizer.hpp>
#include <unirl/tokenizers/train.hpp>
#include <unirl/tokenizers/unicode.hpp>
