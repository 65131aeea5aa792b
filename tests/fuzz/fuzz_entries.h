// Fuzz entry points: one per parser of outside input (tensor files, LLA codecs included, go
// through the safetensors parser). Each feeds the bytes to the parser the
// way kvx reads such a file and exercises the result; a clean kvx::Error (or a JSON syntax
// error, which the file readers turn into one) is the expected outcome for bad input, anything
// else (a crash, a sanitizer report, another exception) is a defect.
// Used by the libFuzzer targets (fuzz_target.cpp) and by the regression test that replays
// tests/fuzz/seeds and tests/fuzz/regressions (test_fuzz_inputs.cpp).
#pragma once
#include <nlohmann/json.hpp>

#include <cstdint>
#include <string>
#include <string_view>

#include "compress/lla_shape.h"
#include "io/safetensors_format.h"
#include "model/config.h"
#include "model/hf_format.h"
#include "text/bpe.h"
#include "train/train_config.h"
#include "util/error.h"

namespace kvx::fuzz {

// The JSON the file readers accept (io::parse_json_file); false for a syntax error.
inline bool parse_json(std::string_view bytes, nlohmann::json* out) {
  *out = nlohmann::json::parse(bytes.begin(), bytes.end(), nullptr, /*allow_exceptions=*/false);
  return !out->is_discarded();
}

inline void safetensors(std::string_view bytes) {
  try {
    const io::SafetensorsView v = io::parse_safetensors(bytes, "fuzz.safetensors");
    for (const auto& t : v.tensors) {  // every entry's bytes lie inside the file and match its shape
      if (t.end - t.begin != static_cast<uint64_t>(t.numel()) * io::dtype_size(t.dtype) ||
          v.data_start + t.end > bytes.size())
        __builtin_trap();
    }
  } catch (const Error&) {
  }
}

inline void tokenizer_json(std::string_view bytes) {
  try {
    const text::BpeTokenizer tok = text::BpeTokenizer::from_json(std::string(bytes));
    const std::string sample = "The quick brown fox, 123 times!\n\xc3\xa9t\xc3\xa9 \xff";
    if (tok.decode(tok.encode(sample)) != sample) __builtin_trap();  // a loaded tokenizer round-trips any bytes
    for (int32_t id : tok.encode_with_special_tokens(sample))  // the post_processor's ids are tokens
      if (id < 0 || id >= tok.vocab_size()) __builtin_trap();
    const text::BpeTokenizer again = text::BpeTokenizer::from_json(tok.to_json());  // and survive a save
    if (again.special_prefix() != tok.special_prefix() || again.special_suffix() != tok.special_suffix()) __builtin_trap();
  } catch (const Error&) {
  }
}

// A config file: parsed, validated, and what it writes read back.
template <class Config>
void json_config(std::string_view bytes) {
  nlohmann::json j;
  if (!parse_json(bytes, &j)) return;
  try {
    const Config c = Config::from_json(j);
    c.validate();
    (void)Config::from_json(c.to_json());
  } catch (const Error&) {
  }
}

inline void model_config(std::string_view bytes) { json_config<model::ModelConfig>(bytes); }
// A Hugging Face config.json: translated, and what kvx would export for it translated back.
inline void hf_config(std::string_view bytes) {
  nlohmann::json j;
  if (!parse_json(bytes, &j)) return;
  try {
    const model::ModelConfig c = model::config_from_hf(j);
    if (model::config_from_hf(model::config_to_hf(c)).to_json() != c.to_json()) __builtin_trap();
  } catch (const Error&) {
  }
}
inline void run_config(std::string_view bytes) { json_config<train::RunConfig>(bytes); }
inline void lla_codec(std::string_view bytes) { json_config<compress::LlaShape>(bytes); }  // lla_codec.json

}  // namespace kvx::fuzz
