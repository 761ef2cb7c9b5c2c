#pragma once
// io and tokenizers are one layer: neither includes the other
#include <unirl/tokenizers/bpe.hpp>
