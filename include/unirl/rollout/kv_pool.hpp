#pragma once
/// \file kv_pool.hpp
/// The paged KV cache's bookkeeping (host side): a pool of fixed-size blocks with reference
/// counts, block tables, copy-on-write of a shared block, and a prefix cache keyed by block
/// content and the weights' version — plus `make_paged_batch`, which turns the sequences of one
/// engine step into the `paged_batch` a `PagedCausalLM` runs. The storage itself (`paged_kv`)
/// belongs to the model's dtype and device; this file never touches its values except to copy
/// a block (`copy_block`).
///
/// ```cpp
/// unirl::rollout::block_pool pool{/*blocks=*/64, /*block_size=*/16};
/// std::vector<std::int32_t> table;
/// pool.grow(table, /*tokens=*/40);           // 3 blocks
/// auto shared = pool.share(table);           // a second sequence on the same blocks (ref 2)
/// pool.release(table); pool.release(shared);
/// ```
#include <algorithm>
#include <cstdint>
#include <limits>
#include <list>
#include <map>
#include <optional>
#include <tuple>
#include <utility>
#include <vector>

#include <torch/torch.h>

#include <unirl/concepts/causal_lm.hpp>
#include <unirl/core/error.hpp>

namespace unirl::rollout {

/// Blocks of `block_size` token slots: block b holds slots [b * block_size, (b + 1) * block_size).
/// A free block is reused least recently freed first; a freed block that holds a cached prefix
/// stays findable (`lookup`) until it is reused.
class block_pool {
 public:
  block_pool(std::int64_t blocks, std::int64_t block_size)
      : block_size_(block_size), refs_(static_cast<std::size_t>(blocks), 0),
        where_(static_cast<std::size_t>(blocks)), key_of_(static_cast<std::size_t>(blocks)) {
    UNIRL_CHECK(blocks >= 1 && block_size >= 1, "block_pool: blocks = ", blocks, ", block_size = ", block_size,
                ": expected both >= 1");
    for (std::int32_t b = 0; b < static_cast<std::int32_t>(blocks); ++b) where_[static_cast<std::size_t>(b)] = free_.insert(free_.end(), b);
  }

  std::int64_t block_size() const { return block_size_; }
  std::int64_t blocks() const { return static_cast<std::int64_t>(refs_.size()); }
  std::int64_t free_blocks() const { return static_cast<std::int64_t>(free_.size()); }
  std::int64_t used_blocks() const { return blocks() - free_blocks(); }
  std::int32_t refs(std::int32_t b) const { return refs_[static_cast<std::size_t>(b)]; }
  /// Blocks a sequence of `tokens` tokens needs.
  std::int64_t blocks_for(std::int64_t tokens) const { return (tokens + block_size_ - 1) / block_size_; }

  /// A fresh block (ref 1), or nullopt when none is free. A reused block leaves the prefix cache.
  std::optional<std::int32_t> allocate() {
    if (free_.empty()) return std::nullopt;
    const auto b = free_.front();
    free_.pop_front();
    forget(b);
    refs_[static_cast<std::size_t>(b)] = 1;
    return b;
  }
  /// Appends blocks to `table` until it covers `tokens` slots; false (table unchanged) when the
  /// pool has too few free blocks.
  bool grow(std::vector<std::int32_t>& table, std::int64_t tokens) {
    const auto need = blocks_for(tokens) - static_cast<std::int64_t>(table.size());
    if (need <= 0) return true;
    if (need > free_blocks()) return false;
    for (std::int64_t i = 0; i < need; ++i) table.push_back(*allocate());
    return true;
  }
  /// Another reference to each block of `table` (a forked sequence shares them).
  std::vector<std::int32_t> share(const std::vector<std::int32_t>& table) {
    for (const auto b : table) take(b);
    return table;
  }
  /// One more reference to block b (taking it off the free list when it was cached there).
  void take(std::int32_t b) {
    auto& r = refs_[static_cast<std::size_t>(b)];
    if (r == 0) free_.erase(where_[static_cast<std::size_t>(b)]);
    ++r;
  }
  /// Drops one reference to each block of `table` and clears it; a block at 0 becomes free
  /// (still findable through the prefix cache until reused).
  void release(std::vector<std::int32_t>& table) {
    for (const auto b : table) {
      auto& r = refs_[static_cast<std::size_t>(b)];
      UNIRL_CHECK(r > 0, "block_pool: block ", b, " released more often than taken");
      if (--r == 0) where_[static_cast<std::size_t>(b)] = free_.insert(free_.end(), b);
    }
    table.clear();
  }

  /// The content key of a full block: the key id of the block before it (0 for the first), the
  /// weights' version and the block's tokens. Two sequences with the same key hold the same keys
  /// and values in that block.
  using content_key = std::tuple<std::int64_t, std::int64_t, std::vector<std::int64_t>>;
  /// Registers full block b under `key` unless the key is known; returns the key's id (which the
  /// next block's key names).
  std::int64_t remember(std::int32_t b, content_key key) {
    if (auto it = cache_.find(key); it != cache_.end()) return it->second.second;
    const auto id = ++next_id_;
    forget(b);
    key_of_[static_cast<std::size_t>(b)] = key;
    cache_.emplace(std::move(key), std::pair{b, id});
    return id;
  }
  /// The block cached under `key` and its id, or nullopt.
  std::optional<std::pair<std::int32_t, std::int64_t>> lookup(const content_key& key) const {
    const auto it = cache_.find(key);
    if (it == cache_.end()) return std::nullopt;
    return it->second;
  }
  /// Forgets every cached prefix (the weights changed: their keys and values are stale).
  void clear_cache() {
    cache_.clear();
    for (auto& k : key_of_) k.reset();
  }
  std::int64_t cached_blocks() const { return static_cast<std::int64_t>(cache_.size()); }

