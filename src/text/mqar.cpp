#include "text/mqar.h"

#include <algorithm>
#include <string>
#include <unordered_map>

#include "util/error.h"

namespace kvx::text {

MqarSpec MqarSpec::for_vocab(int vocab_size, int pairs, int queries, int length, int symbols) {
  if (symbols < 0 || symbols > vocab_size / 4)
    throw Error("MQAR: symbols must be in [0, vocab_size/4 = " + std::to_string(vocab_size / 4) + "], got " + std::to_string(symbols));
  const int n = symbols == 0 ? vocab_size / 4 : symbols;
  MqarSpec s;
  s.key_lo = vocab_size / 4;
  s.key_hi = s.key_lo + n;
  s.value_lo = vocab_size / 2;
  s.value_hi = s.value_lo + n;
  s.pad = 0;
  s.pairs = pairs;
  s.queries = queries;
  s.length = length;
  s.validate();
  return s;
}

void MqarSpec::validate() const {
  if (pairs < 1 || queries < 1) throw Error("MQAR: pairs and queries must be >= 1");
  if (2 * pairs + 2 * queries > length)
    throw Error("MQAR: " + std::to_string(pairs) + " pairs and " + std::to_string(queries) + " queries need " +
                std::to_string(2 * pairs + 2 * queries) + " tokens but sequences have " + std::to_string(length) +
                "; use fewer pairs or longer sequences");
  if (key_hi - key_lo < pairs)
    throw Error("MQAR: " + std::to_string(pairs) + " pairs need as many distinct keys but the key range holds " +
                std::to_string(key_hi - key_lo) + "; use fewer pairs, more key symbols (up to a quarter of the "
                "vocabulary) or a larger vocabulary");
  if (value_hi <= value_lo) throw Error("MQAR: empty value range");
  if (!(key_hi <= value_lo || value_hi <= key_lo)) throw Error("MQAR: key and value ranges overlap");
}

MqarSequence make_mqar(const MqarSpec& spec, std::mt19937_64& rng) {
  spec.validate();
  MqarSequence s;
  s.tokens.assign(spec.length, spec.pad);
  s.answer.assign(spec.length, -1);
  // Distinct keys: a partial Fisher-Yates shuffle over the key range, kept sparse in a map.
  std::vector<int32_t> keys;
  std::unordered_map<int32_t, int32_t> moved;
  auto at = [&](int32_t i) {
    auto it = moved.find(i);
    return it == moved.end() ? i : it->second;
  };
  const int32_t range = spec.key_hi - spec.key_lo;
  for (int i = 0; i < spec.pairs; ++i) {
    int32_t j = i + static_cast<int32_t>(rng() % static_cast<uint64_t>(range - i));
    int32_t vi = at(i), vj = at(j);
    moved[j] = vi;
    moved[i] = vj;
    keys.push_back(spec.key_lo + vj);
  }
  std::vector<int32_t> values(spec.pairs);
  for (auto& v : values) v = spec.value_lo + static_cast<int32_t>(rng() % static_cast<uint64_t>(spec.value_hi - spec.value_lo));
  int pos = 0;
  for (int i = 0; i < spec.pairs; ++i) {
    s.tokens[pos++] = keys[i];
    s.tokens[pos++] = values[i];
  }
  std::vector<int> order(spec.pairs);
  for (int i = 0; i < spec.pairs; ++i) order[i] = i;
  int left = 0;
  for (int q = 0; q < spec.queries; ++q) {
    if (left == 0) {
      std::shuffle(order.begin(), order.end(), rng);
      left = spec.pairs;
    }
    const int i = order[--left];
    s.tokens[pos] = keys[i];
    s.answer[pos] = values[i];
    s.tokens[pos + 1] = values[i];
    pos += 2;
  }
  return s;
}

}  // namespace kvx::text
