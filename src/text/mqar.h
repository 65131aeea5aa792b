// Multi-query associative recall (MQAR, the Zoology probe of softmax vs linear memory): a
// sequence of N key-value pairs, then queries that repeat keys; after each query key the model
// must produce that key's value. Token-level and torch-free.
//
//   k1 v1 k2 v2 ... kN vN | q1 a1 q2 a2 ... | pad ...
//
// Keys are distinct within a sequence and come from [key_lo, key_hi); values from
// [value_lo, value_hi) (a disjoint range); a_i is the value paired with q_i. Queries take keys
// without replacement while any are left. Only the answers are scored.
#pragma once
#include <cstdint>
#include <random>
#include <vector>

namespace kvx::text {

struct MqarSpec {
  int32_t key_lo = 0, key_hi = 0, value_lo = 0, value_hi = 0;
  int32_t pad = 0;     // token filling the tail
  int pairs = 8;       // N
  int queries = 8;     // Q
  int length = 128;    // tokens per sequence (2N + 2Q <= length)

  // Key and value ranges for a vocabulary: `symbols` keys from V/4 up and `symbols` values from
  // V/2 up; symbols = 0 takes all V/4 of each.
  static MqarSpec for_vocab(int vocab_size, int pairs, int queries, int length, int symbols = 0);
  void validate() const;  // throws kvx::Error naming the problem
};

struct MqarSequence {
  std::vector<int32_t> tokens;   // `length` tokens
  std::vector<int32_t> answer;   // answer[i] = token expected after position i, or -1 if not scored
};

MqarSequence make_mqar(const MqarSpec& spec, std::mt19937_64& rng);

}  // namespace kvx::text