 private:
  void forget(std::int32_t b) {
    auto& k = key_of_[static_cast<std::size_t>(b)];
    if (!k) return;
    cache_.erase(*k);
    k.reset();
  }

  std::int64_t block_size_;
  std::vector<std::int32_t> refs_;
  std::list<std::int32_t> free_;
  std::vector<std::list<std::int32_t>::iterator> where_;
  std::vector<std::optional<content_key>> key_of_;
  std::map<content_key, std::pair<std::int32_t, std::int64_t>> cache_;
  std::int64_t next_id_ = 0;
};

/// Copies block `from` into block `to` in every layer of `kv` (copy-on-write of a shared block).
inline void copy_block(paged_kv& kv, std::int32_t from, std::int32_t to, std::int64_t block_size) {
  torch::NoGradGuard ng;
  for (std::size_t l = 0; l < kv.k.size(); ++l) {
    kv.k[l].narrow(0, to * block_size, block_size).copy_(kv.k[l].narrow(0, from * block_size, block_size));
    kv.v[l].narrow(0, to * block_size, block_size).copy_(kv.v[l].narrow(0, from * block_size, block_size));
  }
}

/// One sequence's part of an engine step: its tokens at positions [start, start + ids.size())
/// and its block table (covering start + ids.size() tokens).
struct paged_chunk_spec {
  std::vector<std::int64_t> ids;
  std::int64_t start = 0;
  const std::vector<std::int32_t>* table = nullptr;
  std::int64_t lead = 0;  // how many ids equal to ids[0] come right before the chunk in its sequence
};

/// The `paged_batch` of one step: the chunks' tokens packed in order, their write slots and
/// context slots from the block tables, the decode group (chunks of one token) and the causal
/// masks of the longer chunks; `output_rows` as given (host rows). Host-built, one copy to `device`.
inline paged_batch make_paged_batch(const std::vector<paged_chunk_spec>& chunks, std::int64_t block_size,
                                    const std::vector<std::int64_t>& output_rows, torch::Device device) {
  const auto i64 = torch::TensorOptions(torch::kInt64);
  auto slot = [block_size](const std::vector<std::int32_t>& t, std::int64_t p) {
    return static_cast<std::int64_t>(t[static_cast<std::size_t>(p / block_size)]) * block_size + p % block_size;
  };
  std::vector<std::int64_t> ids, pos, write, decode_rows;
  std::vector<const paged_chunk_spec*> decoders;
  paged_batch b;
  std::int64_t C = 0;
  for (const auto& c : chunks) {
    const auto n = static_cast<std::int64_t>(c.ids.size());
    UNIRL_CHECK(n >= 1 && c.table && static_cast<std::int64_t>(c.table->size()) * block_size >= c.start + n,
                "make_paged_batch: a chunk of ", n, " tokens at ", c.start, " without blocks for them");
    const auto row = static_cast<std::int64_t>(ids.size());
    for (std::int64_t j = 0; j < n; ++j) {
      const auto id = c.ids[static_cast<std::size_t>(j)];
      b.run_index.push_back(j == 0 ? c.lead : (id == c.ids[static_cast<std::size_t>(j - 1)] ? b.run_index.back() + 1 : 0));
      ids.push_back(id);
      pos.push_back(c.start + j);
      write.push_back(slot(*c.table, c.start + j));
    }
    b.max_position = std::max(b.max_position, c.start + n - 1);
    const auto ctx = c.start + n;
    if (n == 1) {
      decode_rows.push_back(row);
      decoders.push_back(&c);
      C = std::max(C, ctx);
      continue;
    }
    std::vector<std::int64_t> cs(static_cast<std::size_t>(ctx));
    for (std::int64_t p = 0; p < ctx; ++p) cs[static_cast<std::size_t>(p)] = slot(*c.table, p);
    // query j (position start + j) sees keys at positions <= start + j
    const auto qi = torch::arange(c.start, ctx, i64).unsqueeze(1);
    const auto kj = torch::arange(ctx, i64).unsqueeze(0);
    const auto bias = torch::zeros({n, ctx}).masked_fill(kj > qi, -std::numeric_limits<float>::infinity());
    b.chunks.push_back({row, n, ctx, torch::tensor(cs, i64).to(device), bias.view({1, 1, n, ctx}).to(device)});
  }
  b.ids = torch::tensor(ids, i64).to(device);
  b.host_ids = ids;
  b.positions = torch::tensor(pos, i64).to(device);
  b.write_slots = torch::tensor(write, i64).to(device);
  if (!decoders.empty()) {
    const auto S = static_cast<std::int64_t>(decoders.size());
    auto slots = torch::zeros({S, C}, i64);
    auto bias = torch::full({S, C}, -std::numeric_limits<float>::infinity());
    auto* ps = slots.data_ptr<std::int64_t>();
    auto* pb = bias.data_ptr<float>();
    for (std::int64_t i = 0; i < S; ++i) {
      const auto& c = *decoders[static_cast<std::size_t>(i)];
      for (std::int64_t p = 0; p <= c.start; ++p) {
        ps[i * C + p] = slot(*c.table, p);
        pb[i * C + p] = 0.f;
      }
      b.decode_context.push_back(c.start + 1);
    }
    b.decode_rows = torch::tensor(decode_rows, i64).to(device);
    b.decode_slots = slots.to(device);
    b.decode_bias = bias.view({S, 1, 1, C}).to(device);
  }
  if (!output_rows.empty()) b.output_rows = torch::tensor(output_rows, i64).to(device);
  return b;
}

}  // namespace unirl::rollout
